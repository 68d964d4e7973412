#include "moe_args.hpp"

#include "../../kernels/moe_rows.hpp"

namespace cam {

namespace {
void need(bool ok, const std::string& what) { CAM_CHECK_ARG(ok, what); }
// Every tensor the op touches lives in host memory (a meta or device tensor has no bytes here).
void need_cpu(const at::Tensor& t, const char* name) {
  if (t.defined()) {
    CAM_CHECK_ARG(t.device().is_cpu() && t.layout() == at::kStrided, name, " must be a dense CPU tensor, got one on ",
                  t.device(), " with layout ", t.layout());
  }
}
void need_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  need_cpu(t, name);
  need(t.defined() && t.is_contiguous() && t.scalar_type() == dtype && t.dim() == dim,
       cam::str(name, " must be a contiguous CPU ", dtype, " tensor of ", dim, " dimension(s), got ",
                     t.defined() ? cam::str(t.scalar_type(), " of shape ", t.sizes(),
                                       t.is_contiguous() ? "" : " (not contiguous)")
                                 : std::string("nothing")));
}
void check_wait_us(const at::Tensor& wait_us, int size) {
  if (!wait_us.defined()) return;
  need_tensor(wait_us, "performance_info", at::kLong, 1);
  need(wait_us.size(0) == size, cam::str("performance_info must have ", size, " entries (one per EP rank)"));
}
}  // namespace

void check_dispatch_args(const MoeDispatchArgs& a, int rank, int size) {
  for (const auto& [t, name] : {std::pair{a.rows, "token rows"}, {a.ids, "routing ids"}, {a.weights, "routing weights"},
                                {a.aux, "per-token side data"}, {a.token_active, "token activity"},
                                {a.smooth, "scales"}, {a.out_rows, "expand_x"}, {a.out_scales, "dynamic_scales"},
                                {a.out_weights, "expand_scales"}, {a.out_info, "row info"},
                                {a.out_aux, "received side data"}, {a.out_counts, "ep_recv_counts"},
                                {a.out_occurrence, "expand_idx"}}) {
    need_cpu(t, name);
  }
  need(a.rows.defined() && a.out_rows.defined(), "token rows and expand_x must be given");
  need(a.rows.is_contiguous() && a.rows.dim() == 2, "token rows must be a contiguous 2-D tensor");
  const int64_t T = a.rows.size(0);
  need_tensor(a.ids, "routing ids", at::kInt, 2);
  need(a.ids.size(0) == T, "routing ids must have one row per token");
  if (a.weights.defined()) {
    need_tensor(a.weights, "routing weights", at::kFloat, 2);
    need(a.weights.sizes() == a.ids.sizes(), "routing weights must have the ids' shape");
  }
  if (a.aux.defined()) {
    need_tensor(a.aux, "per-token side data", at::kByte, 2);
    need(a.aux.size(0) == T, "per-token side data must have one row per token");
  }
  need_tensor(a.token_active, "token activity", at::kBool, 1);
  need(a.token_active.size(0) == T, "token activity must have one entry per token");
  need(a.num_experts >= 1 && a.experts_per_rank >= 1 && a.shared_ranks >= 0 && a.shared_ranks < size, "invalid expert layout");
  if (a.quant) {
    need(kernels::moe_row_dtype_supported(a.rows.scalar_type()), cam::str("int8 quantization takes float32, bfloat16 or float16 tokens, got ", a.rows.scalar_type()));
    need_tensor(a.out_rows, "expand_x", at::kChar, 2);
    need(a.out_rows.size(1) == a.rows.size(1), "expand_x must have x's hidden size");
    need_tensor(a.out_scales, "dynamic_scales", at::kFloat, 1);
    need(a.out_scales.size(0) >= a.out_rows.size(0), "dynamic_scales must cover expand_x");
  } else {
    need(a.out_rows.is_contiguous() && a.out_rows.dim() == 2 && a.out_rows.scalar_type() == a.rows.scalar_type() &&
             a.out_rows.size(1) == a.rows.size(1), "expand_x must be a contiguous tensor of x's dtype and hidden size");
  }
  const int64_t cap = a.out_rows.size(0);
  if (a.out_weights.defined()) {
    need_tensor(a.out_weights, "expand_scales", at::kFloat, 1);
    need(a.out_weights.size(0) >= cap, "expand_scales must cover expand_x");
  }
  if (a.out_info.defined()) {
    need_tensor(a.out_info, "row info", at::kInt, 1);
    need(a.info_stride >= 3 && a.out_info.size(0) >= cap * a.info_stride, "row info must hold info_stride (>= 3) ints per row");
  }
  if (a.out_aux.defined()) {
    need_tensor(a.out_aux, "received side data", at::kByte, 2);
    need(a.aux.defined() && a.out_aux.size(0) >= cap && a.out_aux.size(1) == a.aux.size(1), "received side data must have one row of the side data's width per output row");
  }
  if (a.out_occurrence.defined()) {
    need_tensor(a.out_occurrence, "expand_idx", at::kInt, 1);
    need(a.out_occurrence.numel() == a.ids.numel(), "expand_idx must have one entry per routing slot");
  }
  const int64_t local = rank < a.shared_ranks ? size : int64_t(size) * a.experts_per_rank;
  need_tensor(a.out_counts, "ep_recv_counts", at::kInt, 1);
  need(a.out_counts.size(0) >= local, cam::str("ep_recv_counts must hold ", local, " entries"));
  if (a.smooth.defined()) {
    need_tensor(a.smooth, "scales", at::kFloat, 2);
    need(a.smooth.size(1) == a.rows.size(1), "scales must have x's hidden size");
    need(a.smooth.size(0) > a.num_experts - 1 + a.smooth_shift, cam::str("scales must have a row per expert (", a.num_experts + a.smooth_shift, " rows), got ",
             a.smooth.size(0)));
  }
  check_wait_us(a.wait_us, size);
}

