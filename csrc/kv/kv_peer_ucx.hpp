// The UCX side of a KVTransfer whose group spans hosts (kv_peer.hpp says what a peer must do):
// a peer on another host reached through the group's UcxArenaLink (its pools and its control
// block live in its tensor arena). Each operation is issued and completed under the link's
// lock; a lost peer fails only the transfers addressed to it.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <utility>
#include <vector>

#include "../transport/ucx_arena_link.hpp"
#include "kv_peer.hpp"

namespace cam::kv {

// A peer on another host (peer: its rank in the group).
class UcxKVPeer final : public KVPeer {
 public:
  UcxKVPeer(std::shared_ptr<UcxArenaLink> link, int peer, int64_t control_offset);
  uint64_t load(int64_t control_at) override;
  void read(int64_t control_at, void* dst, size_t bytes) override;
  void write(int64_t control_at, const void* src, size_t bytes) override;
  void publish(int64_t control_at, uint64_t value) override;
  int64_t copy_layer(const KVCopyPlan& plan, bool push, char* local_pool, int64_t peer_pool) override;
  int64_t arena_bytes() const override { return link_->arena(peer_).bytes; }
  std::string dead() override;

 private:
  ucp_rkey_h key() const { return link_->key(peer_); }
  uint64_t control(int64_t at) const { return link_->arena(peer_).address + uint64_t(control_offset_ + at); }
  std::string what() const;

  std::shared_ptr<UcxArenaLink> link_;
  int peer_;
  int64_t control_offset_;
};

}  // namespace cam::kv
