#include "cam_work.hpp"

#include <ATen/record_function.h>

namespace cam {

CamWork::CamWork(std::shared_ptr<Engine> engine, std::shared_ptr<Op> op, int rank,
                 c10d::OpType type, const char* profiling_title, const std::vector<at::Tensor>& inputs)
    // With a title, c10d::Work builds a RecordFunction for the profiler on every op; without
    // profiler callbacks it would stay inactive, so the title and a copy of the inputs (which
    // only the profiler reads) are passed only when callbacks exist.
    : c10d::Work(rank, type, at::hasCallbacks() ? profiling_title : nullptr,
                 at::hasCallbacks() ? std::optional<std::vector<at::Tensor>>(inputs) : std::nullopt),
      engine_(std::move(engine)), op_(std::move(op)) {}

bool CamWork::isCompleted() {
  if (!op_->future()->completed()) engine_->poll();
  return op_->future()->completed();
}

bool CamWork::isSuccess() const {
  return op_->future()->completed() && !op_->future()->hasError();
}

std::exception_ptr CamWork::exception() const {
  return op_->future()->completed() && op_->future()->hasError() ? op_->future()->exception_ptr()
                                                                 : nullptr;
}

int CamWork::sourceRank() const {
  TORCH_CHECK(op_->source_rank() >= 0, "cam: sourceRank() is only valid for a completed recv");
  return op_->source_rank();
}

std::vector<at::Tensor> CamWork::result() {
  wait();
  return op_->outputs();
}

bool CamWork::wait(std::chrono::milliseconds timeout) {
  if (!engine_->wait(*op_, timeout)) {
    TORCH_CHECK(false, op_->where(engine_->heap().rank()), ": Work.wait timed out after ",
                timeout.count(), " ms waiting for ", op_->waiting_for());
  }
  if (op_->future()->hasError()) std::rethrow_exception(op_->future()->exception_ptr());
  return true;
}

CamCoalescedWork::CamCoalescedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works)
    : c10d::Work(rank, c10d::OpType::COALESCED, "cam:coalesced"), works_(std::move(works)) {
  // Completes when the last op does, with every op's outputs, or with the first error seen.
  future_ = c10::make_intrusive<c10::ivalue::Future>(Op::tensor_list_type());
  state_ = std::make_shared<Settle>();
  state_->pending = works_.size();
  if (works_.empty()) future_->markCompleted(c10::IValue(c10::List<at::Tensor>()));
  for (size_t i = 0; i < works_.size(); ++i) {
    c10::intrusive_ptr<c10::ivalue::Future> f;
    try {
      f = works_[i]->getFuture();
    } catch (const std::exception&) {  // a Work without one (gloo's send / recv): settled by wait()
      unsettled_.push_back(i);
      continue;
    }
    c10::weak_intrusive_ptr<c10::ivalue::Future> weak(future_);
    f->addCallback([weak, state = state_](c10::ivalue::Future& f) {
      auto fut = weak.lock();
      if (!fut) return;
      settle(*state, *fut, f.hasError() ? f.exception_ptr() : nullptr,
             !f.hasError() && f.value().isTensorList() ? f.value().toTensorVector() : std::vector<at::Tensor>{});
    });
  }
}

void CamCoalescedWork::settle(Settle& s, c10::ivalue::Future& fut, std::exception_ptr error,
                              const std::vector<at::Tensor>& outputs) {
  {
    std::lock_guard<std::mutex> lk(s.mu);
    if (error) {
      if (!fut.completed()) fut.setErrorIfNeeded(error);
    } else {
      s.outputs.insert(s.outputs.end(), outputs.begin(), outputs.end());
    }
    if (--s.pending > 0 || fut.completed()) return;
  }
  fut.markCompleted(c10::IValue(c10::List<at::Tensor>(s.outputs)));
}

void CamCoalescedWork::settle_unfutured() {
  std::lock_guard<std::mutex> lk(unsettled_mu_);
  std::vector<size_t> left;
  for (size_t i : unsettled_) {
    auto& w = works_[i];
    if (!w->isCompleted()) {
      left.push_back(i);
      continue;
    }
    const std::exception_ptr error = w->exception();
    std::vector<at::Tensor> outputs;
    if (!error) {
      try {
        outputs = w->result();
      } catch (const std::exception&) {  // a Work that keeps no result
      }
    }
    settle(*state_, *future_, error, outputs);
  }
  unsettled_ = std::move(left);
}

bool CamCoalescedWork::isCompleted() {
  for (auto& w : works_) {
    if (!w->isCompleted()) return false;
  }
  settle_unfutured();
  return true;
}

bool CamCoalescedWork::isSuccess() const { return future_->completed() && !future_->hasError(); }

std::exception_ptr CamCoalescedWork::exception() const {
  return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
}

std::vector<at::Tensor> CamCoalescedWork::result() {
  wait();
  std::vector<at::Tensor> out;
  for (auto& w : works_) {
    for (auto& t : w->result()) out.push_back(t);
  }
  return out;
}

bool CamCoalescedWork::wait(std::chrono::milliseconds timeout) {
  for (auto& w : works_) w->wait(timeout);
  settle_unfutured();
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> CamCoalescedWork::getFuture() { return future_; }

}  // namespace cam
