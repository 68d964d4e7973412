#include "wait_bell.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace cam {

namespace {
// Windows are mapped shared by several processes: no FUTEX_PRIVATE_FLAG.
void futex_wait(uint32_t* word, uint32_t expected, int64_t timeout_us) {
  timespec ts{time_t(timeout_us / 1000000), long(timeout_us % 1000000) * 1000};
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futex_wake_all(uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }
}  // namespace

void park_on(WaitBell& own, int64_t timeout_us, const std::function<Idleness()>& still_idle) {
  std::atomic_ref<uint32_t> parked(own.parked), bell(own.bell);
  std::atomic_ref<PeerMask> want(own.want);
  // Until the re-check names its peers, any ring wakes this thread.
  want.fetch_or(kAnyPeer, std::memory_order_relaxed);
  parked.fetch_add(1, std::memory_order_seq_cst);
  const uint32_t seen = bell.load(std::memory_order_seq_cst);
  const Idleness now = still_idle();
  if (now.idle) {
    // Narrowing the mask is safe: a ring from a named peer after this store finds its bit; one
    // before it bumped the bell, so the wait below returns at once.
    want.store(now.waiting_on, std::memory_order_seq_cst);
    futex_wait(&own.bell, seen, timeout_us);
  }
  if (parked.fetch_sub(1, std::memory_order_relaxed) == 1) want.store(0, std::memory_order_relaxed);
}

void ring_if_parked(WaitBell& peer, PeerMask me) {
  if (std::atomic_ref<uint32_t>(peer.parked).load(std::memory_order_acquire) == 0) return;
  if ((std::atomic_ref<PeerMask>(peer.want).load(std::memory_order_relaxed) & me) == 0) return;
  std::atomic_ref<uint32_t>(peer.bell).fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&peer.bell);
}

}  // namespace cam
