#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "../../kernels/copy.hpp"
#include "../transport/heap.hpp"
#include "../transport/signal.hpp"
#include "kv_peer.hpp"

namespace cam::kv {

MappedKVPeer::MappedKVPeer(const SymmetricHeap& heap, int local_rank, int64_t control_offset, int64_t arena_bytes)
    : heap_(heap), local_rank_(local_rank), arena_(heap.layout().arena(heap.base(local_rank))),
      control_(arena_ + control_offset), arena_bytes_(arena_bytes) {}

uint64_t MappedKVPeer::load(int64_t at) { return signal_acquire(*reinterpret_cast<uint64_t*>(control_ + at)); }

void MappedKVPeer::read(int64_t at, void* dst, size_t bytes) { std::memcpy(dst, control_ + at, bytes); }

void MappedKVPeer::write(int64_t at, const void* src, size_t bytes) { std::memcpy(control_ + at, src, bytes); }

void MappedKVPeer::publish(int64_t at, uint64_t value) {
  kernels::store_fence();  // a layer's copy may have used non-temporal stores
  signal_release(*reinterpret_cast<uint64_t*>(control_ + at), value);
}

int64_t MappedKVPeer::copy_layer(const KVCopyPlan& plan, bool push, char* local_pool, int64_t peer_pool) {
  char* theirs = arena_ + peer_pool;
  return push ? plan.copy_layer(local_pool, theirs) : plan.copy_layer(theirs, local_pool);
}

void MappedKVPeer::prepare_pools(const KVLayoutDesc& desc, const std::vector<int64_t>& offsets) {
#ifdef MADV_POPULATE_WRITE
  // The peer's pool pages exist (the owner allocated them) but are not yet in this process's
  // page tables: without this, the first transfer takes a fault per 4 KiB page (5 ms instead of
  // 1 ms for 16 MiB). Best effort: older kernels refuse, and then the first transfer pays.
  const int64_t bytes = desc.pool_bytes();
  for (int64_t off : offsets) {
    if (off < 0 || off + bytes > arena_bytes_) continue;  // refused with a message at transfer time
    const auto page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t lo = uintptr_t(arena_ + off) & ~(page - 1);
    madvise(reinterpret_cast<void*>(lo), size_t(uintptr_t(arena_ + off + bytes) - lo), MADV_POPULATE_WRITE);
  }
#endif
}

std::string MappedKVPeer::dead() { return heap_.peer_failure(local_rank_); }

}  // namespace cam::kv
