#include "engine.hpp"

#include <algorithm>

namespace cam {

Engine::Engine(std::unique_ptr<SymmetricHeap> heap, OpWindows windows, CamConfig cfg, FlightRecorder::Group group)
    : heap_(std::move(heap)), windows_(windows), cfg_(std::move(cfg)),
      ctx_{*heap_, cfg_, windows_.coll, windows_.p2p, heap_->rank(), heap_->world_size(), heap_->base(heap_->rank()), stats_},
      recorder_(FlightRecorder::create(group, cfg_.flight_recorder_entries)),
      who_(str("group ", group.desc, " rank ", group.rank)),
      p2p_(heap_->world_size()), next_liveness_check_(Clock::now()) {
  thread_ = std::thread([this] { progress_thread_main(); });
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  // Callers may race (torch can shut a group down from a helper thread while the owner drops
  // it): call_once makes every caller wait until the thread is joined, so the Engine is never
  // destroyed with a joinable thread (std::terminate).
  std::call_once(shutdown_once_, [this] { stop_thread(); });
}

void Engine::stop_thread() {
  {
    std::lock_guard<std::mutex> lk(thread_mu_);
    stop_ = true;
  }
  thread_cv_.notify_all();
  if (thread_.joinable()) {
    // The last reference may be dropped on the progress thread itself; it cannot join itself.
    if (thread_.get_id() == std::this_thread::get_id()) thread_.detach();
    else thread_.join();
  }
  Finished finished;
  {
    std::lock_guard<std::mutex> lk(drive_mu_);
    absorb_incoming(finished);
    if (!pending_.empty()) fail_all("the process group was shut down", finished, /*dump=*/false);
  }
  complete(finished);
}

void Engine::submit(std::shared_ptr<Op> op, const std::vector<at::Tensor>* tensors) {
  if (recorder_->enabled()) {
    const Op::Family family = op->family();
    const char* kind = family == Op::Family::kCollective                                 ? "collective"
                       : family == Op::Family::kSend || family == Op::Family::kRecv ? "p2p"
                                                                                    : "one-sided";
    // Collectives start when they reach the head of the queue; the others progress at once.
    op->trace_started = family != Op::Family::kCollective;
    op->trace_id = recorder_->issued(op->name(), kind, op->seq(), op->trace_peer(), tensors, op->trace_started);
  }
  if (cfg_.log_level >= LogLevel::kDebug) {
    log_line(LogLevel::kDebug, who_, str("issue ", op->name(), " seq ", op->seq(), " peer ", op->trace_peer(),
                                         tensors && !tensors->empty() && (*tensors)[0].defined()
                                             ? cam::str(" ", (*tensors)[0].scalar_type(), (*tensors)[0].sizes())
                                             : std::string()));
  }
  active_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lk(submit_mu_);
    incoming_.push_back(std::move(op));
    has_incoming_.store(true, std::memory_order_release);
  }
  drive_and_complete();
  wake_progress_thread();
}

void Engine::poll() { drive_and_complete(); }

void Engine::fail(const std::string& why) {
  Finished finished;
  {
    std::lock_guard<std::mutex> lk(drive_mu_);
    absorb_incoming(finished);
    fail_all(why, finished);
  }
  complete(finished);
}

bool Engine::withdraw_recv(const std::shared_ptr<Op>& op) {
  TORCH_CHECK(op->family() == Op::Family::kRecv, "Engine::withdraw_recv: ", op->name(), " is not a recv");
  Finished finished;
  bool withdrawn = false;
  {
    std::lock_guard<std::mutex> lk(drive_mu_);
    absorb_incoming(finished);  // a recv still queued is posted (or matched) first
    if (!op->done() && p2p_.withdraw(static_cast<const RecvOp&>(*op))) {
      op->fail(std::make_exception_ptr(ValidationError(
          op->where(ctx_.rank) + ": withdrawn before any message matched it (another engine delivered first)")));
      finished.push_back(op);
      withdrawn = true;
    }
  }
  complete(finished);
  return withdrawn;
}

bool Engine::drive_and_complete() {
  Finished finished;
  bool progress = false;
  if (drive_mu_.try_lock()) {
    progress = drive_once(finished);
    drive_mu_.unlock();
  }
  if (progress) heap_->ring_parked_peers();
  // Futures complete outside the lock: their callbacks may issue new ops.
  complete(finished);
  return progress;
}

void Engine::park(int64_t us, const std::function<bool()>& done) {
  heap_->park(us, [&] {
    const bool idle = !drive_and_complete() && !done();
    return Idleness{idle, waiting_on_.load(std::memory_order_relaxed)};
  });
}

