// OpIssuer: how the front ends of one group (the backend's collectives and p2p, MoE) hand ops
// to its engine and get back their Work.
//
// Collectives take the group's next sequence number and are submitted in that order under one
// lock, so every rank numbers them alike. A front end that builds a collective through
// collective() and whose own checks refuse the arguments (an ArgumentError, or an ATen error
// while bringing them into shape) still takes part: the rank issues a RefusedOp under the next
// number, so every peer fails the op at once naming this rank and its reason, the numbers of
// all ranks stay aligned and the group stays usable; the call raises here at once.
// Between start_coalescing() and end_coalescing() every issued op's Work is also collected
// into one (dist._coalescing_manager with a device).
#pragma once

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../algo/collective.hpp"
#include "cam_work.hpp"
#include "engine.hpp"

namespace cam {

class OpIssuer {
 public:
  OpIssuer(std::shared_ptr<Engine> engine, int rank) : engine_(std::move(engine)), rank_(rank) {}

  const std::shared_ptr<Engine>& engine() const { return engine_; }
  // When an op issued now expires: after its own timeout, or the group's when it has none.
  Clock::time_point deadline(std::chrono::milliseconds op_timeout) const;

  // Issues an op that is not a collective (p2p).
  c10::intrusive_ptr<c10d::Work> issue(std::shared_ptr<Op> op, c10d::OpType type, const char* title,
                                       const std::vector<at::Tensor>& inputs);
  // Issues make(next sequence number) as the group's next collective.
  template <typename MakeOp>
  c10::intrusive_ptr<c10d::Work> issue_collective(MakeOp make, c10d::OpType type, const char* title,
                                                  const std::vector<at::Tensor>& inputs);
  // Runs `build` (which checks its arguments and calls issue_collective); a refusal of the
  // arguments becomes a RefusedOp of kind `kind` named `op` (see above).
  template <typename Build>
  c10::intrusive_ptr<c10d::Work> collective(const char* op, CollKind kind, Build build);
  [[noreturn]] void refuse(const char* op, CollKind kind, const std::string& reason);
  // The same for front ends that check their arguments elsewhere (MoE in Python): `kind` as
  // coll_kind_name spells it, `op` any name (kept for the process's lifetime).
  [[noreturn]] void refuse(const std::string& kind, const std::string& op, const std::string& reason);

  void start_coalescing();
  c10::intrusive_ptr<c10d::Work> end_coalescing();
  // The sequence number of the newest collective.
  uint64_t sequence_number() const;

 private:
  void collect(const c10::intrusive_ptr<c10d::Work>& work);  // under mu_

  std::shared_ptr<Engine> engine_;
  int rank_;
  mutable std::mutex mu_;
  uint64_t coll_seq_ = 0;
  std::atomic<bool> coalescing_{false};  // written under mu_
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
};

// Inside a catch block: the reason of the argument error being handled (an ArgumentError, or an
// ATen error while arguments were brought into shape); anything else is rethrown.
inline std::string argument_error_reason() {
  try {
    throw;
  } catch (const ArgumentError& e) {
    return e.what();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

template <typename MakeOp>
c10::intrusive_ptr<c10d::Work> OpIssuer::issue_collective(MakeOp make, c10d::OpType type, const char* title,
                                                          const std::vector<at::Tensor>& inputs) {
  std::lock_guard<std::mutex> lk(mu_);
  std::shared_ptr<Op> op = make(coll_seq_ + 1);
  ++coll_seq_;
  engine_->submit(op, &inputs);
  auto work = c10::make_intrusive<CamWork>(engine_, std::move(op), rank_, type, title, inputs);
  collect(work);
  return work;
}

template <typename Build>
c10::intrusive_ptr<c10d::Work> OpIssuer::collective(const char* op, CollKind kind, Build build) {
  std::string reason;
  try {
    return build();
  } catch (...) {
    reason = argument_error_reason();
  }
  refuse(op, kind, reason);
}

}  // namespace cam
