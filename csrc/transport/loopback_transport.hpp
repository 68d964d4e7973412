// LoopbackTransport: OneSidedTransport for ranks that are threads of one process, so the
// inter-host algorithms run in tests without hosts, sockets or UCX, with faults injected on
// purpose. A LoopbackFabric holds every rank's control window; memory is read in place (this
// process's addresses are every rank's), put() is a memcpy and post() a copy plus a release add.
// Faults: mark_dead(r) makes every wait of the other ranks raise as for a lost endpoint;
// fail_posts_to(r) makes every post to r raise as a failed put.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <vector>

#include "one_sided.hpp"

namespace cam {

class LoopbackFabric {
 public:
  LoopbackFabric(int size, std::chrono::milliseconds timeout);
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void mark_dead(int rank) { dead_.at(rank).store(true, std::memory_order_release); }
  bool dead(int rank) const { return dead_.at(rank).load(std::memory_order_acquire); }
  void fail_posts_to(int rank) { fail_posts_to_.store(rank, std::memory_order_release); }
  int failing_posts() const { return fail_posts_to_.load(std::memory_order_acquire); }

  // Rank r's control window: the counters peers add to and the slots they write.
  struct Window {
    explicit Window(int size)
        : posted(size), done(size), slots(size_t(size) * OneSidedTransport::kSlotsPerPeer * OneSidedTransport::kSlotBytes) {}
    std::vector<std::atomic<uint64_t>> posted, done;
    std::vector<uint8_t> slots;
  };
  Window& window(int rank) { return *windows_.at(rank); }

 private:
  int size_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Window>> windows_;
  std::vector<std::atomic<bool>> dead_;
  std::atomic<int> fail_posts_to_{-1};
};

class LoopbackTransport : public OneSidedTransport {
 public:
  LoopbackTransport(std::shared_ptr<LoopbackFabric> fabric, int rank);

  std::string name() const override { return "loopback"; }
  int rank() const override { return rank_; }
  int size() const override { return fabric_->size(); }

  std::unique_ptr<MemoryRegion> register_memory(void* base, size_t bytes) override;
  std::unique_ptr<RemoteKey> unpack_key(int peer, const void* packed) override;
  void put(int peer, const void* src, size_t bytes, uint64_t remote_addr, const RemoteKey& key) override;
  void post(int peer, std::vector<uint8_t> bytes) override;
  void signal_done(int peer) override;
  void complete(const std::string&) override {}
  uint64_t posted(int from) const override;
  uint64_t done(int from) const override;
  const uint8_t* slot(int from, uint64_t n) const override;
  [[noreturn]] void raise(const std::string& what, const std::string& why) const override;

 protected:
  std::chrono::milliseconds timeout() const override { return fabric_->timeout(); }
  std::chrono::milliseconds liveness_interval() const override { return std::chrono::milliseconds(50); }
  bool progress() override { return false; }  // every operation completes when issued
  std::string lost_peer() const override;
  void idle(std::chrono::nanoseconds) override;  // a short sleep: the peers are threads here

 private:
  std::shared_ptr<LoopbackFabric> fabric_;
  int rank_;
};

}  // namespace cam
