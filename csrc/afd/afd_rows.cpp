#include "afd_rows.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "../../kernels/moe_rows.hpp"
#include "../core/errors.hpp"

namespace cam::afd {

namespace {
// Rows per parallel task: enough bytes that a task outweighs its dispatch.
int64_t grain_rows(int64_t row_bytes) { return std::max<int64_t>(1, (int64_t(256) << 10) / std::max<int64_t>(row_bytes, 1)); }
}  // namespace

std::string check_routing(const int32_t* ids, int64_t bs, int64_t topk, int64_t num_experts) {
  for (int64_t t = 0; t < bs; ++t) {
    const int32_t* row = ids + t * topk;
    for (int64_t k = 0; k < topk; ++k) {
      const int64_t e = row[k];
      if (e < -1 || e >= num_experts) {
        return str("token ", t, " slot ", k, ": expert id ", e, " is outside [-1, ", num_experts, ")");
      }
      if (e < 0) continue;
      for (int64_t j = 0; j < k; ++j) {
        if (row[j] == e) return str("token ", t, ": expert ", e, " appears in slots ", j, " and ", k);
      }
    }
  }
  return {};
}

int64_t gather_tokens(const std::vector<PostedTokens>& src, const ExpertPlacement& p, int64_t row_bytes,
                      bool quantized, int64_t capacity, int64_t max_tokens, char* out_rows, float* out_scales,
                      float* out_weights, int32_t* out_info, int64_t* out_counts, int32_t* token_rows) {
  const int64_t K = p.topk, L = p.local_experts, G = L + (p.shared ? 1 : 0);
  const int64_t lo_e = p.first_expert, hi_e = p.first_expert + L;
  // Counting pass, then one placement pass in (source, token, k) order, which leaves every
  // group ordered by (source, token).
  std::vector<int64_t> cursor(size_t(G) + 1, 0);
  for (const auto& s : src) {
    for (int64_t i = 0, n = s.bs * K; i < n; ++i) {
      const int64_t e = s.ids[i];
      if (e >= lo_e && e < hi_e) ++cursor[size_t(e - lo_e) + 1];
    }
    if (p.shared) {
      int64_t lo, hi;
      shared_chunk(s.bs, p.ffn_index, p.ffn_count, &lo, &hi);
      cursor[size_t(L) + 1] += hi - lo;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    out_counts[g] = cursor[size_t(g) + 1];
    cursor[size_t(g) + 1] += cursor[size_t(g)];
  }
  const int64_t total = cursor[size_t(G)];
  if (total > capacity) return -total - 1;
  for (int64_t a = 0; a < int64_t(src.size()); ++a) {
    const auto& s = src[size_t(a)];
    int32_t* tr = token_rows + a * max_tokens * (K + 1);
    std::fill(tr, tr + s.bs * (K + 1), -1);
    for (int64_t t = 0; t < s.bs; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = s.ids[t * K + k];
        if (e < lo_e || e >= hi_e) continue;
        const int64_t pos = cursor[size_t(e - lo_e)]++;
        int32_t* info = out_info + 3 * pos;
        info[0] = int32_t(a), info[1] = int32_t(t), info[2] = int32_t(k);
        tr[t * (K + 1) + k] = int32_t(pos);
      }
    }
    if (p.shared) {
      int64_t lo, hi;
      shared_chunk(s.bs, p.ffn_index, p.ffn_count, &lo, &hi);
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t pos = cursor[size_t(L)]++;
        int32_t* info = out_info + 3 * pos;
        info[0] = int32_t(a), info[1] = int32_t(t), info[2] = int32_t(K);
        tr[t * (K + 1) + K] = int32_t(pos);
      }
    }
  }
  at::parallel_for(0, total, grain_rows(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int32_t* info = out_info + 3 * i;
      const auto& s = src[size_t(info[0])];
      const int64_t t = info[1], k = info[2];
      std::memcpy(out_rows + i * row_bytes, s.rows + t * row_bytes, size_t(row_bytes));
      if (quantized) out_scales[i] = s.scales[t];
      out_weights[i] = k < K ? s.weights[t * K + k] : 1.f;
    }
  });
  return total;
}

void scatter_outputs(const char* rows, int64_t n, int64_t row_bytes, const int32_t* info,
                     const std::vector<char*>& dest, int64_t rows_per_token) {
  at::parallel_for(0, n, grain_rows(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int32_t* r = info + 3 * i;
      char* d = dest[size_t(r[0])] + (int64_t(r[1]) * rows_per_token + r[2]) * row_bytes;
      std::memcpy(d, rows + i * row_bytes, size_t(row_bytes));
    }
  });
}

