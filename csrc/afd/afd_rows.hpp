// Row movement of attention-FFN disaggregation (torch_cam/afd.py drives it; docs/afd.md).
//
// The channel's memory (per rank, in its tensor heap, mapped by every peer):
//   attention rank: per slot, the posted message (routing ids, weights, token rows or their
//                   int8 + scales) and a receive area that the FFN ranks fill
//   FFN rank:       per slot, per attention rank, a done counter (and a status line)
// These functions are the loops over rows between those places; the protocol (counters,
// headers, deadlines, errors) lives in afd.py. Every layout and reduction order is stated
// once, here:
//
//   gather (FFN):  rows grouped by local expert j = 0..L-1, then the shared-expert group (when
//                  the channel has one); inside a group ordered by (attention rank, token).
//                  info[i] = (attention rank index, token, k), k = K for a shared-expert row;
//                  token_rows[(a * B + t) * (K + 1) + k] = i (-1: none). The shared expert of
//                  attention rank a's token t is computed by FFN rank t / ceil(bs_a / N)
//                  (contiguous chunks, so every FFN rank takes a share).
//   Weights given with the tokens (the usual case): the FFN rank pre-sums.
//     reduce (FFN):  partial[t][f] = sum over its rows of token t, k in order, of w_k * row_k,
//                    then + the shared row, in fp32 (kernels::weighted_sum_row), written to row
//                    (t, f) of the owner's receive area (B, N, H) fp32; only FFN ranks holding
//                    one of the token's rows write it
//     combine (attention): out[t] = round(sum over those f, ascending, of partial[t][f])
//   Weights given at the receive (CAM's split ops): rows travel.
//     scatter (FFN): expert output row i goes to row (t, k) of the owner's receive area
//                    (B, K + shared, H) of the rows' dtype
//     combine (attention): out[t] = round(sum over k with ids >= 0, in k order, of
//                    w_k * row(t, k), fp32, then + row(t, K) if shared)
// torch_cam/afd_reference.py computes both orders the same way.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace cam::afd {

// One attention rank's posted message as an FFN rank sees it (pointers into that rank's
// mapped window).
struct PostedTokens {
  const int32_t* ids = nullptr;    // (bs, K)
  const float* weights = nullptr;  // (bs, K)
  const char* rows = nullptr;      // (bs, H) of the message dtype, or int8 when quantized
  const float* scales = nullptr;   // (bs,) when quantized
  int64_t bs = 0;
};

struct ExpertPlacement {
  int64_t topk = 0;           // K
  int64_t hidden = 0;         // H
  int64_t num_experts = 0;    // routed experts E (ids -1 .. E-1; -1: not routed)
  int64_t first_expert = 0;   // this FFN rank's experts: first_expert .. first_expert + local - 1
  int64_t local_experts = 0;  // L
  bool shared = false;        // a shared expert, computed by every FFN rank for its chunk
  int64_t ffn_index = 0;      // f of N
  int64_t ffn_count = 1;
};

// Shared-expert chunk [lo, hi) of FFN rank f for a batch of bs tokens.
inline void shared_chunk(int64_t bs, int64_t f, int64_t n, int64_t* lo, int64_t* hi) {
  const int64_t c = (bs + n - 1) / n;
  *lo = std::min(bs, f * c);
  *hi = std::min(bs, (f + 1) * c);
}

// "" when every id of ids (bs, K) lies in [-1, E) and no expert repeats within a token;
// otherwise what is wrong with the first offending token.
std::string check_routing(const int32_t* ids, int64_t bs, int64_t topk, int64_t num_experts);

// Rows of this FFN rank's experts (and shared chunk) over all sources. Returns the row count,
// or -(count) - 1 when it exceeds `capacity` (nothing copied; the caller grows and retries).
// out_rows (capacity, row_bytes); out_scales (capacity,) or null; out_weights (capacity,);
// out_info (capacity, 3); out_counts (L + shared); token_rows (sources * max_tokens * (K + 1)).
int64_t gather_tokens(const std::vector<PostedTokens>& src, const ExpertPlacement& p, int64_t row_bytes,
                      bool quantized, int64_t capacity, int64_t max_tokens, char* out_rows, float* out_scales,
                      float* out_weights, int32_t* out_info, int64_t* out_counts, int32_t* token_rows);

// The FFN rank's pre-summed partials (see above). rows (n, H) of dtype; weights (n,) per row;
// token_rows as gather left it; dest[a] the receive area (B, N, H) fp32 of source a.
void reduce_outputs(const char* rows, c10::ScalarType dtype, int64_t hidden, const float* weights,
                    const int32_t* token_rows, const std::vector<int64_t>& tokens, int64_t max_tokens,
                    int64_t topk, const std::vector<float*>& dest, int64_t ffn_index, int64_t ffn_count);

// The attention side's sum of partials: ids (bs, K) tell which FFN ranks wrote row (t, f)
// (expert e lives on FFN rank e / experts_per_rank; with a shared expert, chunk owner too).
void combine_partials(const float* recv, const int32_t* ids, int64_t bs, int64_t topk, int64_t hidden,
                      int64_t experts_per_rank, int64_t ffn_count, bool shared, c10::ScalarType out_dtype,
                      char* out);

// Expert output rows (n, row_bytes) to their attention ranks' receive areas (dest[a]: row
// (t, k) at (t * rows_per_token + k) * row_bytes, rows_per_token = K + shared).
void scatter_outputs(const char* rows, int64_t n, int64_t row_bytes, const int32_t* info,
                     const std::vector<char*>& dest, int64_t rows_per_token);

// The attention side's weighted sum (see the layout above). recv (bs, K + shared, H) of
// recv_dtype; out (bs, H) of out_dtype.
void combine_outputs(const char* recv, c10::ScalarType recv_dtype, const int32_t* ids, const float* weights,
                     int64_t bs, int64_t topk, int64_t hidden, bool shared, c10::ScalarType out_dtype,
                     char* out);

// Per-row dynamic int8 of x (bs, H) into q (bs, H) and scales (bs,) (kernels::quantize_row_int8).
void quantize_tokens(const char* x, c10::ScalarType dtype, int64_t bs, int64_t hidden, int8_t* q,
                     float* scales);

}  // namespace cam::afd
