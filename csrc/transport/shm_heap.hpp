// ShmHeap: the symmetric heap over POSIX shared memory, for ranks of one host.
//
// Lifecycle: each rank creates its own window (so its pages are first touched on its own NUMA
// node), reserves every page up front with posix_fallocate (a full /dev/shm fails here, not
// with SIGBUS later), publishes {name, pid, host identity} through the group's store, maps all
// peers' windows, and once every rank reports "mapped" unlinks its name. From then on nothing
// of the group is visible in /dev/shm: even SIGKILL leaks nothing. A rank killed during the
// short rendezvous leaves a name behind; the next ShmHeap on the host removes names whose owner
// process is gone, and surviving ranks remove a dead peer's name when rendezvous fails.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "heap.hpp"
#include "tensor_arena.hpp"

namespace cam {

struct PeerInfo {
  std::string segment;
  int64_t pid = 0;
  uint64_t start_time = 0;  // /proc/<pid>/stat field 22, guards against pid reuse
  std::string host;         // hostname + boot id
  std::string shm_dev;      // device and inode of /dev/shm
  uint64_t window_addr = 0; // where the owner mapped its window (target of the probe)
};

class ShmHeap final : public SymmetricHeap {
 public:
  ShmHeap(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
          WindowLayout layout, std::chrono::milliseconds timeout);
  ~ShmHeap() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const WindowLayout& layout() const override { return layout_; }
  char* base(int r) const override { return bases_[r]; }
  std::string peer_failure(int r) const override;
  int64_t peer_pid(int r) const override { return peers_[r].pid; }
  bool direct_read_available() const override { return direct_read_; }
  // Cross-memory attach (process_vm_readv): one kernel copy, no staging through the window.
  void read_peer(int rank, void* local, uint64_t remote_addr, size_t n) const override;

  TensorArena* arena() const override { return arena_.get(); }

  // Removes /dev/shm names left by cam processes of this user that no longer exist.
  static int sweep_stale_segments();

 private:
  void create_own_window();
  bool probe_direct_read() const;
  void unmap_all();
  int rank_, world_;
  WindowLayout layout_;
  std::vector<char*> bases_;
  std::vector<PeerInfo> peers_;
  std::string own_name_;
  bool own_unlinked_ = false;
  bool direct_read_ = false;
  std::shared_ptr<TensorArena> arena_;
};

}  // namespace cam
