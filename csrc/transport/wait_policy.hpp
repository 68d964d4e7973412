// WaitPolicy: how a rank waits for a peer without stealing the core that peer needs.
// Tiers by time spent in the current wait: pause-spin (a peer on another core answers in well
// under a microsecond), then sched_yield (more ranks than cores: hand the core to whoever is
// runnable), then sleeps that grow to sleep_max_us (nothing is coming soon). A waiter whose
// peers can wake it (the heap's park, wait_bell.hpp) passes a sleeper that parks instead of
// sleeping blind, so a sleeping rank costs no core and still answers as soon as it is rung.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

namespace cam {

class Backoff {
 public:
  // How the sleep tier sleeps: for at most `us` microseconds (returning early is fine).
  using Sleeper = std::function<void(int64_t us)>;

  Backoff(int64_t spin_us, int64_t yield_us, int64_t sleep_max_us, Sleeper sleeper = {})
      : spin_ns_(spin_us * 1000), yield_ns_(yield_us * 1000), sleep_max_us_(sleep_max_us),
        sleeper_(std::move(sleeper)) {}

  // Call after a pass that made no progress.
  void pause();
  // Call after a pass that made progress: the next wait starts in the spin tier again.
  void reset() { started_ = false; }

 private:
  int64_t spin_ns_, yield_ns_, sleep_max_us_;
  Sleeper sleeper_;
  bool started_ = false;
  std::chrono::steady_clock::time_point start_;
  int64_t sleep_us_ = 0;
};

// How a background thread that runs the ops nobody waits on (the local engine's progress
// thread, a spanning group's worker) polls for them: at `base` after it last found one, doubling
// per poll that finds none up to kMaxStretch times that. Where every op is waited by its issuer
// (the blocking style) each poll only costs a timer wake, and with 8 ranks on 2 cores those
// wakes made small ops 20-30% slower; an op nobody waits on is still found within the current
// interval. After kParkAfter without ops the thread parks, to be woken by the next op.
class PollSchedule {
 public:
  static constexpr int kMaxStretch = 8;
  static constexpr std::chrono::milliseconds kParkAfter{100};

  explicit PollSchedule(std::chrono::microseconds base) : base_(base), next_(base) {}
  // It found an op to run: the next wait is `base` again.
  void found_work() { next_ = base_; }
  // The wait before the next poll (each call without found_work() between doubles the next).
  std::chrono::microseconds next_wait() {
    const auto wait = next_;
    next_ = std::min(next_ * 2, base_ * kMaxStretch);
    return wait;
  }
  static bool park(std::chrono::steady_clock::time_point last_op) {
    return std::chrono::steady_clock::now() - last_op > kParkAfter;
  }

 private:
  std::chrono::microseconds base_, next_;
};

// Waits with `backoff` until counter (read with acquire order) reaches target: "" when it
// does, "timeout" after timeout_s, or what peer_problem() says (asked every liveness interval
// while the counter is short) when the peer that should raise it is gone. The one shape of a
// wait for a peer's signal, whatever tells that the peer is alive.
std::string wait_for_signal(const uint64_t& counter, int64_t target, double timeout_s, Backoff& backoff,
                            int64_t liveness_interval_ms, const std::function<std::string()>& peer_problem);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace cam
