// The UCX side of a KVTransfer whose group spans hosts (kv_peer.hpp says what a peer must do).
//
// UcxKVLink: one UcxTransport over every rank of the group; this rank's tensor arena (its pools
// and its control block live there) registered with it once; every rank's arena address, size
// and key, exchanged through the group's store; and a server thread. Over TCP a peer's get or
// put on this rank's memory is carried out by this rank's progress, and a decode rank computes
// while a prefill rank pushes into it, so the server thread progresses the worker whenever
// traffic arrives (it sleeps on the worker's event descriptor, at most one liveness interval,
// and burns no core). The transport is used by one thread at a time: every operation runs under
// the link's lock, issued and completed inside it, then wakes the server to re-arm.
//
// A lost peer fails only the transfers addressed to it (UcxOptions::lost_peer_fails_waits off).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "../transport/ucx_transport.hpp"
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
  int rank() const { return transport_->rank(); }

  // Runs f(transport) under the lock; the server re-arms after it.
  template <class F>
  auto locked(F&& f) {
    struct Wake {
      UcxTransport& t;
      ~Wake() { t.wake(); }
    } wake{*transport_};
    std::lock_guard<std::mutex> lk(mu_);
    return f(*transport_);
  }

 private:
  void serve();
  // Publishes this rank's arena record in the store and reads every peer's.
  void publish_and_read(c10d::Store& store, char* arena, int64_t arena_bytes);

  std::unique_ptr<UcxTransport> transport_;
  std::unique_ptr<MemoryRegion> region_;
  std::vector<PeerArena> peers_;
  int64_t interval_ms_;
  std::mutex mu_;
  std::atomic<bool> stop_{false};
  std::thread server_;
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
