// UcxArenaLink: every rank of a group's tensor arena, reachable over UCX, for the extensions
// that read and write peers' heap tensors on other hosts (KV transfer, weight transfer).
//
// A SharedUcx over every rank of the group (its server thread carries out peers' gets and puts
// on this rank's memory while the owner computes or waits), this rank's tensor arena
// registered with it once, and every rank's arena address, size and key, exchanged through
// the given store (collective: every rank of the group constructs its link with the same
// store). Every operation is issued and completed under the link's lock; a lost peer fails
// only what is addressed to it.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ucx_shared.hpp"

namespace cam {

class UcxArenaLink {
 public:
  UcxArenaLink(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts, char* arena, int64_t arena_bytes);
  ~UcxArenaLink();
  UcxArenaLink(const UcxArenaLink&) = delete;
  UcxArenaLink& operator=(const UcxArenaLink&) = delete;

  struct PeerArena {
    uint64_t address = 0;  // in the peer's process: handed to put / get, never loaded here
    int64_t bytes = 0;
    std::unique_ptr<RemoteKey> key;
  };
  const PeerArena& arena(int peer) const { return peers_.at(size_t(peer)); }
  ucp_rkey_h key(int peer) const;
  int rank() const { return ucx_->options().rank; }
  int size() const { return ucx_->options().size; }

  // Bytes [offset, offset + bytes) of `peer`'s arena into dst, for each read, issued together
  // and completed before returning. Ranges outside the peer's arena are refused; a failure
  // raises naming `what` and the peer.
  struct Read {
    int peer;
    int64_t offset;
    void* dst;
    int64_t bytes;
  };
  void read(const std::vector<Read>& reads, const std::string& what);
  // Puts each of `data` into its peer's arena, then (ordered after all of them: a fence) each
  // of `after` (the counters that announce the data), completed before returning.
  struct Write {
    int peer;
    int64_t offset;
    const void* src;
    int64_t bytes;
  };
  void write(const std::vector<Write>& data, const std::vector<Write>& after, const std::string& what);
  // Why `peer` is unreachable ("" while its endpoint is up).
  std::string peer_failure(int peer);
  // Waits until `counter` (this rank's memory, which `peer` puts over UCX) reaches `target`:
  // "" then, "timeout" after timeout_s, or why the peer became unreachable. Progresses the
  // worker itself (SharedUcx::drive): the put that raises the counter wakes this thread.
  std::string wait_signal(const uint64_t& counter, uint64_t target, double timeout_s, int peer);

  template <class F>
  auto locked(F&& f) {
    return ucx_->locked(std::forward<F>(f));
  }

 private:
  // Publishes this rank's arena record in the store and reads every peer's.
  void publish_and_read(c10d::Store& store, char* arena, int64_t arena_bytes);
  void release();  // keys and registration, under the lock (the server may be progressing)
  void check_range(int peer, int64_t offset, int64_t bytes, const std::string& what) const;

  std::unique_ptr<SharedUcx> ucx_;
  std::unique_ptr<MemoryRegion> region_;
  std::vector<PeerArena> peers_;
};

}  // namespace cam
