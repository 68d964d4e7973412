#include <cstring>

#include "../../kernels/copy.hpp"
#include "../../kernels/moe_rows.hpp"
#include "moe_ops.hpp"

namespace cam {

// What a rank stages for combine: the rows it serves to other ranks (or the int8 form and
// scales of all its rows) at their row numbers, and its segment table [first row, rows, owner].
// Offsets are into the owner's tensor arena.
struct alignas(64) MoeCombineHeader {
  int64_t rows, hidden, row_bytes, nseg;
  int32_t row_dtype, quant;
  int64_t rows_off, scales_off, seg_off;
};

MoeCombineOp::MoeCombineOp(uint64_t seq, Clock::time_point deadline, MoeStage* stage,
                           MoeCombineArgs args)
    : MoeOp("moe_combine", CollKind::kMoeCombine, seq, deadline, stage, args.wait_us.defined()),
      a_(std::move(args)) {
  outputs_ = {a_.out};
}

void MoeCombineOp::fill_desc(Context& ctx, CollDesc* d) {
  const int64_t n = a_.rows.size(0), H = a_.rows.size(1);
  const int64_t nseg = a_.segments.size(0);
  const auto dtype = a_.rows.scalar_type();
  const int64_t row_bytes = a_.quant ? H : H * int64_t(c10::elementSize(dtype));
  const int64_t rows_heap =
      !a_.quant && n > 0 ? ctx.heap_offset(a_.rows.data_ptr(), int64_t(a_.rows.nbytes())) : -1;
  in_place_ = rows_heap >= 0;
  int64_t off = stage_align(sizeof(MoeCombineHeader));
  const int64_t seg_at = off;
  off += stage_align(nseg * 24);
  const int64_t scales_at = off;
  off += stage_align(a_.quant ? n * 4 : 0);
  const int64_t rows_at = off;
  if (!in_place_) off += stage_align(n * row_bytes);
  auto* h = stage_header<MoeCombineHeader>(d, off);
  char* s = reinterpret_cast<char*>(h);
  const int64_t base = d->heap_off;
  h->rows = n;
  h->hidden = H;
  h->row_bytes = row_bytes;
  h->nseg = nseg;
  h->row_dtype = int32_t(dtype);
  h->quant = a_.quant;
  h->seg_off = base + seg_at;
  h->scales_off = base + scales_at;
  h->rows_off = in_place_ ? rows_heap : base + rows_at;
  kernels::copy_bytes(s + seg_at, a_.segments.data_ptr(), nseg * 24);
  const char* src = static_cast<const char*>(a_.rows.data_ptr());
  const int64_t src_bytes = H * int64_t(c10::elementSize(dtype));
  if (a_.quant) {
    auto* scales = reinterpret_cast<float*>(s + scales_at);
    for (int64_t r = 0; r < n; ++r) {
      kernels::quantize_row_int8(dtype, src + r * src_bytes, nullptr, H,
                                 reinterpret_cast<int8_t*>(s + rows_at) + r * H, scales + r);
    }
    ctx.stats.add(ctx.stats.staged_bytes, n * row_bytes);
  } else if (!in_place_) {
    // Only rows another rank reads: this rank reads its own tokens' rows from `rows` itself.
    const int64_t* seg = a_.segments.data_ptr<int64_t>();
    for (int64_t i = 0; i < nseg; ++i) {
      const int64_t first = seg[3 * i], count = seg[3 * i + 1];
      if (seg[3 * i + 2] == ctx.rank || count <= 0) continue;
      // Segments were checked against the rows before the op was issued (MoeGroup::combine).
      kernels::copy_bytes(s + rows_at + first * row_bytes, src + first * row_bytes, count * row_bytes);
      ctx.stats.add(ctx.stats.staged_bytes, count * row_bytes);
    }
  }
}

void MoeCombineOp::validate(Context& ctx, const std::vector<const CollDesc*>& descs) {
  const int W = ctx.world;
  peers_.assign(W, nullptr);
  for (int r = 0; r < W; ++r) {
    peers_[r] = reinterpret_cast<const MoeCombineHeader*>(ctx.peer_heap(r, descs[r]->heap_off));
  }
  const int64_t H = a_.out.size(1);
  for (int r = 0; r < W; ++r) {
    if (peers_[r]->rows > 0 && peers_[r]->hidden != H) {
      refuse(ctx, str("rank ", r, " returns rows of hidden size ", peers_[r]->hidden,
                      " while this rank combines into rows of ", H));
    }
  }
  // The plan against what every peer serves, before anything is read.
  const int64_t n = a_.plan_peer.numel();
  const int32_t* peer = a_.plan_peer.data_ptr<int32_t>();
  const int32_t* seg = a_.plan_seg.data_ptr<int32_t>();
  const int64_t* off = a_.plan_off.data_ptr<int64_t>();
  const int64_t P = a_.plan_peer.size(1);
  for (int64_t i = 0; i < n; ++i) {
    const int p = peer[i];
    if (p < 0) continue;
    auto bad = [&](const std::string& what) {
      // Peers wait for this rank's release only if they served in place: release first.
      release_and_wait(ctx);
      refuse(ctx, str("token ", i / P, " slot ", i % P, ": ", what));
    };
    if (p >= W) bad(str("names rank ", p, " outside the group of ", W));
    const MoeCombineHeader& h = *peers_[p];
    if (seg[i] < 0 || seg[i] >= h.nseg) {
      bad(str("names segment ", seg[i], " of rank ", p, ", which serves ", h.nseg,
              " segments (ep_send_counts / handle from another dispatch?)"));
    }
    const int64_t* sg = reinterpret_cast<const int64_t*>(ctx.peer_heap(p, h.seg_off)) + 3 * seg[i];
    const int64_t row = sg[0] + off[i];
    if (off[i] < 0 || off[i] >= sg[1] || row < 0 || row >= h.rows) {
      bad(str("names row ", off[i], " of segment ", seg[i], " of rank ", p, ", which holds ", sg[1],
              " rows there and returns ", h.rows, " in all (expand_idx / handle from another "
              "dispatch, or expand_x shorter than dispatch produced?)"));
    }
    if (sg[2] != ctx.rank) {
      bad(str("names segment ", seg[i], " of rank ", p, ", which holds rank ", sg[2],
              "'s tokens, not this rank's"));
    }
  }
}

bool MoeCombineOp::data_step(Context& ctx) {
  if (!pulled_) {
    const int64_t T = a_.out.size(0), H = a_.out.size(1), P = a_.plan_peer.size(1);
    const auto out_dtype = a_.out.scalar_type();
    const int32_t* peer = a_.plan_peer.data_ptr<int32_t>();
    const int32_t* seg = a_.plan_seg.data_ptr<int32_t>();
    const int64_t* off = a_.plan_off.data_ptr<int64_t>();
    const float* weight = a_.plan_weight.defined() ? a_.plan_weight.data_ptr<float>() : nullptr;
    const char* add = a_.add.defined() ? static_cast<const char*>(a_.add.data_ptr()) : nullptr;
    char* out = static_cast<char*>(a_.out.data_ptr());
    const auto add_dtype = add ? a_.add.scalar_type() : out_dtype;
    const int64_t add_row = H * int64_t(c10::elementSize(add_dtype));
    const int64_t out_row = H * int64_t(c10::elementSize(out_dtype));
    const char* own = static_cast<const char*>(a_.rows.data_ptr());
    std::vector<const void*> rows(static_cast<size_t>(P));
    std::vector<c10::ScalarType> dtypes(static_cast<size_t>(P));
    std::vector<float> weights(static_cast<size_t>(P)), scales(static_cast<size_t>(P));
    int64_t moved = 0;
    for (int64_t t = 0; t < T; ++t) {
      kernels::WeightedRows src{rows.data(), dtypes.data(), weights.data(), scales.data(), 0};
      for (int64_t s = 0; s < P; ++s) {
        const int64_t i = t * P + s;
        const int p = peer[i];
        if (p < 0) continue;
        const MoeCombineHeader& h = *peers_[p];
        const int64_t row = reinterpret_cast<const int64_t*>(ctx.peer_heap(p, h.seg_off))[3 * seg[i]] + off[i];
        const int k = src.count++;
        // This rank's own rows were not staged (unless quantized): read them where they are.
        rows[k] = (p == ctx.rank && !h.quant ? own : ctx.peer_heap(p, h.rows_off)) + row * h.row_bytes;
        dtypes[k] = h.quant ? at::kChar : c10::ScalarType(h.row_dtype);
        scales[k] = h.quant ? reinterpret_cast<const float*>(ctx.peer_heap(p, h.scales_off))[row] : 1.f;
        weights[k] = weight ? weight[i] : 1.f;
        moved += h.row_bytes;
      }
      kernels::weighted_sum_row(src, add_dtype, add ? add + t * add_row : nullptr, a_.add_first, out_dtype,
                                out + t * out_row, H);
    }
    ctx.stats.add(ctx.stats.heap_read_bytes, moved);
    add_wait_times(a_.wait_us);
    pulled_ = true;
  }
  return release_and_wait(ctx);
}

}  // namespace cam
