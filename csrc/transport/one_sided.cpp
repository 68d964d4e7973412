#include "one_sided.hpp"

#include "../core/errors.hpp"

namespace cam {

void OneSidedTransport::wait_until(const std::function<bool()>& ready, const std::string& what,
                                   const std::function<std::string()>& waiting_for) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = start + timeout();
  const auto interval = liveness_interval();
  auto next_interrupt = start + interval;
  while (true) {
    const bool moved = progress();
    if (ready()) return;
    const std::string lost = lost_peer();
    if (!lost.empty()) {
      if (interrupt_) interrupt_();
      raise(what, lost);
    }
    const auto now = clock::now();
    if (now >= next_interrupt) {
      next_interrupt = now + interval;
      if (interrupt_) interrupt_();
    }
    if (now >= deadline)
      raise(what, str("timeout after ", timeout().count(), " ms",
                      waiting_for ? " waiting for " + waiting_for() : std::string()));
    if (!moved) idle(now - start);
  }
}

}  // namespace cam
