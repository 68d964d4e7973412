// One request's KV copy between two pools, checked and planned before any byte moves: block
// ids and layers bounds-checked (IndexError naming the first bad one), enough blocks for the
// tokens and no destination block written twice (ValueError), the TP head plan, and the token
// runs (stretches of tokens inside one source and one destination block). The plan knows
// nothing of ranks or transports: copy_layer() runs it between any two mapped pools.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_layout.hpp"

namespace cam::kv {

struct BlockIds {
  const int64_t* data;
  int64_t size;
};

class KVCopyPlan {
 public:
  // layers: empty means all. Throws c10::IndexError / c10::ValueError before anything moves.
  KVCopyPlan(const KVLayoutDesc& src, BlockIds src_ids, const KVLayoutDesc& dst, BlockIds dst_ids,
             int64_t num_tokens, std::vector<int64_t> layers, bool all_layers);

  // Copies layer `layer`'s share of the request from the pool at src_base to the one at dst_base.
  // Returns the bytes copied.
  int64_t copy_layer(char* src_base, char* dst_base) const;
  // The same copy as contiguous moves, move(dst, src, bytes), for a transport that moves bytes
  // itself; a base may be a peer's address (never dereferenced here). Returns the bytes.
  template <class Move>
  int64_t layer_moves(char* src_base, char* dst_base, Move&& move) const {
    if (runs_.empty()) return 0;
    kernels::kv_copy_moves(src_.side(src_base), dst_.side(dst_base), runs_.data(), int64_t(runs_.size()),
                           pieces_.data(), int64_t(pieces_.size()), move);
    return layer_bytes_;
  }

  const std::vector<int64_t>& layers() const { return layers_; }
  const std::vector<int64_t>& dst_blocks() const { return dst_blocks_; }  // the ones written
  int64_t layer_bytes() const { return layer_bytes_; }

 private:
  KVLayoutDesc src_, dst_;
  std::vector<int64_t> layers_;
  std::vector<int64_t> dst_blocks_;
  std::vector<kernels::KVRun> runs_;
  std::vector<kernels::KVHeadPiece> pieces_;
  int64_t layer_bytes_ = 0;
};

}  // namespace cam::kv
