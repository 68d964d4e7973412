#include "ucx_arena_link.hpp"

#include <algorithm>
#include <chrono>

#include "../core/errors.hpp"
#include "signal.hpp"

namespace cam {

UcxArenaLink::UcxArenaLink(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts, char* arena, int64_t arena_bytes)
    : ucx_(std::make_unique<SharedUcx>(store, std::move(opts))) {
  try {
    // Over TCP registering costs nothing; over RDMA it pins what is registered (the arena is
    // sparse: only its allocated pages should be, a refinement for when RDMA is tested).
    region_ = locked([&](UcxTransport& t) { return t.register_memory(arena, size_t(arena_bytes)); });
    publish_and_read(*store, arena, arena_bytes);
  } catch (...) {  // the destructor does not run for a half-built link
    release();
    throw;
  }
}

void UcxArenaLink::publish_and_read(c10d::Store& store, char* arena, int64_t arena_bytes) {
  const int n = size(), me = rank();
  std::vector<uint8_t> record;
  append_u64(record, uint64_t(arena));
  append_u64(record, uint64_t(arena_bytes));
  const auto& key = region_->packed_key();
  record.insert(record.end(), key.begin(), key.end());
  store.set("arena/" + std::to_string(me), record);
  peers_.resize(size_t(n));
  for (int q = 0; q < n; ++q) {
    if (q == me) continue;
    const std::vector<uint8_t> r = store.get("arena/" + std::to_string(q));
    PeerArena& p = peers_[size_t(q)];
    p.address = read_u64(r, 0);
    p.bytes = int64_t(read_u64(r, 8));
    p.key = locked([&](UcxTransport& t) { return t.unpack_key(q, r.data() + 16); });
  }
}

void UcxArenaLink::release() {
  locked([&](UcxTransport&) {
    peers_.clear();
    region_.reset();
  });
}

UcxArenaLink::~UcxArenaLink() { release(); }

ucp_rkey_h UcxArenaLink::key(int peer) const {
  return static_cast<const UcxRemoteKey&>(*arena(peer).key).get();
}

void UcxArenaLink::check_range(int peer, int64_t offset, int64_t bytes, const std::string& what) const {
  TORCH_CHECK(peer >= 0 && peer < size() && peer != rank() && arena(peer).key, what, ": rank ", peer,
              " is not another rank of the group reached over UCX");
  TORCH_CHECK(offset >= 0 && bytes >= 0 && offset <= arena(peer).bytes - bytes, what, ": bytes [", offset, ", ",
              offset + bytes, ") lie outside rank ", peer, "'s tensor heap of ", arena(peer).bytes, " bytes");
}

void UcxArenaLink::read(const std::vector<Read>& reads, const std::string& what) {
  for (const Read& r : reads) check_range(r.peer, r.offset, r.bytes, what);
  locked([&](UcxTransport& t) {
    for (const Read& r : reads) {
      if (r.bytes > 0) t.get(r.peer, r.dst, size_t(r.bytes), arena(r.peer).address + uint64_t(r.offset), key(r.peer));
    }
    t.complete(what);
  });
}

void UcxArenaLink::write(const std::vector<Write>& data, const std::vector<Write>& after, const std::string& what) {
  for (const auto* list : {&data, &after})
    for (const Write& w : *list) check_range(w.peer, w.offset, w.bytes, what);
  locked([&](UcxTransport& t) {
    auto put = [&](const Write& w) {
      if (w.bytes > 0) t.put(w.peer, w.src, size_t(w.bytes), arena(w.peer).address + uint64_t(w.offset), key(w.peer));
    };
    for (const Write& w : data) put(w);
    if (!after.empty()) {
      t.fence();  // the data lands before the counters that announce it
      for (const Write& w : after) put(w);
    }
    t.complete(what);  // the sources are the caller's: reusable once the puts complete locally
  });
}

std::string UcxArenaLink::peer_failure(int peer) {
  return locked([&](UcxTransport& t) { return t.peer_failure(peer); });
}

std::string UcxArenaLink::wait_signal(const uint64_t& counter, uint64_t target, double timeout_s, int peer) {
  using clock = std::chrono::steady_clock;
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  const auto interval = std::chrono::microseconds(std::chrono::milliseconds(ucx_->options().liveness_interval_ms));
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - clock::now());
    if (ucx_->drive([&](UcxTransport&) { return signal_acquire(counter) >= target; },
                    std::clamp(left, std::chrono::microseconds(0), interval)))
      return {};
    std::string why = ucx_->inspect([&](UcxTransport& t) { return t.peer_failure(peer); });
    if (!why.empty()) return why;
    if (clock::now() >= deadline) return "timeout";
  }
}

}  // namespace cam
