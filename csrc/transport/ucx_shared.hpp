// SharedUcx: a UcxTransport used from several threads and served by a thread of its own, for
// the users of UCX whose peers act while this rank computes: KV transfer (a peer's get or put
// on this rank's memory is carried out by this rank's progress over TCP) and point-to-point
// (a rendezvous send moves only while both sides progress).
//
// Contract:
//   - Every use of the transport runs under the lock (locked()); after it the threads parked
//     in drive() look again, or, with none parked, the server re-arms.
//   - The server thread progresses the worker whenever traffic arrives (it sleeps on the
//     worker's event descriptor, at most one liveness interval, and burns no core), so that
//     peers' gets and puts on this rank's memory, and rendezvous sends, move while no thread
//     of this process waits.
//   - A thread that waits for something (drive()) progresses the worker itself and sleeps on
//     the same descriptor: arriving traffic wakes it directly, not through the server's pass and
//     a second wake-up (a thread hand-off costs tens of µs on a loaded core). A pass that moves
//     something, and every use under locked(), tells each thread parked in drive() (its own
//     eventfd), so a completion carried out by another thread is never slept through. While a
//     thread is parked the server stands down (it would be a second thread woken by each
//     arrival); the last to leave calls it back.
//   - A lost peer fails only what is addressed to it (UcxOptions::lost_peer_fails_waits off).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ucx_transport.hpp"

namespace cam {

class SharedUcx {
 public:
  SharedUcx(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts);
  ~SharedUcx();
  SharedUcx(const SharedUcx&) = delete;
  SharedUcx& operator=(const SharedUcx&) = delete;

  const UcxOptions& options() const { return transport_->options(); }

  // Runs f(transport) under the lock. f may have started traffic or progressed the worker
  // (complete()): afterwards the threads parked in drive() look again, or, with none parked,
  // the server re-arms.
  template <class F>
  auto locked(F&& f) {
    struct WakeServer {
      UcxTransport& t;
      bool needed = true;
      ~WakeServer() {
        if (needed) t.wake();
      }
    } wake{*transport_};
    std::lock_guard<std::mutex> lk(mu_);
    struct Tell {
      SharedUcx& s;
      WakeServer& w;
      ~Tell() { w.needed = !s.tell_parked(-1); }
    } tell{*this, wake};
    return f(*transport_);
  }

  // Runs f(transport) under the lock for a look that starts nothing (a probe, an endpoint's
  // state): the server is not woken, so a waiter that polls this costs it nothing.
  template <class F>
  auto inspect(F&& f) {
    std::lock_guard<std::mutex> lk(mu_);
    return f(*transport_);
  }

  // Waits until done(transport) (called under the lock) holds or `for_at_most` passes; false
  // on the latter. Progresses the worker itself between sleeps on its event descriptor.
  template <class F>
  bool drive(F&& done, std::chrono::microseconds for_at_most) {
    const auto deadline = std::chrono::steady_clock::now() + for_at_most;
    Parked parked(*this);
    while (true) {
      bool armed;
      {
        std::lock_guard<std::mutex> lk(mu_);
        parked.clear();  // a pass from here on is this thread's own, or tells it again
        armed = pass(parked.fd());
        if (done(*transport_)) return true;
      }
      if (!armed) continue;  // events were queued: progress them first
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) return false;
      parked.sleep(std::chrono::duration_cast<std::chrono::microseconds>(left));
    }
  }

 private:
  // A thread in drive(): its eventfd is on the list that every moving pass writes to.
  class Parked {
   public:
    explicit Parked(SharedUcx& owner);
    ~Parked();
    void clear();                                 // under the lock
    void sleep(std::chrono::microseconds at_most);  // on the worker's descriptor and its own
    int fd() const { return fd_; }

   private:
    SharedUcx& owner_;
    int fd_;
  };

  // Under the lock: progresses until nothing moves and arms the event descriptor (false:
  // events came in meanwhile); tells every parked thread but `self` when something moved.
  bool pass(int self);
  // Under the lock: writes the eventfd of every parked thread but `self`; false when none is.
  bool tell_parked(int self);
  void serve();

  std::unique_ptr<UcxTransport> transport_;
  int64_t interval_ms_;
  std::mutex mu_;
  std::vector<int> parked_;  // under mu_
  int standby_fd_;           // eventfd: the last parked thread left
  std::atomic<bool> stop_{false};
  std::thread server_;
};

}  // namespace cam
