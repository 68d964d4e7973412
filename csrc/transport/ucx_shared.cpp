#include "ucx_shared.hpp"

#include <poll.h>

namespace cam {

SharedUcx::SharedUcx(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts)
    : interval_ms_(opts.liveness_interval_ms) {
  opts.lost_peer_fails_waits = false;
  transport_ = std::make_unique<UcxTransport>(std::move(store), opts);
  server_ = std::thread([this] { serve(); });
}

SharedUcx::~SharedUcx() {
  stop_.store(true);
  transport_->wake();
  if (server_.joinable()) server_.join();
}

void SharedUcx::serve() {
  const int fd = transport_->event_fd();
  while (!stop_.load(std::memory_order_relaxed)) {
    bool armed;
    {
      std::lock_guard<std::mutex> lk(mu_);
      armed = transport_->drain_and_arm();
    }
    served_.notify_all();
    if (!armed) continue;  // events were queued: progress them first
    // Woken by arriving traffic or by wake(); the interval bounds a missed wakeup.
    pollfd pfd{fd, POLLIN, 0};
    ::poll(&pfd, 1, int(interval_ms_));
  }
}

}  // namespace cam
