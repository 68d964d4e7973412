#include "moe_group.hpp"

#include "moe_args.hpp"

namespace cam {

MoeGroup::MoeGroup(std::shared_ptr<OpIssuer> issuer, int rank, int size, int64_t output_cache_bytes)
    : issuer_(std::move(issuer)), rank_(rank), size_(size),
      output_pool_(std::make_shared<RecyclingPool>(output_cache_bytes)) {}

template <typename MoeOpT, typename Args>
c10::intrusive_ptr<c10d::Work> MoeGroup::issue(Args a, std::chrono::milliseconds timeout) {
  MoeStage* st = &stage();
  auto dl = issuer_->deadline(timeout);
  std::vector<at::Tensor> inputs;
  if (a.rows.defined()) inputs.push_back(a.rows);
  return issuer_->issue_collective(
      [&](uint64_t seq) { return std::make_shared<MoeOpT>(seq, dl, st, std::move(a)); },
      c10d::OpType::ALLTOALL, MoeOpT::kTitle, std::move(inputs));
}

MoeStage& MoeGroup::stage() {
  std::lock_guard<std::mutex> lk(stage_mu_);
  if (!stage_) stage_ = std::make_unique<MoeStage>(issuer_->engine()->heap().arena());
  return *stage_;
}

c10::intrusive_ptr<c10d::Work> MoeGroup::dispatch(MoeDispatchArgs a, std::chrono::milliseconds timeout) {
  return issuer_->collective("moe_dispatch", CollKind::kMoeDispatch, [&] {
    check_dispatch_args(a, rank_, size_);
    return issue<MoeDispatchOp>(std::move(a), timeout);
  });
}

c10::intrusive_ptr<c10d::Work> MoeGroup::combine(MoeCombineArgs a, std::chrono::milliseconds timeout) {
  return issuer_->collective("moe_combine", CollKind::kMoeCombine, [&] {
    check_combine_args(a, size_);
    return issue<MoeCombineOp>(std::move(a), timeout);
  });
}

int64_t MoeGroup::stage_bytes() const {
  std::lock_guard<std::mutex> lk(stage_mu_);
  return stage_ ? stage_->bytes() : 0;
}

}  // namespace cam
