#include "kv_peer_ucx.hpp"

#include "../core/errors.hpp"

namespace cam::kv {

// ---- a peer on another host ----

UcxKVPeer::UcxKVPeer(std::shared_ptr<UcxArenaLink> link, int peer, int64_t control_offset)
    : link_(std::move(link)), peer_(peer), control_offset_(control_offset) {}

std::string UcxKVPeer::what() const { return str("cam KV transfer with rank ", peer_); }

uint64_t UcxKVPeer::load(int64_t at) {
  uint64_t v = 0;
  read(at, &v, sizeof(v));
  return v;
}

void UcxKVPeer::read(int64_t at, void* dst, size_t bytes) {
  link_->locked([&](UcxTransport& t) {
    t.get(peer_, dst, bytes, control(at), key());
    t.complete(what());
  });
}

void UcxKVPeer::write(int64_t at, const void* src, size_t bytes) {
  link_->locked([&](UcxTransport& t) {
    t.put(peer_, src, bytes, control(at), key());
    t.complete(what());  // src is the caller's: free to reuse once the put is locally complete
  });
}

void UcxKVPeer::publish(int64_t at, uint64_t value) {
  link_->locked([&](UcxTransport& t) {
    t.fence();  // every put issued before (a layer's, a slot's) lands before the counter
    t.put(peer_, &value, sizeof(value), control(at), key());
    t.complete(what());
  });
}

int64_t UcxKVPeer::copy_layer(const KVCopyPlan& plan, bool push, char* local_pool, int64_t peer_pool) {
  // The peer's pool by its address in the peer's process: the plan computes addresses on it
  // and hands them to put / get, never to a load or store here.
  char* theirs = reinterpret_cast<char*>(link_->arena(peer_).address + uint64_t(peer_pool));
  return link_->locked([&](UcxTransport& t) {
    // Moves that continue the previous one on both sides become one operation.
    char* d = nullptr;
    const char* s = nullptr;
    size_t n = 0;
    auto issue = [&] {
      if (n == 0) return;
      if (push) t.put(peer_, s, n, uint64_t(d), key());
      else t.get(peer_, d, n, uint64_t(s), key());
    };
    auto move = [&](char* dst, const char* src, size_t bytes) {
      if (n != 0 && dst == d + n && src == s + n) {
        n += bytes;
        return;
      }
      issue();
      d = dst, s = src, n = bytes;
    };
    const int64_t bytes =
        push ? plan.layer_moves(local_pool, theirs, move) : plan.layer_moves(theirs, local_pool, move);
    issue();
    t.complete(what());
    return bytes;
  });
}

std::string UcxKVPeer::dead() {
  return link_->locked([&](UcxTransport& t) { return t.peer_failure(peer_); });
}

}  // namespace cam::kv
