// Engine: runs a group's ops. Ops are queued at issue and never block the issuing thread.
// Whoever waits drives progress (the thread in Work::wait, so a blocking op needs no thread
// hand-off); a background progress thread drives ops that nobody is waiting on (an isend whose
// Work is never waited, a Future with callbacks). Collectives run one at a time in issue
// order; point-to-point ops progress concurrently beside them, and so do one-sided ops (KV
// transfers), whose failures are their own (the group stays usable).
//
// Failure model: a ValidationError fails one op and leaves the group usable. A timeout, a dead
// peer or a failure reported by a peer fails every pending op, is published in this rank's
// window for the peers to see, and makes every later op fail at once with the same cause.
// Every op is noted in the group's flight recorder at issue, start and finish; a failure of
// the group (not a shutdown) dumps it (flight_recorder.hpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "../algo/p2p.hpp"
#include "../core/config.hpp"
#include "../core/flight_recorder.hpp"
#include "../transport/heap.hpp"
#include "../transport/wait_policy.hpp"

namespace cam {

class Engine {
 public:
  // windows: where the op families' structures lie in the heap's windows (OpWindows::reserve
  // on the layout the heap was built with). group: how the flight recorder and log lines name
  // the group.
  Engine(std::unique_ptr<SymmetricHeap> heap, OpWindows windows, CamConfig cfg, FlightRecorder::Group group);
  ~Engine();
  void shutdown();

  // Queues the op and makes one non-blocking progress attempt. Never blocks on peers.
  // `tensors`: what the flight recorder notes of the op's data (sizes, dtype).
  void submit(std::shared_ptr<Op> op, const std::vector<at::Tensor>* tensors = nullptr);
  // Drives progress until the op is done or timeout (0: none beyond the op's deadline)
  // expires. Returns false on timeout.
  bool wait(const Op& op, std::chrono::milliseconds timeout);
  // One non-blocking progress attempt.
  void poll();
  // Takes back a recv that no message has matched yet (a receive from any source that a
  // message over another engine satisfied first): true when it was withdrawn (it fails,
  // saying so, and no message will bind to it), false when a message has matched it (it
  // completes or fails as usual).
  bool withdraw_recv(const std::shared_ptr<Op>& op);
  // Fails the group from outside its ops (a composite whose other part failed): every pending
  // and later op fails with `why`, and the peers learn it as from any failure of this rank.
  void fail(const std::string& why);

  // Why peer r is unusable: "failed: <its report>" once it published a failure of its group,
  // "died (<why>)" once its process is gone; empty while it is alive. The one liveness policy:
  // the engine's ops and extensions' waits (wait_signal) both ask here.
  std::string peer_problem(int r) const;

  SymmetricHeap& heap() { return *heap_; }
  const CamConfig& config() const { return cfg_; }
  const Stats& stats() const { return stats_; }
  // "group '0' (global ranks all) rank 1": how log lines name this rank of the group.
  const std::string& who() const { return who_; }

 private:
  using Finished = FinishedOps;
  bool drive_once(Finished& finished);
  bool drive_and_complete();
  // The sleep tier of this engine's waiters: park on the heap until a peer that the pending
  // ops wait for rings (or `us` pass).
  void park(int64_t us, const std::function<bool()>& done);
  void absorb_incoming(Finished& finished);
  void check_deadlines_and_peers(Finished& finished);
  void note_waiting_on();
  // Fails every pending op with `why` and tells the peers; `dump`: also write the flight
  // recorder (a timeout or a peer's failure, not a shutdown).
  void fail_all(const std::string& why, Finished& finished, bool dump = true);
  void record_finished(Op& op, const std::exception_ptr& error);
  void complete(Finished& finished);
  void progress_thread_main();
  void stop_thread();
  void wake_progress_thread();

  std::unique_ptr<SymmetricHeap> heap_;
  const OpWindows windows_;
  CamConfig cfg_;
  Stats stats_;
  Context ctx_;
  std::shared_ptr<FlightRecorder> recorder_;
  std::string who_;

  std::mutex submit_mu_;  // guards incoming_
  std::vector<std::shared_ptr<Op>> incoming_;
  std::atomic<bool> has_incoming_{false};  // incoming_ is not empty (set under submit_mu_)

  std::mutex drive_mu_;  // guards everything below until the thread fields
  std::vector<std::shared_ptr<Op>> absorbing_;  // incoming_'s ops being sorted into the queues below
  std::deque<std::shared_ptr<Op>> collectives_;
  std::vector<std::shared_ptr<Op>> one_sided_;  // neither collective nor p2p (KV transfers)
  std::vector<std::shared_ptr<Op>> pending_;  // every op not yet finished (deadlines, failure)
  P2PEngine p2p_;
  Clock::time_point next_liveness_check_;
  std::string fatal_;  // why the group is unusable; read and written under drive_mu_
  std::atomic<bool> failed_{false};
  // Whose signals the pending ops waited for at the end of the latest pass (wait_bell.hpp).
  std::atomic<PeerMask> waiting_on_{kAnyPeer};

  std::atomic<int64_t> active_{0};  // submitted and not finished
  std::atomic<int> waiters_{0};
  std::mutex thread_mu_;
  std::condition_variable thread_cv_;
  std::atomic<bool> thread_parked_{false};  // waiting without a deadline for new work
  bool stop_ = false;
  std::once_flag shutdown_once_;
  std::thread thread_;
};

}  // namespace cam
