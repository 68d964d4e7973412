// WaitBell: how a rank with nothing to do gives its core away until a peer has news for it.
//
// Each window holds one bell line, owned by the transport. A waiter that has spun and yielded
// without progress parks on its own bell (a process-shared futex) for at most the sleep tier's
// time; a rank whose pass made progress rings every parked peer. Correctness never depends on
// a ring: a missed one costs what a plain sleep costs, since every park has a timeout.
//
// Ordering (the store-buffer pattern, so both sides fence): the waiter counts itself parked,
// fences, reads the bell, re-checks its work, then sleeps only while the bell still holds what
// it read. The ringer publishes its signals, fences, then reads `parked`. Either the waiter's
// re-check sees the signals or the ringer sees the waiter, and a ring after the waiter read the
// bell makes the futex wait return at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

namespace cam {

// Which ranks' rings wake a parked waiter: bit (rank % 64); every bit when it cannot tell.
using PeerMask = uint64_t;
constexpr PeerMask kAnyPeer = ~PeerMask(0);
inline PeerMask peer_bit(int rank) { return rank < 0 ? kAnyPeer : PeerMask(1) << (rank & 63); }

struct alignas(64) WaitBell {
  uint32_t bell;    // futex word: bumped by every ring
  uint32_t parked;  // threads of the owner sleeping on `bell`
  PeerMask want;    // whose rings they wait for (a lost bit, two threads racing, costs a timeout)
};
static_assert(sizeof(WaitBell) == 64);

// The waiter's re-check after announcing its park: whether it is still idle, and if so whose
// signals it waits for.
struct Idleness {
  bool idle;
  PeerMask waiting_on;
};

// Sleeps on `own` for at most timeout_us unless still_idle() finds work. Returns early when a
// peer named in its mask rings.
void park_on(WaitBell& own, int64_t timeout_us, const std::function<Idleness()>& still_idle);

// Call once after this rank's signals of a pass are published, before ring_if_parked.
inline void fence_before_ring() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// Wakes the threads parked on `peer`'s bell if they wait for `me`; one load when none is parked.
void ring_if_parked(WaitBell& peer, PeerMask me);

}  // namespace cam
