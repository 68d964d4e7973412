#include <cstring>

#include "../../kernels/copy.hpp"
#include "../../kernels/moe_rows.hpp"
#include "moe_ops.hpp"

namespace cam {

// ---- MoeOp ----------------------------------------------------------------------------------

void MoeOp::add_wait_times(const at::Tensor& wait_us) const {
  if (!wait_us.defined() || arrival_us_.empty()) return;
  int64_t* w = wait_us.data_ptr<int64_t>();
  for (size_t p = 0; p < arrival_us_.size(); ++p) w[p] += std::max<int64_t>(arrival_us_[p], 0);
}

bool MoeOp::release_and_wait(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  bool progress = false;
  if (!released_) {
    for (int p = 0; p < ctx.world; ++p) {
      if (p != ctx.rank) signal_release(W.consumed(ctx.me, p), stream_value(seq(), 1));
    }
    released_ = true;
    progress = true;
  }
  if (in_place_) {
    for (; next_reader_ < ctx.world; ++next_reader_) {
      if (next_reader_ == ctx.rank) continue;
      if (signal_acquire(W.consumed(ctx.peer(next_reader_), ctx.rank)) < stream_value(seq(), 1)) {
        waiting(next_reader_, "the release of this rank's rows read in place");
        return progress;
      }
    }
  }
  mark_done();
  return true;
}

// ---- dispatch -------------------------------------------------------------------------------

// What a rank stages for dispatch, at the start of its stage half. Offsets are into the
// owner's tensor arena (rows may be the caller's own heap tensor).
struct alignas(64) MoeDispatchHeader {
  int64_t tokens, topk, num_experts, width_bytes, aux_bytes, max_tokens, capacity, slab_rows;
  int32_t shared_ranks, experts_per_rank, quant, has_weights, row_dtype, hidden;
  int64_t rows_off, weights_off, csr_off, entries_off, aux_off, active_off;
  // Quantization without smooth scales gives a token the same int8 row for every expert, so
  // the sender quantizes each token once and stages int8 rows (H bytes) plus their scales.
  int32_t prequant, pad;
  int64_t scales_off;
  // First routing error found while building the CSR (kind 0: none).
  int32_t bad_kind, bad_token, bad_slot, bad_value;
};

namespace {
enum BadRouting : int32_t { kRoutingOk = 0, kOutOfRange = 1, kRepeated = 2 };

// The shared-expert chunk of rank r's T tokens that goes to shared rank c of S:
// [lo(c), lo(c + 1)) with lo(c) = floor((c + r) * T / S) - floor(r * T / S), which rotates
// the remainder with r so that shared ranks stay balanced.
inline int64_t shared_lo(int64_t r, int64_t c, int64_t T, int64_t S) {
  return (c + r) * T / S - r * T / S;
}
}  // namespace

MoeDispatchOp::MoeDispatchOp(uint64_t seq, Clock::time_point deadline, MoeStage* stage,
                             MoeDispatchArgs args)
    : MoeOp("moe_dispatch", CollKind::kMoeDispatch, seq, deadline, stage, args.wait_us.defined()),
      a_(std::move(args)) {
  outputs_ = {a_.out_rows};
}

void MoeDispatchOp::fill_desc(Context& ctx, CollDesc* d) {
  const int64_t T = a_.rows.size(0), K = a_.ids.size(1), M = a_.num_experts;
  const int64_t width = a_.rows.size(1) * int64_t(a_.rows.element_size());
  const int64_t aux = a_.aux.defined() ? a_.aux.size(1) : 0;
  const bool prequant = a_.quant && !a_.smooth.defined();
  const int64_t H = a_.rows.size(1);
  const int64_t rows_heap =
      T > 0 && !prequant ? ctx.heap_offset(a_.rows.data_ptr(), int64_t(a_.rows.nbytes())) : -1;
  in_place_ = rows_heap >= 0;
  // Stage layout: header | weights | csr | entries | aux | active | scales | rows (unless in place)
  int64_t off = stage_align(sizeof(MoeDispatchHeader));
  auto place = [&](int64_t bytes) {
    const int64_t at = off;
    off += stage_align(bytes);
    return at;
  };
  const int64_t w_at = place(a_.weights.defined() ? T * K * 4 : 0);
  const int64_t csr_at = place((M + 1) * 4);
  const int64_t ent_at = place(T * K * 4);
  const int64_t aux_at = place(T * aux);
  const int64_t act_at = place(T);
  const int64_t scales_at = place(prequant ? T * 4 : 0);
  const int64_t rows_at = in_place_ ? -1 : place(T * (prequant ? H : width));
  auto* h = stage_header<MoeDispatchHeader>(d, off);
  char* s = reinterpret_cast<char*>(h);
  const int64_t base = d->heap_off;
  h->tokens = T;
  h->topk = K;
  h->num_experts = M;
  h->width_bytes = width;
  h->aux_bytes = aux;
  h->max_tokens = a_.max_tokens;
  h->capacity = a_.out_rows.size(0);
  h->slab_rows = a_.slab_rows;
  h->shared_ranks = a_.shared_ranks;
  h->experts_per_rank = a_.experts_per_rank;
  h->quant = a_.quant;
  h->has_weights = a_.weights.defined();
  h->row_dtype = int32_t(a_.rows.scalar_type());
  h->hidden = int32_t(a_.rows.size(1));
  h->weights_off = base + w_at;
  h->csr_off = base + csr_at;
  h->entries_off = base + ent_at;
  h->aux_off = base + aux_at;
  h->active_off = base + act_at;
  h->rows_off = in_place_ ? rows_heap : base + rows_at;
  h->prequant = prequant;
  h->scales_off = base + scales_at;
  const int32_t* ids = a_.ids.data_ptr<int32_t>();
  if (h->has_weights) kernels::copy_bytes(s + w_at, a_.weights.data_ptr(), T * K * 4);
  if (aux > 0) kernels::copy_bytes(s + aux_at, a_.aux.data_ptr(), T * aux);
  kernels::copy_bytes(s + act_at, a_.token_active.data_ptr(), T);
  if (prequant) {
    const auto dtype = a_.rows.scalar_type();
    const char* src = static_cast<const char*>(a_.rows.data_ptr());
    auto* scales = reinterpret_cast<float*>(s + scales_at);
    for (int64_t t = 0; t < T; ++t) {
      kernels::quantize_row_int8(dtype, src + t * width, nullptr, H,
                                 reinterpret_cast<int8_t*>(s + rows_at) + t * H, scales + t);
    }
    ctx.stats.add(ctx.stats.staged_bytes, T * H);
  } else if (!in_place_) {
    kernels::copy_bytes(s + rows_at, a_.rows.data_ptr(), T * width);
    ctx.stats.add(ctx.stats.staged_bytes, T * width);
  }
  // Routing as CSR: entries (t * K + k) grouped by expert, row-major within an expert.
  auto* csr = reinterpret_cast<int32_t*>(s + csr_at);
  auto* ent = reinterpret_cast<int32_t*>(s + ent_at);
  std::memset(csr, 0, size_t(M + 1) * 4);
  for (int64_t t = 0; t < T && h->bad_kind == kRoutingOk; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = ids[t * K + k];
      if (e == -1) continue;
      auto bad = [&](int32_t kind) {
        h->bad_kind = kind;
        h->bad_token = int32_t(t);
        h->bad_slot = int32_t(k);
        h->bad_value = e;
      };
      if (e < 0 || e >= M) {
        bad(kOutOfRange);
        break;
      }
      for (int64_t k2 = 0; k2 < k; ++k2) {
        if (ids[t * K + k2] == e) bad(kRepeated);
      }
      if (h->bad_kind != kRoutingOk) break;
      ++csr[e + 1];
    }
  }
  if (h->bad_kind != kRoutingOk) return;
  for (int64_t e = 0; e < M; ++e) csr[e + 1] += csr[e];
  std::vector<int32_t> fill(csr, csr + M);
  int32_t* occ = a_.out_occurrence.defined() ? a_.out_occurrence.data_ptr<int32_t>() : nullptr;
  for (int64_t i = 0; i < T * K; ++i) {
    const int32_t e = ids[i];
    if (e >= 0) {
      if (occ) occ[i] = fill[e] - csr[e];  // expand_idx: the entry's place in its expert's list
      ent[fill[e]++] = int32_t(i);
    } else if (occ) {
      occ[i] = -1;
    }
  }
}

