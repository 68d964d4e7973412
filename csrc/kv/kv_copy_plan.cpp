#include "kv_copy_plan.hpp"

#include <c10/util/Exception.h>

#include <algorithm>

namespace cam::kv {

namespace {
// Bounds of every id, then coverage; returns how many blocks the tokens use.
int64_t check_ids(BlockIds ids, const KVLayoutDesc& L, int64_t num_tokens, const char* what) {
  for (int64_t i = 0; i < ids.size; ++i) {
    TORCH_CHECK_INDEX(ids.data[i] >= 0 && ids.data[i] < L.num_blocks, what, "[", i, "] = ", ids.data[i],
                      " is out of range for a pool of ", L.num_blocks, " blocks");
  }
  const int64_t used = (num_tokens + L.block_size - 1) / L.block_size;
  TORCH_CHECK_VALUE(ids.size >= used, what, " has ", ids.size, " blocks but ", num_tokens,
                    " tokens at block_size ", L.block_size, " need ", used);
  return used;
}

// Whether a destination block would be written twice: a bitmap over the pool, cleared after.
void check_unique(BlockIds ids, int64_t used, int64_t num_blocks, const char* what) {
  thread_local std::vector<uint64_t> seen;
  if (int64_t(seen.size()) * 64 < num_blocks) seen.assign(size_t((num_blocks + 63) / 64), 0);
  int64_t repeated = -1;
  for (int64_t i = 0; i < used && repeated < 0; ++i) {
    const uint64_t b = uint64_t(ids.data[i]), bit = uint64_t(1) << (b & 63);
    if (seen[b >> 6] & bit) repeated = i;
    seen[b >> 6] |= bit;
  }
  for (int64_t i = 0; i < used; ++i) seen[uint64_t(ids.data[i]) >> 6] = 0;
  TORCH_CHECK_VALUE(repeated < 0, what, " repeats block id ", repeated < 0 ? 0 : ids.data[repeated], " (at ",
                    repeated, ") among the ", used, " blocks written");
}
}  // namespace

KVCopyPlan::KVCopyPlan(const KVLayoutDesc& src, BlockIds src_ids, const KVLayoutDesc& dst, BlockIds dst_ids,
                       int64_t num_tokens, std::vector<int64_t> layers, bool all_layers)
    : src_(src), dst_(dst) {
  TORCH_CHECK_VALUE(num_tokens >= 0, "num_tokens must be a non-negative int, got ", num_tokens);
  check_ids(src_ids, src, num_tokens, "src_block_ids");
  const int64_t used = check_ids(dst_ids, dst, num_tokens, "dst_block_ids");
  check_unique(dst_ids, used, dst.num_blocks, "dst_block_ids");
  if (all_layers) {
    layers_.resize(size_t(dst.num_layers));
    for (int64_t l = 0; l < dst.num_layers; ++l) layers_[size_t(l)] = l;
  } else {
    for (int64_t l : layers) {
      TORCH_CHECK_INDEX(l >= 0 && l < dst.num_layers, "layer ", l, " is out of range for ", dst.num_layers,
                        " layers");
    }
    layers_ = std::move(layers);
  }
  pieces_ = plan_pieces(src, dst);
  dst_blocks_.assign(dst_ids.data, dst_ids.data + used);
  int64_t heads = 0;
  for (const auto& p : pieces_) heads += p.heads;
  layer_bytes_ = num_tokens * dst.planes() * heads * dst.head_dim * dst.element_size();
  if (heads == 0) return;
  // Token runs: a new run wherever either side starts a block (counters, not divisions: a
  // 1024-block request is on the per-request budget).
  const int64_t sb = src.block_size, db = dst.block_size;
  runs_.reserve(size_t(sb == db ? used : used + (num_tokens + sb - 1) / sb));
  int64_t si = 0, so = 0, di = 0, dof = 0;  // block index and slot on each side
  for (int64_t t = 0; t < num_tokens;) {
    const int64_t n = std::min({sb - so, db - dof, num_tokens - t});
    runs_.push_back({src_ids.data[si], so, dst_ids.data[di], dof, n});
    t += n;
    so += n;
    dof += n;
    if (so == sb) so = 0, ++si;
    if (dof == db) dof = 0, ++di;
  }
}

int64_t KVCopyPlan::copy_layer(char* src_base, char* dst_base) const {
  if (runs_.empty()) return 0;
  kernels::kv_copy(src_.side(src_base), dst_.side(dst_base), runs_.data(), int64_t(runs_.size()), pieces_.data(),
                   int64_t(pieces_.size()));
  return layer_bytes_;
}

}  // namespace cam::kv