bool Engine::wait(const Op& op, std::chrono::milliseconds timeout) {
  const auto& fut = op.future();
  if (fut->completed()) return true;
  waiters_.fetch_add(1);
  Backoff backoff(cfg_.spin_us, cfg_.yield_us, cfg_.sleep_max_us,
                  [&](int64_t us) { park(us, [&] { return fut->completed(); }); });
  const bool bounded = timeout.count() > 0;
  const auto until = bounded ? Clock::now() + timeout : Clock::time_point::max();
  bool ok = true;
  while (!fut->completed()) {
    if (drive_and_complete()) backoff.reset();
    else if (!fut->completed()) backoff.pause();
    if (bounded && Clock::now() > until && !fut->completed()) {
      ok = false;
      break;
    }
  }
  if (waiters_.fetch_sub(1) == 1 && active_.load() > 0) wake_progress_thread();
  return ok;
}

void Engine::absorb_incoming(Finished& finished) {
  // Most passes (a waiter's polls) find nothing queued: they skip the lock.
  if (!has_incoming_.load(std::memory_order_acquire)) return;
  // The two vectors trade places, so each keeps its capacity: queueing allocates nothing.
  std::vector<std::shared_ptr<Op>>& ops = absorbing_;
  {
    std::lock_guard<std::mutex> lk(submit_mu_);
    ops.swap(incoming_);
    has_incoming_.store(false, std::memory_order_relaxed);
  }
  for (auto& op : ops) {
    if (failed_.load()) {
      op->fail(std::make_exception_ptr(FatalError(op->where(ctx_.rank) +
                                                  ": the group is unusable after an earlier error: " +
                                                  fatal_)));
      finished.push_back(op);
      continue;
    }
    pending_.push_back(op);
    switch (op->family()) {
      case Op::Family::kCollective: collectives_.push_back(std::move(op)); break;
      case Op::Family::kSend: p2p_.add_send(std::static_pointer_cast<SendOp>(std::move(op))); break;
      case Op::Family::kRecv: p2p_.post_recv(ctx_, std::static_pointer_cast<RecvOp>(std::move(op)), finished); break;
      case Op::Family::kOneSided: one_sided_.push_back(std::move(op)); break;
    }
  }
  ops.clear();
}

bool Engine::drive_once(Finished& finished) {
  absorb_incoming(finished);
  if (pending_.empty()) return !finished.empty();
  bool progress = false;
  try {
    while (!collectives_.empty()) {
      auto& op = collectives_.front();
      if (!op->trace_started) {
        op->trace_started = true;
        recorder_->started(op->trace_id);
      }
      op->begin_pass();
      try {
        progress |= op->step(ctx_);
      } catch (const ValidationError&) {
        op->fail(std::current_exception());
      }
      if (!op->done()) break;
      finished.push_back(op);
      collectives_.pop_front();
      progress = true;
    }
    progress |= p2p_.progress(ctx_, finished);
    for (auto& op : one_sided_) {
      op->begin_pass();
      try {
        progress |= op->step(ctx_);
      } catch (const ValidationError&) {
        op->fail(std::current_exception());
      }
      if (op->done()) finished.push_back(op);
    }
    std::erase_if(one_sided_, [](const std::shared_ptr<Op>& op) { return op->done(); });
  } catch (const std::exception& e) {
    fail_all(e.what(), finished);
    return true;
  }
  if (failed_.load()) return true;
  check_deadlines_and_peers(finished);
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [](const std::shared_ptr<Op>& op) { return op->done(); }),
                 pending_.end());
  note_waiting_on();
  return progress || !finished.empty();
}

void Engine::note_waiting_on() {
  // Only the head collective steps; the ones queued behind it wait for their turn, not a peer.
  PeerMask mask = 0;
  if (!collectives_.empty()) mask |= peer_bit(collectives_.front()->blocked_on());
  for (auto& op : pending_) {
    if (!op->is_collective()) mask |= peer_bit(op->blocked_on());
  }
  waiting_on_.store(mask == 0 ? kAnyPeer : mask, std::memory_order_relaxed);
}

void Engine::check_deadlines_and_peers(Finished& finished) {
  const auto now = Clock::now();
  for (auto& op : pending_) {
    if (!op->done() && now > op->deadline()) {
      fail_all(str(op->where(ctx_.rank), ": timeout after ", op->timeout_ms(),
                   " ms waiting for ", op->waiting_for()),
               finished);
      return;
    }
  }
  if (now < next_liveness_check_) return;
  next_liveness_check_ = now + std::chrono::milliseconds(cfg_.liveness_interval_ms);
  // What this rank was doing, for the message: a peer's failure is often the cause of its wait.
  auto waiting = [&] {
    for (auto& op : pending_) {
      if (!op->done()) return str(" while ", op->where(ctx_.rank), " was waiting for ", op->waiting_for());
    }
    return std::string();
  };
  for (int r = 0; r < ctx_.world; ++r) {
    if (r == ctx_.rank) continue;
    const std::string problem = peer_problem(r);
    if (!problem.empty()) {
      fail_all(str("cam on rank ", ctx_.rank, ": peer rank ", r, " ", problem, waiting()), finished);
      return;
    }
  }
}