void combine_outputs(const char* recv, c10::ScalarType recv_dtype, const int32_t* ids, const float* weights,
                     int64_t bs, int64_t topk, int64_t hidden, bool shared, c10::ScalarType out_dtype,
                     char* out) {
  const int64_t row_bytes = hidden * int64_t(c10::elementSize(recv_dtype));
  const int64_t out_bytes = hidden * int64_t(c10::elementSize(out_dtype));
  const int64_t per_token = topk + (shared ? 1 : 0);
  at::parallel_for(0, bs, grain_rows(row_bytes * per_token), [&](int64_t begin, int64_t end) {
    std::vector<const void*> rows(static_cast<size_t>(topk));
    std::vector<c10::ScalarType> dtypes(static_cast<size_t>(topk), recv_dtype);
    std::vector<float> w(static_cast<size_t>(topk));
    for (int64_t t = begin; t < end; ++t) {
      const char* base = recv + t * per_token * row_bytes;
      int count = 0;
      for (int64_t k = 0; k < topk; ++k) {
        if (ids[t * topk + k] < 0) continue;
        rows[size_t(count)] = base + k * row_bytes;
        w[size_t(count)] = weights[t * topk + k];
        ++count;
      }
      kernels::WeightedRows src{rows.data(), dtypes.data(), w.data(), nullptr, count};
      kernels::weighted_sum_row(src, recv_dtype, shared ? base + topk * row_bytes : nullptr, false, out_dtype,
                                out + t * out_bytes, hidden);
    }
  });
}

void reduce_outputs(const char* rows, c10::ScalarType dtype, int64_t hidden, const float* weights,
                    const int32_t* token_rows, const std::vector<int64_t>& tokens, int64_t max_tokens,
                    int64_t topk, const std::vector<float*>& dest, int64_t ffn_index, int64_t ffn_count) {
  const int64_t row_bytes = hidden * int64_t(c10::elementSize(dtype));
  std::vector<int64_t> first(tokens.size() + 1, 0);  // (source, token) pairs, flattened
  for (size_t a = 0; a < tokens.size(); ++a) first[a + 1] = first[a] + tokens[a];
  const int64_t pairs = first.back();
  at::parallel_for(0, pairs, grain_rows(row_bytes * 2), [&](int64_t begin, int64_t end) {
    std::vector<const void*> src(static_cast<size_t>(topk));
    std::vector<c10::ScalarType> dtypes(static_cast<size_t>(topk), dtype);
    std::vector<float> w(static_cast<size_t>(topk));
    size_t a = size_t(std::upper_bound(first.begin(), first.end(), begin) - first.begin()) - 1;
    for (int64_t i = begin; i < end; ++i) {
      while (i >= first[a + 1]) ++a;
      const int64_t t = i - first[a];
      const int32_t* tr = token_rows + (int64_t(a) * max_tokens + t) * (topk + 1);
      int count = 0;
      for (int64_t k = 0; k < topk; ++k) {
        if (tr[k] < 0) continue;
        src[size_t(count)] = rows + int64_t(tr[k]) * row_bytes;
        w[size_t(count)] = weights[tr[k]];
        ++count;
      }
      const void* add = tr[topk] >= 0 ? rows + int64_t(tr[topk]) * row_bytes : nullptr;
      if (count == 0 && add == nullptr) continue;  // the owner knows this rank has no part in t
      kernels::WeightedRows ws{src.data(), dtypes.data(), w.data(), nullptr, count};
      kernels::weighted_sum_row(ws, dtype, add, false, c10::ScalarType::Float,
                                dest[a] + (t * ffn_count + ffn_index) * hidden, hidden);
    }
  });
}

void combine_partials(const float* recv, const int32_t* ids, int64_t bs, int64_t topk, int64_t hidden,
                      int64_t experts_per_rank, int64_t ffn_count, bool shared, c10::ScalarType out_dtype,
                      char* out) {
  const int64_t out_bytes = hidden * int64_t(c10::elementSize(out_dtype));
  const int64_t chunk = (bs + ffn_count - 1) / std::max<int64_t>(ffn_count, 1);
  at::parallel_for(0, bs, grain_rows(hidden * 4 * ffn_count), [&](int64_t begin, int64_t end) {
    std::vector<char> part(static_cast<size_t>(ffn_count));
    std::vector<const void*> src(static_cast<size_t>(ffn_count));
    std::vector<c10::ScalarType> dtypes(static_cast<size_t>(ffn_count), c10::ScalarType::Float);
    std::vector<float> ones(static_cast<size_t>(ffn_count), 1.f);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(part.begin(), part.end(), 0);
      for (int64_t k = 0; k < topk; ++k) {
        const int64_t e = ids[t * topk + k];
        if (e >= 0) part[size_t(e / experts_per_rank)] = 1;
      }
      if (shared) part[size_t(t / chunk)] = 1;
      int count = 0;
      for (int64_t f = 0; f < ffn_count; ++f) {
        if (part[size_t(f)]) src[size_t(count++)] = recv + (t * ffn_count + f) * hidden;
      }
      kernels::WeightedRows ws{src.data(), dtypes.data(), ones.data(), nullptr, count};
      kernels::weighted_sum_row(ws, c10::ScalarType::Float, nullptr, false, out_dtype, out + t * out_bytes, hidden);
    }
  });
}

void quantize_tokens(const char* x, c10::ScalarType dtype, int64_t bs, int64_t hidden, int8_t* q,
                     float* scales) {
  const int64_t row_bytes = hidden * int64_t(c10::elementSize(dtype));
  at::parallel_for(0, bs, grain_rows(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      kernels::quantize_row_int8(dtype, x + t * row_bytes, nullptr, hidden, q + t * hidden, scales + t);
    }
  });
}

}  // namespace cam::afd
