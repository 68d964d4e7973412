#include "op_issuer.hpp"

#include <set>

namespace cam {

Clock::time_point OpIssuer::deadline(std::chrono::milliseconds op_timeout) const {
  auto t = op_timeout == c10d::kUnsetTimeout || op_timeout.count() <= 0 ? engine_->config().timeout : op_timeout;
  return Clock::now() + t;
}

void OpIssuer::collect(const c10::intrusive_ptr<c10d::Work>& work) {
  if (coalescing_) coalesced_.push_back(work);
}

c10::intrusive_ptr<c10d::Work> OpIssuer::issue(std::shared_ptr<Op> op, c10d::OpType type, const char* title,
                                               const std::vector<at::Tensor>& inputs) {
  engine_->submit(op, &inputs);
  auto work = c10::make_intrusive<CamWork>(engine_, std::move(op), rank_, type, title, inputs);
  if (coalescing_.load(std::memory_order_relaxed)) {  // set and cleared by this issuing thread
    std::lock_guard<std::mutex> lk(mu_);
    collect(work);
  }
  return work;
}

void OpIssuer::refuse(const char* op, CollKind kind, const std::string& reason) {
  auto dl = deadline(c10d::kUnsetTimeout);
  uint64_t seq = 0;
  issue_collective(
      [&](uint64_t s) {
        seq = s;
        return std::make_shared<RefusedOp>(op, kind, s, dl, reason);
      },
      c10d::OpType::UNKNOWN, "cam:refused", {});
  throw ValidationError(str("cam ", op, " (seq ", seq, ") on rank ", rank_, ": ", reason));
}

void OpIssuer::refuse(const std::string& kind, const std::string& op, const std::string& reason) {
  const CollKind k = coll_kind_of(kind);
  // Ops keep their name as a pointer: names from front ends live for the process.
  static std::mutex mu;
  static std::set<std::string> names;
  const char* name;
  {
    std::lock_guard<std::mutex> lk(mu);
    name = names.insert(op).first->c_str();
  }
  refuse(name, k, reason);
}

void OpIssuer::start_coalescing() {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(!coalescing_, "cam on rank ", rank_, ": startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> OpIssuer::end_coalescing() {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(coalescing_, "cam on rank ", rank_, ": endCoalescing called without startCoalescing");
    coalescing_ = false;
    works.swap(coalesced_);
  }
  return c10::make_intrusive<CamCoalescedWork>(rank_, std::move(works));
}

uint64_t OpIssuer::sequence_number() const {
  std::lock_guard<std::mutex> lk(mu_);
  return coll_seq_;
}

}  // namespace cam
