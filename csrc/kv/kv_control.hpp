// The KV control block: one per rank per KVTransfer, in the rank's tensor heap, mapped by every
// peer of the group, and never released (peers may still look at it). Layout (W = group size):
//
//   KVRegistration         written only by the owner (seqlock: version odd while rewritten)
//   SignalLine tails[W]    tails[p]: how far the owner has read the ring rank p writes
//   KVRing rings[W]        rings[p]: written only by rank p (its notifications to the owner)
//
// Memory ordering:
//  * registration (owner): version := odd (relaxed), release fence, fields, version := even
//    (release). A reader loads version (acquire), copies the fields, acquire fence, reloads
//    version: equal and even means the copy is whole.
//  * notification (sender p into the owner's rings[p]): wait until head - tails[p] < kSlots
//    (acquire: the owner is done with the slot), fill the slot, store fence (the transfer's
//    copies may have used non-temporal stores), head := head + 1 (release). The owner loads
//    head (acquire), reads the slots, then tails[p] := head (release) frees them.
// Every counter has one writer and only grows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../transport/signal.hpp"

namespace cam::kv {

constexpr int64_t kMaxLayers = 512;
constexpr int64_t kSlots = 64;
constexpr int64_t kIdBytes = 64;
constexpr int64_t kMessageBytes = 432;

struct KVRegistration {
  uint64_t version;  // 0: nothing registered
  int64_t fields[15];  // KVLayoutDesc's fields in declaration order, then zeros
  int64_t layer_offset[kMaxLayers];  // arena offset of each layer's pool
};

enum KVStatus : int64_t { kOk = 0, kFailed = 1 };
enum KVKind : int64_t { kPush = 0, kPull = 1 };

struct KVNoteSlot {
  int64_t seq;  // 1-based notification number, for checking
  int64_t status;
  int64_t kind;
  int64_t nbytes;
  int64_t id_len;
  int64_t message_len;
  char id[kIdBytes];
  char message[kMessageBytes];
};
static_assert(sizeof(KVNoteSlot) == 544);

struct KVRing {
  SignalLine head;  // notifications posted so far
  KVNoteSlot slots[kSlots];
};

struct KVControlLayout {
  int64_t world;
  static constexpr int64_t tails_at() { return (sizeof(KVRegistration) + 63) / 64 * 64; }
  int64_t rings_at() const { return tails_at() + world * int64_t(sizeof(SignalLine)); }
  int64_t bytes() const { return rings_at() + world * int64_t(sizeof(KVRing)); }

  static KVRegistration* registration(char* block) { return reinterpret_cast<KVRegistration*>(block); }
  SignalLine* tail(char* block, int p) const { return reinterpret_cast<SignalLine*>(block + tails_at()) + p; }
  KVRing* ring(char* block, int p) const { return reinterpret_cast<KVRing*>(block + rings_at()) + p; }

  // Byte offsets inside a block, for peers that reach it through a transport (kv_peer.hpp).
  static constexpr int64_t version_at() { return int64_t(offsetof(KVRegistration, version)); }
  int64_t tail_at(int p) const { return tails_at() + p * int64_t(sizeof(SignalLine)); }
  int64_t head_at(int p) const { return rings_at() + p * int64_t(sizeof(KVRing)) + int64_t(offsetof(KVRing, head)); }
  int64_t slot_at(int p, int64_t i) const {
    return rings_at() + p * int64_t(sizeof(KVRing)) + int64_t(offsetof(KVRing, slots)) +
           i * int64_t(sizeof(KVNoteSlot));
  }
};

}  // namespace cam::kv
