#include "loopback_transport.hpp"

#include <cstring>
#include <thread>

#include "../core/errors.hpp"

namespace cam {
namespace {

// In one process a registration is the address itself.
class LoopbackRegion : public MemoryRegion {
 public:
  explicit LoopbackRegion(void* base) : key_(sizeof(uint64_t)) {
    const uint64_t a = uint64_t(base);
    std::memcpy(key_.data(), &a, sizeof a);
  }
  const std::vector<uint8_t>& packed_key() const override { return key_; }

 private:
  std::vector<uint8_t> key_;
};

class LoopbackKey : public RemoteKey {};

}  // namespace

LoopbackFabric::LoopbackFabric(int size, std::chrono::milliseconds timeout)
    : size_(size), timeout_(timeout), dead_(size) {
  TORCH_CHECK(size >= 1, "a loopback fabric needs at least one rank");
  for (int r = 0; r < size; ++r) windows_.push_back(std::make_unique<Window>(size));
}

LoopbackTransport::LoopbackTransport(std::shared_ptr<LoopbackFabric> fabric, int rank)
    : fabric_(std::move(fabric)), rank_(rank) {
  TORCH_CHECK(rank >= 0 && rank < fabric_->size(), "rank ", rank, " is not in a loopback fabric of ",
              fabric_->size());
}

std::unique_ptr<MemoryRegion> LoopbackTransport::register_memory(void* base, size_t) {
  return std::make_unique<LoopbackRegion>(base);
}

std::unique_ptr<RemoteKey> LoopbackTransport::unpack_key(int, const void*) { return std::make_unique<LoopbackKey>(); }

void LoopbackTransport::put(int peer, const void* src, size_t bytes, uint64_t remote_addr, const RemoteKey&) {
  if (fabric_->dead(peer)) raise("cam loopback put", str("rank ", peer, " is gone (marked dead)"));
  std::memcpy(reinterpret_cast<void*>(remote_addr), src, bytes);
}

void LoopbackTransport::post(int peer, std::vector<uint8_t> bytes) {
  if (bytes.size() > kSlotBytes)
    raise("cam loopback post", str("a descriptor of ", bytes.size(), " bytes exceeds the slot of ", kSlotBytes));
  if (fabric_->failing_posts() == peer)
    raise("cam loopback post", str("the put to rank ", peer, " failed (injected fault)"));
  auto& w = fabric_->window(peer);
  const uint64_t n = w.posted[rank_].load(std::memory_order_relaxed);  // this thread alone adds to it
  std::memcpy(w.slots.data() + (size_t(rank_) * kSlotsPerPeer + n % kSlotsPerPeer) * kSlotBytes, bytes.data(),
              bytes.size());
  w.posted[rank_].fetch_add(1, std::memory_order_release);
}

void LoopbackTransport::signal_done(int peer) {
  fabric_->window(peer).done[rank_].fetch_add(1, std::memory_order_release);
}

uint64_t LoopbackTransport::posted(int from) const {
  return fabric_->window(rank_).posted[from].load(std::memory_order_acquire);
}

uint64_t LoopbackTransport::done(int from) const {
  return fabric_->window(rank_).done[from].load(std::memory_order_acquire);
}

const uint8_t* LoopbackTransport::slot(int from, uint64_t n) const {
  return fabric_->window(rank_).slots.data() + (size_t(from) * kSlotsPerPeer + n % kSlotsPerPeer) * kSlotBytes;
}

std::string LoopbackTransport::lost_peer() const {
  for (int q = 0; q < size(); ++q)
    if (q != rank_ && fabric_->dead(q)) return str("rank ", q, " is gone (marked dead)");
  return {};
}

void LoopbackTransport::idle(std::chrono::nanoseconds) { std::this_thread::sleep_for(std::chrono::microseconds(20)); }

void LoopbackTransport::raise(const std::string& what, const std::string& why) const {
  throw FatalError(str(what, " on rank ", rank_, " of a loopback fabric: ", why));
}

}  // namespace cam
