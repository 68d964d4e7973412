// KV pool layouts and the head plan between two TP groups (the native twin of
// torch_cam/kv_reference.py's KVLayout and plan_kv_copy, which stay the ground truth; tests
// compare the two).
//
// A layout describes one rank's per-layer pool: mha [2, blocks, block_size, heads, head_dim]
// ("NHD") or [2, blocks, heads, block_size, head_dim] ("HND"); mla [blocks, block_size,
// head_dim] (one latent vector per token, replicated over the TP group).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../../kernels/kv_copy.hpp"

namespace cam::kv {

struct KVLayoutDesc {
  int64_t mla = 0;  // 0: mha, 1: mla
  int64_t num_layers = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t dtype = 0;  // c10::ScalarType
  int64_t hnd = 0;    // 1: heads before tokens inside a block
  int64_t tp_rank = 0;
  int64_t tp_size = 1;
  int64_t total_kv_heads = 0;

  // ValueError naming the first inconsistent field.
  void validate() const;
  int64_t planes() const { return mla ? 1 : 2; }
  int64_t element_size() const { return int64_t(c10::elementSize(c10::ScalarType(dtype))); }
  int64_t pool_bytes() const { return planes() * num_blocks * block_size * num_kv_heads * head_dim * element_size(); }
  std::vector<int64_t> pool_shape() const;
  // How many ranks of the TP group hold each head (1: sharded).
  int64_t replication() const;
  // First global head this rank (or TP rank r) holds.
  int64_t first_head(int64_t r) const;
  // The copy kernel's view of one layer's pool at `base`.
  kernels::KVPoolSide side(char* base) const;
  std::string describe() const;  // "mha NHD bfloat16 [2, 64, 16, 8, 128] tp 0/1"
  // ValueError unless t is one layer's pool of this layout: a contiguous CPU tensor of its
  // shape and dtype. `what` names the tensor in the message ("src_pools[2]").
  void check_pool(const at::Tensor& t, const std::string& what) const;
};

// ValueError unless a copy from src's TP group into dst's rank can be planned (same kind,
// layers, head_dim, total heads, dtype).
void check_compatible(const KVLayoutDesc& src, const KVLayoutDesc& dst);

// The head pieces source rank src.tp_rank feeds destination rank dst.tp_rank: for every
// destination head, the source rank holding it (the replica dst.tp_rank % replication for
// replicated heads), merged into ranges. Empty when src.tp_rank feeds dst.tp_rank nothing.
std::vector<kernels::KVHeadPiece> plan_pieces(const KVLayoutDesc& src, const KVLayoutDesc& dst);

}  // namespace cam::kv
