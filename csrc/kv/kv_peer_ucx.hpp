// The UCX side of a KVTransfer whose group spans hosts (kv_peer.hpp says what a peer must do).
//
// UcxKVLink: a SharedUcx over every rank of the group (its server thread carries out peers'
// gets and puts on this rank's memory while the owner computes), this rank's tensor arena
// registered with it once (its pools and its control block live there), and every rank's
// arena address, size and key, exchanged through the group's store. Each operation of a
// UcxKVPeer is issued and completed under the link's lock. A lost peer fails only the
// transfers addressed to it.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <utility>
#include <vector>

#include "../transport/ucx_shared.hpp"
#include "kv_peer.hpp"

namespace cam::kv {

class UcxKVLink {
 public:
  UcxKVLink(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts, char* arena, int64_t arena_bytes);
  ~UcxKVLink();
  UcxKVLink(const UcxKVLink&) = delete;
  UcxKVLink& operator=(const UcxKVLink&) = delete;

  struct PeerArena {
    uint64_t address = 0;
    int64_t bytes = 0;
    std::unique_ptr<RemoteKey> key;
  };
  const PeerArena& arena(int peer) const { return peers_.at(size_t(peer)); }
  template <class F>
  auto locked(F&& f) {
    return ucx_->locked(std::forward<F>(f));
  }

 private:
  // Publishes this rank's arena record in the store and reads every peer's.
  void publish_and_read(c10d::Store& store, char* arena, int64_t arena_bytes);
  void release();  // keys and registration, under the lock (the server may be progressing)

  std::unique_ptr<SharedUcx> ucx_;
  std::unique_ptr<MemoryRegion> region_;
  std::vector<PeerArena> peers_;
};

// A peer on another host (peer: its rank in the group).
class UcxKVPeer final : public KVPeer {
 public:
  UcxKVPeer(std::shared_ptr<UcxKVLink> link, int peer, int64_t control_offset);
  uint64_t load(int64_t control_at) override;
  void read(int64_t control_at, void* dst, size_t bytes) override;
  void write(int64_t control_at, const void* src, size_t bytes) override;
  void publish(int64_t control_at, uint64_t value) override;
  int64_t copy_layer(const KVCopyPlan& plan, bool push, char* local_pool, int64_t peer_pool) override;
  int64_t arena_bytes() const override { return link_->arena(peer_).bytes; }
  std::string dead() override;

 private:
  ucp_rkey_h key() const;
  uint64_t control(int64_t at) const { return link_->arena(peer_).address + uint64_t(control_offset_ + at); }
  std::string what() const;

  std::shared_ptr<UcxKVLink> link_;
  int peer_;
  int64_t control_offset_;
};

}  // namespace cam::kv
