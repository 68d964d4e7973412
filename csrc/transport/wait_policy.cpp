#include "wait_policy.hpp"

#include <sched.h>
#include <time.h>

#include <algorithm>

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

}  // namespace cam
