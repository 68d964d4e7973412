#include "ucx_shared.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace cam {

SharedUcx::SharedUcx(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts)
    : interval_ms_(opts.liveness_interval_ms) {
  opts.lost_peer_fails_waits = false;
  transport_ = std::make_unique<UcxTransport>(std::move(store), opts);
  standby_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  TORCH_CHECK(standby_fd_ >= 0, "cam UCX link on rank ", opts.rank, " of group ", opts.group_desc,
              ": eventfd failed: ", std::strerror(errno));
  server_ = std::thread([this] { serve(); });
}

SharedUcx::~SharedUcx() {
  stop_.store(true);
  transport_->wake();
  (void)::eventfd_write(standby_fd_, 1);
  if (server_.joinable()) server_.join();
  ::close(standby_fd_);
}

bool SharedUcx::pass(int self) {
  bool moved = false;
  const bool armed = transport_->drain_and_arm(&moved);
  if (moved) tell_parked(self);
  return armed;
}

bool SharedUcx::tell_parked(int self) {
  for (int fd : parked_) {
    if (fd != self) (void)::eventfd_write(fd, 1);
  }
  return !parked_.empty();
}

void SharedUcx::serve() {
  const int fd = transport_->event_fd();
  while (!stop_.load(std::memory_order_relaxed)) {
    bool armed, standby;
    {
      std::lock_guard<std::mutex> lk(mu_);
      armed = pass(-1);
      standby = !parked_.empty();
    }
    if (!armed) continue;  // events were queued: progress them first
    // Woken by arriving traffic or by wake() (or, standing by, by the last parked thread's
    // leaving); the interval bounds a missed wakeup.
    pollfd pfd{standby ? standby_fd_ : fd, POLLIN, 0};
    ::poll(&pfd, 1, int(interval_ms_));
    eventfd_t n;
    if (standby) (void)::eventfd_read(standby_fd_, &n);
  }
}

namespace {

// One per thread that ever waits in drive(), kept for the thread's life: a wait opens no
// descriptor of its own. -1 (errno set) when it could not be made.
int thread_eventfd() {
  thread_local struct Fd {
    int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    ~Fd() {
      if (fd >= 0) ::close(fd);
    }
  } mine;
  return mine.fd;
}

}  // namespace

SharedUcx::Parked::Parked(SharedUcx& owner) : owner_(owner), fd_(thread_eventfd()) {
  const auto& o = owner_.options();
  TORCH_CHECK(fd_ >= 0, "cam UCX wait on rank ", o.rank, " of group ", o.group_desc,
              ": eventfd failed: ", std::strerror(errno));
  std::lock_guard<std::mutex> lk(owner_.mu_);
  owner_.parked_.push_back(fd_);
}

SharedUcx::Parked::~Parked() {
  std::lock_guard<std::mutex> lk(owner_.mu_);
  auto& v = owner_.parked_;
  v.erase(std::find(v.begin(), v.end(), fd_));
  if (v.empty()) (void)::eventfd_write(owner_.standby_fd_, 1);
}

void SharedUcx::Parked::clear() {
  eventfd_t n;
  (void)::eventfd_read(fd_, &n);
}

void SharedUcx::Parked::sleep(std::chrono::microseconds at_most) {
  pollfd pfd[2] = {{owner_.transport_->event_fd(), POLLIN, 0}, {fd_, POLLIN, 0}};
  const auto s = std::chrono::duration_cast<std::chrono::seconds>(at_most);
  const timespec ts{time_t(s.count()), long((at_most - s).count() * 1000)};
  ::ppoll(pfd, 2, &ts, nullptr);
}

}  // namespace cam
