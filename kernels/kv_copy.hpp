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

#include <cstddef>
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

// The same copy as a sequence of contiguous moves, move(dst, src, bytes), in kv_copy's order and
// granularity: for a transport that moves the bytes itself (a put or get per move), where one
// side's base is a peer's address that is never dereferenced here.
template <class Move>
void kv_copy_moves(const KVPoolSide& src, const KVPoolSide& dst, const KVRun* runs, int64_t nruns,
                   const KVHeadPiece* pieces, int64_t npieces, Move&& move) {
  const int64_t hb = src.head_bytes;
  if (npieces == 1 && !src.hnd && !dst.hnd && pieces[0].heads == src.heads && pieces[0].heads == dst.heads) {
    // Every head of two NHD sides: a run is one range on each side, and consecutive runs that
    // continue both ranges merge into one move.
    const int64_t token_bytes = src.heads * hb;
    for (int64_t c = 0; c < src.planes; ++c) {
      int64_t r = 0;
      while (r < nruns) {
        char* s = src.base + src.offset(c, runs[r].src_block, runs[r].src_slot, 0);
        char* d = dst.base + dst.offset(c, runs[r].dst_block, runs[r].dst_slot, 0);
        int64_t bytes = runs[r].tokens * token_bytes;
        for (++r; r < nruns; ++r) {
          if (src.base + src.offset(c, runs[r].src_block, runs[r].src_slot, 0) != s + bytes ||
              dst.base + dst.offset(c, runs[r].dst_block, runs[r].dst_slot, 0) != d + bytes) {
            break;
          }
          bytes += runs[r].tokens * token_bytes;
        }
        move(d, s, size_t(bytes));
      }
    }
    return;
  }
  for (int64_t c = 0; c < src.planes; ++c) {
    for (int64_t r = 0; r < nruns; ++r) {
      const KVRun& run = runs[r];
      for (int64_t p = 0; p < npieces; ++p) {
        const KVHeadPiece& pc = pieces[p];
        auto at_src = [&](int64_t t, int64_t h) {
          return src.base + src.offset(c, run.src_block, run.src_slot + t, pc.src_head + h);
        };
        auto at_dst = [&](int64_t t, int64_t h) {
          return dst.base + dst.offset(c, run.dst_block, run.dst_slot + t, pc.dst_head + h);
        };
        if (!src.hnd && !dst.hnd && pc.heads == src.heads && pc.heads == dst.heads) {
          move(at_dst(0, 0), at_src(0, 0), size_t(run.tokens * pc.heads * hb));  // whole run
        } else if (!src.hnd && !dst.hnd) {
          for (int64_t t = 0; t < run.tokens; ++t) {
            move(at_dst(t, 0), at_src(t, 0), size_t(pc.heads * hb));  // a token's heads
          }
        } else if (src.hnd && dst.hnd) {
          for (int64_t h = 0; h < pc.heads; ++h) {
            move(at_dst(0, h), at_src(0, h), size_t(run.tokens * hb));  // a head's tokens
          }
        } else {
          for (int64_t t = 0; t < run.tokens; ++t) {
            for (int64_t h = 0; h < pc.heads; ++h) move(at_dst(t, h), at_src(t, h), size_t(hb));
          }
        }
      }
    }
  }
}

}  // namespace cam::kernels