void check_combine_args(const MoeCombineArgs& a, int size) {
  for (const auto& [t, name] : {std::pair{a.rows, "expert output rows"}, {a.segments, "segments"},
                                {a.plan_peer, "plan ranks"}, {a.plan_seg, "plan segments"},
                                {a.plan_off, "plan offsets"}, {a.plan_weight, "plan weights"},
                                {a.add, "the added rows"}, {a.out, "the output"}}) {
    need_cpu(t, name);
  }
  need(a.rows.defined() && a.out.defined(), "expert output rows and the output must be given");
  need(a.rows.is_contiguous() && a.rows.dim() == 2 && kernels::moe_row_dtype_supported(a.rows.scalar_type()), cam::str("expert output rows must be a contiguous 2-D float32, bfloat16 or float16 tensor, got ",
                      a.rows.scalar_type(), " of shape ", a.rows.sizes()));
  need_tensor(a.segments, "segments", at::kLong, 2);
  need(a.segments.size(1) == 3, "segments must be (n, 3): first row, rows, owner rank");
  const int64_t n = a.rows.size(0);
  const int64_t* seg = a.segments.data_ptr<int64_t>();
  for (int64_t i = 0; i < a.segments.size(0); ++i) {
    const int64_t first = seg[3 * i], count = seg[3 * i + 1], owner = seg[3 * i + 2];
    need(first >= 0 && count >= 0 && first <= n - count,
         cam::str("segment ", i, " [", first, ", ", first + count, ") lies outside the ", n,
                  " expert output rows (fewer rows than dispatch served?)"));
    need(owner >= 0 && owner < size, cam::str("segment ", i, " names owner rank ", owner, " outside the group of ", size));
  }
  need(a.out.is_contiguous() && a.out.dim() == 2 && kernels::moe_row_dtype_supported(a.out.scalar_type()) &&
           a.out.size(1) == a.rows.size(1), "the output must be a contiguous float tensor of the rows' hidden size");
  need_tensor(a.plan_peer, "plan ranks", at::kInt, 2);
  need_tensor(a.plan_seg, "plan segments", at::kInt, 2);
  need_tensor(a.plan_off, "plan offsets", at::kLong, 2);
  need(a.plan_peer.size(0) == a.out.size(0) && a.plan_seg.sizes() == a.plan_peer.sizes() &&
           a.plan_off.sizes() == a.plan_peer.sizes(), "the plan must have one row per output token");
  if (a.plan_weight.defined()) {
    need_tensor(a.plan_weight, "plan weights", at::kFloat, 2);
    need(a.plan_weight.sizes() == a.plan_peer.sizes(), "plan weights must have the plan's shape");
  }
  if (a.add.defined()) {
    need(a.add.is_contiguous() && a.add.sizes() == a.out.sizes() &&
             (a.add.scalar_type() == a.out.scalar_type() || a.add.scalar_type() == at::kFloat), "the added rows must have the output's shape, and its dtype or float32");
  }
  check_wait_us(a.wait_us, size);
}

}  // namespace cam