std::string Engine::peer_problem(int r) const {
  std::string reported = heap_->reported_failure(r);
  if (!reported.empty()) return "failed: " + reported;
  std::string dead = heap_->peer_failure(r);
  return dead.empty() ? std::string() : "died (" + dead + ")";
}

void Engine::fail_all(const std::string& why, Finished& finished, bool dump) {
  const bool first = fatal_.empty();
  if (first) fatal_ = why;
  failed_.store(true);
  // Tell the peers, so that whoever waits on this rank fails now rather than at its timeout.
  heap_->report_failure(why);
  heap_->ring_parked_peers();
  for (auto& op : pending_) {
    if (!op->done()) op->fail(std::make_exception_ptr(FatalError(why)));
    record_finished(*op, op->error());
    finished.push_back(op);
  }
  if (first && dump && cfg_.log_level >= LogLevel::kWarn) log_line(LogLevel::kWarn, who_, "failed: " + why);
  if (first && dump && recorder_->enabled() && !cfg_.flight_recorder_path.empty()) {
    const int rank = FlightRecorder::process_rank() >= 0 ? FlightRecorder::process_rank() : ctx_.rank;
    const std::string path = str(cfg_.flight_recorder_path, rank, ".json");
    const std::string err = FlightRecorder::dump_to(path, why);
    if (cfg_.log_level >= LogLevel::kWarn) {
      log_line(LogLevel::kWarn, who_, err.empty() ? "flight recorder written to " + path
                                                  : "flight recorder not written: " + err);
    }
  }
  pending_.clear();
  collectives_.clear();
  one_sided_.clear();
  p2p_.clear();
}

void Engine::complete(Finished& finished) {
  if (finished.empty()) return;
  for (auto& op : finished) {
    if (op->future()->completed()) continue;
    std::exception_ptr error = op->error();
    if (!error) {
      try {
        op->finalize();
      } catch (...) {
        error = std::current_exception();
      }
    }
    // Recorded before the future completes: whoever wakes from wait() sees the op finished.
    record_finished(*op, error);
    if (error) {
      op->future()->setError(error);
    } else {
      try {
        op->future()->markCompleted(c10::IValue(op->outputs()));
      } catch (...) {
        op->future()->setError(std::current_exception());
      }
    }
    active_.fetch_sub(1);
  }
  finished.clear();
}

void Engine::record_finished(Op& op, const std::exception_ptr& error) {
  const bool debug = cfg_.log_level >= LogLevel::kDebug;
  if (op.trace_finished || (op.trace_id == 0 && !debug)) return;
  op.trace_finished = true;
  const std::string text = error ? error_text(error) : std::string();
  recorder_->finished(op.trace_id, error ? text.c_str() : nullptr);
  if (debug) {
    log_line(LogLevel::kDebug, who_, str(error ? "failed " : "done ", op.name(), " seq ", op.seq(),
                                         error ? ": " + text : std::string()));
  }
}

void Engine::wake_progress_thread() {
  // thread_parked_ is set before the thread's last look at active_, and active_ was raised
  // before this load (both sequentially consistent): the thread either sees the new op or is
  // seen parked. Taking the lock to notify keeps the notify from falling before its wait.
  if (!thread_parked_.load()) return;
  std::lock_guard<std::mutex> lk(thread_mu_);
  thread_cv_.notify_one();
}

void Engine::progress_thread_main() {
  Backoff backoff(cfg_.spin_us, cfg_.yield_us, cfg_.sleep_max_us,
                  [this](int64_t us) { park(us, [] { return false; }); });
  // Polls while ops are in flight on PollSchedule (wait_policy.hpp); an op nobody waits on is
  // then driven without sleeping.
  PollSchedule polls{std::chrono::microseconds(cfg_.progress_interval_us)};
  auto last_active = Clock::now();
  std::unique_lock<std::mutex> lk(thread_mu_);
  while (!stop_) {
    // Waiters drive their own ops; the thread only steps in for ops nobody waits on.
    const bool work = active_.load() > 0 && waiters_.load() == 0;
    if (!work) {
      backoff.reset();
      if (active_.load() > 0) last_active = Clock::now();
      if (PollSchedule::park(last_active)) {
        thread_parked_.store(true);
        thread_cv_.wait(lk, [&] { return stop_ || active_.load() > 0; });
        thread_parked_.store(false);
        last_active = Clock::now();
        polls.found_work();
      } else {
        thread_cv_.wait_for(lk, polls.next_wait());
      }
      continue;
    }
    polls.found_work();
    lk.unlock();
    if (drive_and_complete()) backoff.reset();
    else backoff.pause();
    last_active = Clock::now();
    lk.lock();
  }
}

}  // namespace cam
