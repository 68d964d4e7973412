// SharedUcx: a UcxTransport used from several threads and served by a thread of its own, for
// the users of UCX whose peers act while this rank computes: KV transfer (a peer's get or put
// on this rank's memory is carried out by this rank's progress over TCP) and point-to-point
// (a rendezvous send moves only while both sides progress).
//
// Contract:
//   - Every use of the transport runs under the lock (locked()); after it the server re-arms.
//   - The server thread progresses the worker whenever traffic arrives (it sleeps on the
//     worker's event descriptor, at most one liveness interval, and burns no core), then wakes
//     every thread in wait_for(): completions are seen by waiters without a progress of their own.
//   - A lost peer fails only what is addressed to it (UcxOptions::lost_peer_fails_waits off).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "ucx_transport.hpp"

namespace cam {

class SharedUcx {
 public:
  SharedUcx(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts);
  ~SharedUcx();
  SharedUcx(const SharedUcx&) = delete;
  SharedUcx& operator=(const SharedUcx&) = delete;

  const UcxOptions& options() const { return transport_->options(); }

  // Runs f(transport) under the lock; the server re-arms after it.
  template <class F>
  auto locked(F&& f) {
    struct Wake {
      UcxTransport& t;
      ~Wake() { t.wake(); }
    } wake{*transport_};
    std::lock_guard<std::mutex> lk(mu_);
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
  // on the latter. Woken after every pass of the server.
  template <class F>
  bool wait_for(F&& done, std::chrono::microseconds for_at_most) {
    std::unique_lock<std::mutex> lk(mu_);
    return served_.wait_for(lk, for_at_most, [&] { return done(*transport_); });
  }

 private:
  void serve();

  std::unique_ptr<UcxTransport> transport_;
  int64_t interval_ms_;
  std::mutex mu_;
  std::condition_variable served_;
  std::atomic<bool> stop_{false};
  std::thread server_;
};

}  // namespace cam