void MoeDispatchOp::validate(Context& ctx, const std::vector<const CollDesc*>& descs) {
  const int W = ctx.world;
  peers_.assign(W, nullptr);
  for (int r = 0; r < W; ++r) {
    peers_[r] = reinterpret_cast<const MoeDispatchHeader*>(ctx.peer_heap(r, descs[r]->heap_off));
  }
  const MoeDispatchHeader& me = *peers_[ctx.rank];
  auto who = [&](int r) { return r == ctx.rank ? std::string("this rank") : str("rank ", r); };
  for (int r = 0; r < W; ++r) {
    const MoeDispatchHeader& p = *peers_[r];
    auto differ = [&](const char* what, int64_t theirs, int64_t mine) {
      if (theirs != mine) {
        refuse(ctx, str("rank ", r, " dispatches with ", what, " = ", theirs, " while this rank uses ",
                        mine, "; every rank of the EP group must pass the same value"));
      }
    };
    differ("moe_expert_num (routed expert ids)", p.num_experts, me.num_experts);
    differ("top-k (expert_ids.size(1))", p.topk, me.topk);
    differ("shared_expert_rank_num", p.shared_ranks, me.shared_ranks);
    differ("experts per rank", p.experts_per_rank, me.experts_per_rank);
    differ("quant_mode", p.quant ? 2 : 0, me.quant ? 2 : 0);
    differ("hidden size (x.size(1))", p.hidden, me.hidden);
    differ("bytes per token row", p.width_bytes, me.width_bytes);
    differ("bytes of per-token side data", p.aux_bytes, me.aux_bytes);
    differ("routing weights given (expert_scales)", p.has_weights, me.has_weights);
    differ("max tokens per rank (global_bs / ep_world_size)", p.max_tokens, me.max_tokens);
    if (p.row_dtype != me.row_dtype) {
      refuse(ctx, str("rank ", r, " dispatches ", dtype_name(p.row_dtype), " tokens while this rank "
                      "dispatches ", dtype_name(me.row_dtype)));
    }
    if (me.max_tokens == 0 && p.tokens != me.tokens) {
      refuse(ctx, str(who(r), " has ", p.tokens, " tokens while this rank has ", me.tokens,
                      "; ranks with different batch sizes must pass global_bs = max tokens per rank "
                      "* ep_world_size"));
    }
    if (p.max_tokens > 0 && p.tokens > p.max_tokens) {
      refuse(ctx, str(who(r), " has ", p.tokens, " tokens, more than the ", p.max_tokens,
                      " per rank the outputs are sized for (global_bs / ep_world_size, or "
                      "num_max_dispatch_tokens_per_rank)"));
    }
    if (p.bad_kind != kRoutingOk) {
      refuse(ctx, str(who(r), ": expert_ids[", p.bad_token, ", ", p.bad_slot, "] = ", p.bad_value,
                      p.bad_kind == kOutOfRange
                          ? str(" is out of range; expected an expert id in [0, ", p.num_experts, ")")
                          : std::string(" repeats an expert already chosen earlier in that token's row; "
                                        "each token's expert ids must be distinct")));
    }
  }
  // Every receiver's row count against its capacity, computed by every rank alike.
  const int S = me.shared_ranks, Lx = me.experts_per_rank;
  for (int d = 0; d < W; ++d) {
    int64_t total = 0;
    if (d < S) {
      for (int src = 0; src < W; ++src) {
        const MoeDispatchHeader& p = *peers_[src];
        if (src != d && src < S) continue;  // shared ranks send each other nothing
        const auto* act = reinterpret_cast<const uint8_t*>(ctx.peer_heap(src, p.active_off));
        const bool own = src == d;  // its own tokens, all of them
        const int64_t lo = own ? 0 : shared_lo(src, d, p.tokens, S);
        const int64_t hi = own ? p.tokens : shared_lo(src, d + 1, p.tokens, S);
        for (int64_t t = lo; t < hi; ++t) total += act[t] != 0;
      }
    } else {
      for (int j = 0; j < Lx; ++j) {
        const int64_t e = int64_t(d - S) * Lx + j;
        int64_t per_expert = 0;
        for (int src = 0; src < W; ++src) {
          const auto* csr = reinterpret_cast<const int32_t*>(ctx.peer_heap(src, peers_[src]->csr_off));
          per_expert += csr[e + 1] - csr[e];
        }
        if (me.slab_rows > 0 && per_expert > me.slab_rows) {
          refuse(ctx, str("expert ", e, " on rank ", d, " receives ", per_expert, " rows but its slab holds ",
                          me.slab_rows, " (num_max_dispatch_tokens_per_rank * num_ranks)"));
        }
        total += per_expert;
      }
    }
    if (total > peers_[d]->capacity) {
      refuse(ctx, str(who(d), " would receive ", total, " rows but its output holds ", peers_[d]->capacity,
                      " (sized from global_bs and the expert layout); pass a global_bs that bounds "
                      "every rank's tokens"));
    }
  }
}

