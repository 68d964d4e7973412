// How a KVTransfer reaches one peer of its group: the peer's control block (kv_control.hpp) and
// the pools it registered, both named by byte offsets (control block offsets; pool offsets in
// the peer's tensor arena). One implementation per transport:
//   MappedKVPeer (kv_peer_mapped.cpp)  a peer on this host: its arena is mapped here, reads and
//                                      writes are loads and stores, a layer is one kv_copy.
//   UcxKVPeer    (kv_peer_ucx.cpp)     a peer on another host: reads are UCX gets, writes puts,
//                                      a layer is a put (push) or get (pull) per contiguous move.
// The notification protocol, the seqlock and every check live in KVTransfer, once.
//
// Contract (every implementation):
//   - load() reads a 64-bit counter with acquire order: bytes the peer wrote before releasing
//     it are visible to later reads.
//   - publish() stores a counter after every write() and copy_layer() this rank issued to the
//     peer before it: a peer that sees the new value sees those bytes.
//   - copy_layer() returns once the layer is copied (pull: readable here; push: ordered before
//     a later publish()). Failures raise c10::Error naming the peer.
//   - dead() says why the peer is gone ("" while it is reachable); it may cost a system call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kv_copy_plan.hpp"

namespace cam {
class SymmetricHeap;
}

namespace cam::kv {

class KVPeer {
 public:
  virtual ~KVPeer() = default;
  virtual uint64_t load(int64_t control_at) = 0;
  virtual void read(int64_t control_at, void* dst, size_t bytes) = 0;
  virtual void write(int64_t control_at, const void* src, size_t bytes) = 0;
  virtual void publish(int64_t control_at, uint64_t value) = 0;
  // push: this rank's pool at local_pool into the peer's at peer_pool; pull: the other way.
  virtual int64_t copy_layer(const KVCopyPlan& plan, bool push, char* local_pool, int64_t peer_pool) = 0;
  // Bytes of the peer's tensor arena: every pool offset it publishes must fit.
  virtual int64_t arena_bytes() const = 0;
  // A newly read registration: make its first transfer cheap (a mapped peer faults the pages in).
  virtual void prepare_pools(const KVLayoutDesc&, const std::vector<int64_t>& /*offsets*/) {}
  virtual std::string dead() = 0;
};

// A peer on this host, reached through the symmetric heap (local_rank: its rank in the heap).
class MappedKVPeer final : public KVPeer {
 public:
  MappedKVPeer(const SymmetricHeap& heap, int local_rank, int64_t control_offset, int64_t arena_bytes);
  uint64_t load(int64_t control_at) override;
  void read(int64_t control_at, void* dst, size_t bytes) override;
  void write(int64_t control_at, const void* src, size_t bytes) override;
  void publish(int64_t control_at, uint64_t value) override;
  int64_t copy_layer(const KVCopyPlan& plan, bool push, char* local_pool, int64_t peer_pool) override;
  int64_t arena_bytes() const override { return arena_bytes_; }
  void prepare_pools(const KVLayoutDesc& desc, const std::vector<int64_t>& offsets) override;
  std::string dead() override;

 private:
  const SymmetricHeap& heap_;
  int local_rank_;
  char* arena_;
  char* control_;
  int64_t arena_bytes_;
};

}  // namespace cam::kv
