#include "kv_layout.hpp"

#include <c10/util/Exception.h>

#include "../core/errors.hpp"

namespace cam::kv {

void KVLayoutDesc::validate() const {
  TORCH_CHECK_VALUE(num_layers >= 1 && num_blocks >= 1 && block_size >= 1 && num_kv_heads >= 1 && head_dim >= 1 &&
                        tp_size >= 1 && total_kv_heads >= 1,
                    "KV layout fields must be positive: ", describe());
  TORCH_CHECK_VALUE(tp_rank >= 0 && tp_rank < tp_size, "KV layout tp_rank ", tp_rank, " is outside tp_size ",
                    tp_size);
  if (mla) {
    TORCH_CHECK_VALUE(num_kv_heads == 1 && total_kv_heads == 1,
                      "mla layouts hold one latent vector per token: ", describe());
    return;
  }
  const int64_t H = total_kv_heads, T = tp_size;
  if (T <= H) {
    TORCH_CHECK_VALUE(H % T == 0 && num_kv_heads == H / T, "KV layout: total_kv_heads=", H, " over tp_size=", T,
                      " does not give num_kv_heads=", num_kv_heads);
  } else {
    TORCH_CHECK_VALUE(T % H == 0 && num_kv_heads == 1, "KV layout: tp_size=", T, " > total_kv_heads=", H,
                      " needs tp_size % total_kv_heads == 0 and one head per rank, got ", num_kv_heads);
  }
}

std::vector<int64_t> KVLayoutDesc::pool_shape() const {
  if (mla) return {num_blocks, block_size, head_dim};
  if (hnd) return {2, num_blocks, num_kv_heads, block_size, head_dim};
  return {2, num_blocks, block_size, num_kv_heads, head_dim};
}

int64_t KVLayoutDesc::replication() const {
  if (mla) return tp_size;
  return tp_size > total_kv_heads ? tp_size / total_kv_heads : 1;
}

int64_t KVLayoutDesc::first_head(int64_t r) const { return mla ? 0 : r * total_kv_heads / tp_size; }

kernels::KVPoolSide KVLayoutDesc::side(char* base) const {
  return kernels::KVPoolSide{base, planes(), num_blocks, block_size, num_kv_heads, head_dim * element_size(),
                             mla == 0 && hnd != 0};
}

std::string KVLayoutDesc::describe() const {
  std::string shape;
  for (int64_t d : pool_shape()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
  return str(mla ? "mla" : (hnd ? "mha HND" : "mha NHD"), " ", c10::toString(c10::ScalarType(dtype)), " [", shape,
             "] tp ", tp_rank, "/", tp_size, " of ", total_kv_heads, " heads");
}

void KVLayoutDesc::check_pool(const at::Tensor& t, const std::string& what) const {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.sizes().vec() == pool_shape() && int64_t(t.scalar_type()) == dtype &&
                        t.is_contiguous(),
                    what, " must be a contiguous CPU pool of ", describe(), ", got ", t.scalar_type(), " ", t.sizes(),
                    t.is_contiguous() ? "" : " (not contiguous)", " on ", t.device());
}

void check_compatible(const KVLayoutDesc& src, const KVLayoutDesc& dst) {
  auto same = [](const char* name, int64_t a, int64_t b) {
    TORCH_CHECK_VALUE(a == b, "incompatible KV layouts: source ", name, "=", a, ", destination ", name, "=", b);
  };
  TORCH_CHECK_VALUE(src.mla == dst.mla, "incompatible KV layouts: source kind=", src.mla ? "mla" : "mha",
                    ", destination kind=", dst.mla ? "mla" : "mha");
  same("num_layers", src.num_layers, dst.num_layers);
  same("head_dim", src.head_dim, dst.head_dim);
  same("total_kv_heads", src.total_kv_heads, dst.total_kv_heads);
  TORCH_CHECK_VALUE(src.dtype == dst.dtype, "incompatible KV layouts: source dtype=",
                    c10::toString(c10::ScalarType(src.dtype)), ", destination dtype=",
                    c10::toString(c10::ScalarType(dst.dtype)), " (no casts inside the copy)");
}

std::vector<kernels::KVHeadPiece> plan_pieces(const KVLayoutDesc& src, const KVLayoutDesc& dst) {
  check_compatible(src, dst);
  std::vector<kernels::KVHeadPiece> pieces;
  const int64_t k = src.replication(), d0 = dst.first_head(dst.tp_rank);
  int64_t last_j = -2;
  for (int64_t j = 0; j < dst.num_kv_heads; ++j) {
    const int64_t g = d0 + j;
    const int64_t s = k == 1 ? g / src.num_kv_heads : g * k + dst.tp_rank % k;
    if (s != src.tp_rank) continue;
    const int64_t lo = g - src.first_head(s);
    if (last_j == j - 1 && pieces.back().src_head + pieces.back().heads == lo) {
      ++pieces.back().heads;
    } else {
      pieces.push_back({lo, j, 1});
    }
    last_j = j;
  }
  return pieces;
}

}  // namespace cam::kv
