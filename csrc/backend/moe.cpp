// CamBackend: MoE dispatch and combine (csrc/moe/). The Python layer (torch_cam/moe.py)
// translates torch_npu's, CAM's and DeepEP's arguments into these two ops and checks them;
// here only what the C++ side relies on is checked again (contiguity, dtypes, shapes).
#include "cam_backend.hpp"

#include "../../kernels/moe_rows.hpp"
#include "../moe/moe_ops.hpp"

namespace cam {

namespace {
void need(bool ok, const char* op, int rank, const std::string& what) {
  TORCH_CHECK(ok, "cam ", op, " on rank ", rank, ": ", what);
}
void need_tensor(const at::Tensor& t, const char* op, int rank, const char* name, at::ScalarType dtype,
                 int64_t dim) {
  need(t.defined() && t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype && t.dim() == dim,
       op, rank, cam::str(name, " must be a contiguous CPU ", dtype, " tensor of ", dim, " dimension(s), got ",
                     t.defined() ? cam::str(t.scalar_type(), " of shape ", t.sizes(),
                                       t.is_contiguous() ? "" : " (not contiguous)")
                                 : std::string("nothing")));
}
}  // namespace

template <typename MoeOpT, typename Args>
c10::intrusive_ptr<c10d::Work> CamBackend::launch_moe(const char* op, Args a, std::chrono::milliseconds timeout) {
  if (a.wait_us.defined()) {
    need_tensor(a.wait_us, op, rank_, "performance_info", at::kLong, 1);
    need(a.wait_us.size(0) == size_, op, rank_,
         cam::str("performance_info must have ", size_, " entries (one per EP rank)"));
  }
  MoeStage* stage = &moe_stage();
  auto dl = deadline(timeout);
  std::vector<at::Tensor> inputs;
  if (a.rows.defined()) inputs.push_back(a.rows);
  return launch_collective(
      [&](uint64_t seq) { return std::make_shared<MoeOpT>(seq, dl, stage, std::move(a)); },
      c10d::OpType::ALLTOALL, MoeOpT::kTitle, std::move(inputs));
}

MoeStage& CamBackend::moe_stage() {
  std::lock_guard<std::mutex> lk(issue_mu_);
  if (!moe_stage_) moe_stage_ = std::make_unique<MoeStage>(engine_->heap().arena());
  return *moe_stage_;
}

c10::intrusive_ptr<c10d::Work> CamBackend::moe_dispatch(MoeDispatchArgs a, std::chrono::milliseconds timeout) {
  const char* op = "moe_dispatch";
  if (a.error.empty()) {
    const int64_t T = a.rows.size(0);
    need(a.rows.is_contiguous() && a.rows.dim() == 2, op, rank_, "token rows must be a contiguous 2-D tensor");
    need_tensor(a.ids, op, rank_, "routing ids", at::kInt, 2);
    need(a.ids.size(0) == T, op, rank_, "routing ids must have one row per token");
    if (a.weights.defined()) {
      need_tensor(a.weights, op, rank_, "routing weights", at::kFloat, 2);
      need(a.weights.sizes() == a.ids.sizes(), op, rank_, "routing weights must have the ids' shape");
    }
    if (a.aux.defined()) {
      need_tensor(a.aux, op, rank_, "per-token side data", at::kByte, 2);
      need(a.aux.size(0) == T, op, rank_, "per-token side data must have one row per token");
    }
    need_tensor(a.token_active, op, rank_, "token activity", at::kBool, 1);
    need(a.token_active.size(0) == T, op, rank_, "token activity must have one entry per token");
    need(a.num_experts >= 1 && a.experts_per_rank >= 1 && a.shared_ranks >= 0 && a.shared_ranks < size_, op,
         rank_, "invalid expert layout");
    if (a.quant) {
      need(kernels::moe_row_dtype_supported(a.rows.scalar_type()), op, rank_,
           cam::str("int8 quantization takes float32, bfloat16 or float16 tokens, got ", a.rows.scalar_type()));
      need_tensor(a.out_rows, op, rank_, "expand_x", at::kChar, 2);
      need(a.out_rows.size(1) == a.rows.size(1), op, rank_, "expand_x must have x's hidden size");
      need_tensor(a.out_scales, op, rank_, "dynamic_scales", at::kFloat, 1);
      need(a.out_scales.size(0) >= a.out_rows.size(0), op, rank_, "dynamic_scales must cover expand_x");
      if (a.smooth.defined()) {
        need_tensor(a.smooth, op, rank_, "scales", at::kFloat, 2);
        need(a.smooth.size(1) == a.rows.size(1), op, rank_, "scales must have x's hidden size");
      }
    } else {
      need(a.out_rows.is_contiguous() && a.out_rows.dim() == 2 && a.out_rows.scalar_type() == a.rows.scalar_type() &&
               a.out_rows.size(1) == a.rows.size(1),
           op, rank_, "expand_x must be a contiguous tensor of x's dtype and hidden size");
    }
    const int64_t cap = a.out_rows.size(0);
    if (a.out_weights.defined()) {
      need_tensor(a.out_weights, op, rank_, "expand_scales", at::kFloat, 1);
      need(a.out_weights.size(0) >= cap, op, rank_, "expand_scales must cover expand_x");
    }
    if (a.out_info.defined()) {
      need_tensor(a.out_info, op, rank_, "row info", at::kInt, 1);
      need(a.info_stride >= 3 && a.out_info.size(0) >= cap * a.info_stride, op, rank_,
           "row info must hold info_stride (>= 3) ints per row");
    }
    if (a.out_aux.defined()) {
      need_tensor(a.out_aux, op, rank_, "received side data", at::kByte, 2);
      need(a.aux.defined() && a.out_aux.size(0) >= cap && a.out_aux.size(1) == a.aux.size(1), op, rank_,
           "received side data must have one row of the side data's width per output row");
    }
    if (a.out_occurrence.defined()) {
      need_tensor(a.out_occurrence, op, rank_, "expand_idx", at::kInt, 1);
      need(a.out_occurrence.numel() == a.ids.numel(), op, rank_, "expand_idx must have one entry per routing slot");
    }
    const int64_t local = rank_ < a.shared_ranks ? size_ : int64_t(size_) * a.experts_per_rank;
    need_tensor(a.out_counts, op, rank_, "ep_recv_counts", at::kInt, 1);
    need(a.out_counts.size(0) >= local, op, rank_, cam::str("ep_recv_counts must hold ", local, " entries"));
    if (a.smooth.defined()) {
      need(a.smooth.size(0) > a.num_experts - 1 + a.smooth_shift, op, rank_,
           cam::str("scales must have a row per expert (", a.num_experts + a.smooth_shift, " rows), got ",
               a.smooth.size(0)));
    }
  }
  return launch_moe<MoeDispatchOp>(op, std::move(a), timeout);
}

c10::intrusive_ptr<c10d::Work> CamBackend::moe_combine(MoeCombineArgs a, std::chrono::milliseconds timeout) {
  const char* op = "moe_combine";
  if (a.error.empty()) {
    need(a.rows.is_contiguous() && a.rows.dim() == 2 && kernels::moe_row_dtype_supported(a.rows.scalar_type()),
         op, rank_, cam::str("expert output rows must be a contiguous 2-D float32, bfloat16 or float16 tensor, got ",
                        a.rows.scalar_type(), " of shape ", a.rows.sizes()));
    need_tensor(a.segments, op, rank_, "segments", at::kLong, 2);
    need(a.segments.size(1) == 3, op, rank_, "segments must be (n, 3): first row, rows, owner rank");
    need(a.out.is_contiguous() && a.out.dim() == 2 && kernels::moe_row_dtype_supported(a.out.scalar_type()) &&
             a.out.size(1) == a.rows.size(1),
         op, rank_, "the output must be a contiguous float tensor of the rows' hidden size");
    need_tensor(a.plan_peer, op, rank_, "plan ranks", at::kInt, 2);
    need_tensor(a.plan_seg, op, rank_, "plan segments", at::kInt, 2);
    need_tensor(a.plan_off, op, rank_, "plan offsets", at::kLong, 2);
    need(a.plan_peer.size(0) == a.out.size(0) && a.plan_seg.sizes() == a.plan_peer.sizes() &&
             a.plan_off.sizes() == a.plan_peer.sizes(),
         op, rank_, "the plan must have one row per output token");
    if (a.plan_weight.defined()) {
      need_tensor(a.plan_weight, op, rank_, "plan weights", at::kFloat, 2);
      need(a.plan_weight.sizes() == a.plan_peer.sizes(), op, rank_, "plan weights must have the plan's shape");
    }
    if (a.add.defined()) {
      need(a.add.is_contiguous() && a.add.sizes() == a.out.sizes() &&
               (a.add.scalar_type() == a.out.scalar_type() || a.add.scalar_type() == at::kFloat),
           op, rank_, "the added rows must have the output's shape, and its dtype or float32");
    }
  }
  return launch_moe<MoeCombineOp>(op, std::move(a), timeout);
}

int64_t CamBackend::moe_stage_bytes() const {
  std::lock_guard<std::mutex> lk(issue_mu_);
  return moe_stage_ ? moe_stage_->bytes() : 0;
}

}  // namespace cam
