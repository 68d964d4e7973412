// SymmetricHeap: the one interface algorithms see of the transport. Every rank of the group
// owns one window of identical layout; base(r) is where rank r's window is mapped in this
// process. Whether that came from POSIX shm, CUDA IPC or a remote engine is not visible here.
// Liveness (peer_failure) and failure reports (reported_failure, report_failure) are the
// transport's: where a report lives and how a death is seen differ per transport.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "../core/errors.hpp"

#include "window_layout.hpp"

namespace cam {

class TensorArena;

// Heap offsets name bytes a peer reads in place: in the owner's window tensor arena, or, with
// this tag, in the owner's process heap (process_heap.hpp).
constexpr int64_t kProcessHeapTag = int64_t(1) << 61;

class SymmetricHeap {
 public:
  virtual ~SymmetricHeap() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const WindowLayout& layout() const = 0;
  virtual char* base(int rank) const = 0;
  // Empty when the peer is alive; otherwise a sentence saying why it is considered dead.
  virtual std::string peer_failure(int rank) const = 0;
  // What rank r published as the failure of its group ("" while it published none).
  virtual std::string reported_failure(int rank) const = 0;
  // Publishes this rank's failure for its peers to read; only the first one is kept.
  virtual void report_failure(const std::string& why) = 0;
  virtual int64_t peer_pid(int rank) const = 0;

  // Waiting without a core (wait_bell.hpp). park: sleep at most timeout_us unless
  // still_idle() (called once the park is announced) finds work; a transport whose peers can
  // wake it returns early when one it waits on rings. ring_parked_peers: this rank's pass
  // published signals; wake the peers parked waiting for them.
  virtual void park(int64_t timeout_us, const std::function<Idleness()>& still_idle) {
    if (still_idle().idle) std::this_thread::sleep_for(std::chrono::microseconds(timeout_us));
  }
  virtual void ring_parked_peers() {}

  // Allocator of this rank's heap-resident tensors (in its window's tensor arena).
  virtual TensorArena* arena() const = 0;
  // The heap offset of [p, p + n) when peers can read it in place (it lies in this rank's
  // window tensor arena, or in its process heap while every rank maps every peer's), else -1.
  virtual int64_t heap_offset(const void* p, int64_t n) const = 0;
  // Where rank r's heap offset `off` is mapped in this process.
  virtual char* peer_heap(int r, int64_t off) const = 0;
  // "" when tensors born in the process heap (the heap allocator mode) are read in place by
  // this group; otherwise why they are staged.
  virtual std::string process_heap_problem() const = 0;

  // Single-copy path: read bytes straight out of a peer's address space (any memory of the
  // peer, not only its window). True when this rank can do so with every peer.
  virtual bool direct_read_available() const { return false; }
  // Copies n bytes at remote_addr in rank's address space to local. Throws FatalError naming
  // the peer on failure (peer gone, permission withdrawn).
  virtual void read_peer(int rank, void* local, uint64_t remote_addr, size_t n) const {
    throw FatalError(str("cam: this transport cannot read rank ", rank, "'s memory directly"));
  }
};

}  // namespace cam
