#include "wait_policy.hpp"

#include <sched.h>
#include <time.h>

#include <algorithm>

#include "signal.hpp"

namespace cam {

void Backoff::pause() {
  auto now = std::chrono::steady_clock::now();
  if (!started_) {
    started_ = true;
    start_ = now;
    sleep_us_ = 0;
  }
  const int64_t waited = std::chrono::duration_cast<std::chrono::nanoseconds>(now - start_).count();
  if (waited < spin_ns_) {
    for (int i = 0; i < 32; ++i) cpu_relax();
    return;
  }
  if (waited < yield_ns_) {
    sched_yield();
    return;
  }
  sleep_us_ = sleep_us_ == 0 ? 10 : std::min<int64_t>(sleep_us_ * 2, sleep_max_us_);
  if (sleeper_) {
    sleeper_(sleep_us_);
    return;
  }
  timespec ts{0, long(sleep_us_) * 1000};
  nanosleep(&ts, nullptr);
}

std::string wait_for_signal(const uint64_t& counter, int64_t target, double timeout_s, Backoff& backoff,
                            int64_t liveness_interval_ms, const std::function<std::string()>& peer_problem) {
  auto reached = [&] { return int64_t(signal_acquire(counter)) >= target; };
  if (reached()) return {};
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::microseconds(int64_t(timeout_s * 1e6));
  auto next_check = start + std::chrono::milliseconds(liveness_interval_ms);
  while (!reached()) {
    backoff.pause();
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(liveness_interval_ms);
      std::string problem = peer_problem();
      if (!problem.empty() && !reached()) return problem;
    }
    if (now >= until) return reached() ? std::string() : "timeout";
  }
  return {};
}

}  // namespace cam
