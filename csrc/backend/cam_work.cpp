#include "cam_work.hpp"

namespace cam {

CamWork::CamWork(std::shared_ptr<Engine> engine, std::shared_ptr<Op> op, int rank,
                 c10d::OpType type, const char* profiling_title,
                 std::optional<std::vector<at::Tensor>> inputs)
    : c10d::Work(rank, type, profiling_title, inputs), engine_(std::move(engine)), op_(std::move(op)) {}

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

}  // namespace cam