bool MoeDispatchOp::data_step(Context& ctx) {
  if (!pulled_) {
    const int W = ctx.world, me = ctx.rank;
    const MoeDispatchHeader& mh = *peers_[me];
    const int S = mh.shared_ranks;
    const int64_t K = mh.topk, width = mh.width_bytes, aux = mh.aux_bytes, H = mh.hidden;
    const auto dtype = c10::ScalarType(mh.row_dtype);
    char* out_rows = static_cast<char*>(a_.out_rows.data_ptr());
    float* out_scales = a_.quant ? a_.out_scales.data_ptr<float>() : nullptr;
    float* out_w = a_.out_weights.defined() ? a_.out_weights.data_ptr<float>() : nullptr;
    int32_t* out_info = a_.out_info.defined() ? a_.out_info.data_ptr<int32_t>() : nullptr;
    char* out_aux = a_.out_aux.defined() ? static_cast<char*>(a_.out_aux.data_ptr()) : nullptr;
    int32_t* counts = a_.out_counts.data_ptr<int32_t>();
    const float* smooth = a_.smooth.defined() ? a_.smooth.data_ptr<float>() : nullptr;
    const int64_t out_width = a_.quant ? H : width;
    int64_t moved = 0;
    // One received row: (src, token t, slot k) to position pos.
    auto put = [&](int src, const MoeDispatchHeader& p, int64_t t, int64_t k, int64_t pos,
                   int64_t smooth_row) {
      if (p.prequant) {
        kernels::copy_bytes(out_rows + pos * H, ctx.peer_heap(src, p.rows_off) + t * H, H);
        out_scales[pos] = reinterpret_cast<const float*>(ctx.peer_heap(src, p.scales_off))[t];
      } else if (a_.quant) {
        const char* row = ctx.peer_heap(src, p.rows_off) + t * width;
        kernels::quantize_row_int8(dtype, row, smooth ? smooth + smooth_row * H : nullptr, H,
                                   reinterpret_cast<int8_t*>(out_rows) + pos * H, out_scales + pos);
      } else {
        kernels::copy_bytes(out_rows + pos * out_width, ctx.peer_heap(src, p.rows_off) + t * width, width);
      }
      if (out_aux) kernels::copy_bytes(out_aux + pos * aux, ctx.peer_heap(src, p.aux_off) + t * aux, aux);
      if (out_w) {
        out_w[pos] = k >= 0 && p.has_weights
                         ? reinterpret_cast<const float*>(ctx.peer_heap(src, p.weights_off))[t * K + k]
                         : 0.f;
      }
      if (out_info) {
        int32_t* info = out_info + pos * a_.info_stride;
        info[0] = src;
        info[1] = int32_t(t);
        info[2] = int32_t(k);
      }
      moved += p.prequant ? H : width;
    };
    int64_t pos = 0;
    if (me < S) {
      // Shared-expert rank: its own active tokens (counted per chunk of its own split), then
      // the chunk every routed-expert rank sends it, in rank order.
      const auto* own_act = reinterpret_cast<const uint8_t*>(ctx.peer_heap(me, mh.active_off));
      for (int c = 0; c < S; ++c) {
        for (int64_t t = shared_lo(me, c, mh.tokens, S); t < shared_lo(me, c + 1, mh.tokens, S); ++t) {
          if (own_act[t]) put(me, mh, t, -1, pos++, 0);
        }
        counts[c] = int32_t(pos);
      }
      for (int src = S; src < W; ++src) {
        const MoeDispatchHeader& p = *peers_[src];
        const auto* act = reinterpret_cast<const uint8_t*>(ctx.peer_heap(src, p.active_off));
        for (int64_t t = shared_lo(src, me, p.tokens, S); t < shared_lo(src, me + 1, p.tokens, S); ++t) {
          if (act[t]) put(src, p, t, -1, pos++, 0);
        }
        counts[src] = int32_t(pos);
      }
    } else {
      const int Lx = mh.experts_per_rank;
      int64_t running = 0;
      for (int j = 0; j < Lx; ++j) {
        const int64_t e = int64_t(me - S) * Lx + j;
        int64_t within = 0;
        for (int src = 0; src < W; ++src) {
          const MoeDispatchHeader& p = *peers_[src];
          const auto* csr = reinterpret_cast<const int32_t*>(ctx.peer_heap(src, p.csr_off));
          const auto* ent = reinterpret_cast<const int32_t*>(ctx.peer_heap(src, p.entries_off));
          for (int32_t i = csr[e]; i < csr[e + 1]; ++i) {
            const int64_t where = a_.slab_rows > 0 ? j * a_.slab_rows + within : running;
            put(src, p, ent[i] / K, ent[i] % K, where, e + a_.smooth_shift);
            ++within;
            ++running;
          }
          counts[j * W + src] = int32_t(running);
        }
      }
    }
    ctx.stats.add(ctx.stats.heap_read_bytes, moved);
    add_wait_times(a_.wait_us);
    pulled_ = true;
  }
  return release_and_wait(ctx);
}

}  // namespace cam
