// Signals: 64-bit counters in shared memory that only ever increase.
//
// Memory ordering contract (every algorithm relies on exactly this):
//  * producer: write the data, then signal_release(counter, value). The release store orders
//    all earlier stores (including memcpy into the window) before the counter update.
//    Non-temporal stores are weakly ordered even on x86: a kernel that uses them must issue
//    kernels::store_fence() before signalling.
//  * consumer: signal_acquire(counter) >= expected, then read the data. The acquire load
//    orders the later reads after the observation.
//  * Each counter has exactly one writer (the rank owning the window it lives in, or for
//    tails/acks the consuming rank in its own window), so no read-modify-write is ever needed
//    across processes, and a waiter compares with >=, never ==, so a fast peer that already
//    moved on can never be mistaken for a stale one.
#pragma once

#include <atomic>
#include <cstdint>

namespace cam {

// One counter per cache line so that two writers never share a line.
struct alignas(64) SignalLine {
  uint64_t value;
  char pad[56];
};
static_assert(sizeof(SignalLine) == 64);

inline uint64_t signal_acquire(const uint64_t& counter) {
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(counter)).load(std::memory_order_acquire);
}
inline uint64_t signal_relaxed(const uint64_t& counter) {
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(counter)).load(std::memory_order_relaxed);
}
inline void signal_release(uint64_t& counter, uint64_t value) {
  std::atomic_ref<uint64_t>(counter).store(value, std::memory_order_release);
}

// Collective stream counters carry the op's sequence number in the high half so that values
// from earlier ops always compare lower: (seq << 32) | chunks_done.
inline uint64_t stream_value(uint64_t seq, uint64_t chunks) { return (seq << 32) | chunks; }

}  // namespace cam
