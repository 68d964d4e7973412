// KV block copy with layout conversion: the data path of KV-cache transfer (docs/kv.md).
//
// A pool (one layer of one rank) is [C, num_blocks, block_size, heads, head_dim] in "NHD" order
// or [C, num_blocks, heads, block_size, head_dim] in "HND" order (C = 2 for K/V, 1 for MLA's
// latent, which has one head). A copy moves, for every token run (a stretch of consecutive
// tokens inside one source block and one destination block) and every head piece (a range of
// the source's heads landing at a range of the destination's heads), all C planes. Orders may
// differ on the two sides; element sizes may not (no casts here). Copies are memcpy runs as long
// as memory allows: a whole run when the piece spans every head of two NHD sides, a head's
// tokens when both are HND, one head_dim vector per (token, head) otherwise.
#pragma once

#include <cstdint>

namespace cam::kernels {

struct KVPoolSide {
  char* base;            // the layer's pool
  int64_t planes;        // C: 2 (K, V) or 1 (MLA)
  int64_t num_blocks;
  int64_t block_size;
  int64_t heads;
  int64_t head_bytes;    // head_dim * element size
  bool hnd;              // heads before tokens inside a block
  // Byte offset of (plane, block, slot, head).
  int64_t offset(int64_t c, int64_t blk, int64_t slot, int64_t h) const {
    const int64_t block = (c * num_blocks + blk) * block_size * heads;
    return (block + (hnd ? h * block_size + slot : slot * heads + h)) * head_bytes;
  }
};

struct KVRun {
  int64_t src_block, src_slot, dst_block, dst_slot, tokens;
};
struct KVHeadPiece {
  int64_t src_head, dst_head, heads;
};

// Copies every (run, piece) pair from src to dst. Bounds are the caller's to check.
void kv_copy(const KVPoolSide& src, const KVPoolSide& dst, const KVRun* runs, int64_t nruns,
             const KVHeadPiece* pieces, int64_t npieces);

}  // namespace cam::kernels
