// CollectiveOp: the part every collective shares.
//
// Phase 1 (descriptor exchange): each rank publishes what it is about to do (op, root, dtype,
// sizes, splits) in its window and reads everyone else's. Every rank validates the whole set,
// so a mismatch fails on all ranks alike, before any byte moves, and the group stays usable.
// Phase 1 is also the reuse guard of the staging region: a rank publishes descriptor n only
// after finishing collective n-1, so once all descriptors of n are visible nobody still reads
// a staging slot of n-1. (A barrier is exactly phase 1.)
// Phase 2 (data): the subclass's data_step().
#pragma once

#include "op.hpp"

namespace cam {

enum class CollKind : int32_t {
  kBarrier = 1,
  kBroadcast,
  kAllToAll,
  kAllReduce,
  kReduce,
  kAllGather,
  kGather,
  kReduceScatter,
  kScatter,
  kMoeDispatch,
  kMoeCombine,
};
const char* coll_kind_name(CollKind k);
// The kind named `name` (as coll_kind_name spells it); throws ValueError for any other name.
CollKind coll_kind_of(const std::string& name);

// all_gather runs as staged rounds when every output has the input's size and over the
// all-to-all channels otherwise; ranks that disagree learn it from the descriptors' algo field
// (0 for all-to-all).
std::string uneven_all_gather_mismatch(int uneven_rank, bool this_rank_uneven);

class CollectiveOp : public Op {
 public:
  CollectiveOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline)
      : Op(name, seq, deadline), kind_(kind) {}
  Family family() const override { return Family::kCollective; }
  bool step(Context& ctx) override;

 protected:
  // Fill the op-specific fields of this rank's descriptor (the slot is already zeroed).
  virtual void fill_desc(Context& ctx, CollDesc* d) = 0;
  // Check all descriptors (descs[r] is rank r's); throw ValidationError on a mismatch.
  virtual void validate(Context& ctx, const std::vector<const CollDesc*>& descs) = 0;
  // Move data; return whether anything moved; call mark_done() at the end.
  virtual bool data_step(Context& ctx) = 0;
  // Throws ValidationError with this op's prefix.
  [[noreturn]] void refuse(Context& ctx, const std::string& what) const;
  // Phase 1, first half: zero this rank's slot, fill it, release its sequence number.
  void publish(Context& ctx);
  // Phase 1, second half, once every descriptor of this op is visible: a rank's refusal of its
  // own arguments first (every peer names it), then the op kind, then validate(). Refuses alike
  // on every rank.
  void check_descriptors(Context& ctx);
  // Refuses when rank r's descriptor is a refusal or names another collective.
  void check_peer_descriptor(Context& ctx, int r, const CollDesc* d) const;

  CollKind kind_;
  // When set, arrival_us_[p] becomes how long after publishing this rank first saw peer p's
  // descriptor (0 for itself): per-peer wait times, for slow-rank diagnosis.
  bool record_arrivals_ = false;
  std::vector<int64_t> arrival_us_;

 private:
  enum class Phase { kPublish, kExchange, kData } phase_ = Phase::kPublish;
  int next_peer_ = 0;
  Clock::time_point published_at_;
};

// What a rank issues in place of an op whose arguments its own checks refused: a descriptor
// that carries the reason, so every peer fails the op at once naming this rank (instead of
// waiting out the timeout for a descriptor that never comes), the sequence numbers of all
// ranks stay aligned, and the group stays usable.
class RefusedOp final : public CollectiveOp {
 public:
  RefusedOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, std::string reason)
      : CollectiveOp(name, kind, seq, deadline), reason_(std::move(reason)) {}

 protected:
  void fill_desc(Context& ctx, CollDesc* d) override;
  void validate(Context&, const std::vector<const CollDesc*>&) override {}
  bool data_step(Context&) override {
    mark_done();
    return true;
  }

 private:
  std::string reason_;
};

class BarrierOp final : public CollectiveOp {
 public:
  BarrierOp(uint64_t seq, Clock::time_point deadline)
      : CollectiveOp("barrier", CollKind::kBarrier, seq, deadline) {}

 protected:
  void fill_desc(Context&, CollDesc*) override {}
  void validate(Context&, const std::vector<const CollDesc*>&) override {}
  bool data_step(Context&) override {
    mark_done();
    return true;
  }
};

// What a monitored_barrier that timed out on `rank` waited for, in gloo's words too (tools and
// tests match on them): on rank 0 the ranks still `missing` (the first one unless
// wait_all_ranks), on the others rank 0's release. Shared by every group kind's barrier.
std::string monitored_barrier_waiting_for(int rank, const std::vector<int>& missing, bool wait_all_ranks,
                                          int64_t timeout_ms);

// monitored_barrier, arranged as gloo's: rank 0 waits for every rank's descriptor, then
// releases the others (its produced[r] counters, unused by a barrier's data). A timeout on
// rank 0 names the first rank that has not arrived (every one with wait_all_ranks); on the
// others it says that rank 0 did not release them.
class MonitoredBarrierOp final : public CollectiveOp {
 public:
  MonitoredBarrierOp(uint64_t seq, Clock::time_point deadline, bool wait_all_ranks)
      : CollectiveOp("monitored_barrier", CollKind::kBarrier, seq, deadline), wait_all_(wait_all_ranks) {}
  bool step(Context& ctx) override;
  std::string waiting_for() const override;

 protected:
  void fill_desc(Context&, CollDesc*) override {}
  void validate(Context&, const std::vector<const CollDesc*>&) override {}
  bool data_step(Context&) override { return false; }

 private:
  bool wait_all_;
  bool published_ = false;
  int my_rank_ = -1;
  std::vector<int> missing_;  // rank 0: who has not arrived yet
};

// Reads straight out of a peer's memory (in place from its heap, or by syscall) are issued in
// pieces of this size: large enough to amortize a syscall, small enough to interleave several
// peers, and p2p traffic, within one progress pass.
constexpr int64_t kDirectPieceBytes = 4ll << 20;

// Broadcast: the root copies its tensor once into a ring of slots in its own staging region;
// every other rank copies each slot out as soon as it is signalled. The root reuses a slot
// only after every reader has released it, so any size streams through a bounded window. A
// heap-resident root tensor skips the ring: receivers copy it in place and then signal. A
// tensor that fits the eager area rides there instead (CollectiveWindow::eager): receivers
// copy it out and nobody signals back.
class BroadcastOp final : public CollectiveOp {
 public:
  BroadcastOp(uint64_t seq, Clock::time_point deadline, int root, bool is_root, at::Tensor tensor);
  void finalize() override;
  int trace_peer() const override { return root_; }

 protected:
  void fill_desc(Context& ctx, CollDesc* d) override;
  void validate(Context& ctx, const std::vector<const CollDesc*>& descs) override;
  bool data_step(Context& ctx) override;

 private:
  // A heap-resident root tensor: every receiver copies it in place, one copy per byte.
  bool in_place_step(Context& ctx);
  bool eager_step(Context& ctx);
  int root_;
  bool eager_ = false;
  at::Tensor user_, buf_;  // buf_ is contiguous (user_ itself when it already is)
  int64_t nbytes_, slot_bytes_ = 0, nslots_ = 0, nchunks_ = 0;
  int64_t next_chunk_ = 0;  // staged: chunks moved; in place: bytes copied
  int64_t root_heap_off_ = -1;
};

// All-to-all over per-pair channels: rank i's staging region is split into one ring per
// destination; i streams its block for j into ring j, j copies it straight into its output.
// Every pair pipelines independently; the local block is a direct copy. Two kinds of block skip
// the ring: those of a sender whose input is a heap-resident tensor (the receiver copies them
// in place out of the sender's arena), and those large enough for the receiver's single-copy
// threshold (read out of the sender's address space by syscall). Either way the receiver then
// signals the sender, which keeps its tensor untouched until every such reader is done. A
// sender whose blocks for its peers fit the eager area together packs them there, in rank
// order, before publishing (CollectiveWindow::eager): receivers copy theirs out, and nothing
// is signalled back.
struct AllToAllBlock {
  char* ptr = nullptr;
  int64_t nbytes = 0;
};

class AllToAllOp final : public CollectiveOp {
 public:
  // send[j]/recv[j]: this rank's block for/from rank j. keep_alive holds the tensors the
  // blocks point into; copy_back (dst, src) pairs run on success.
  AllToAllOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, int dtype,
             std::vector<AllToAllBlock> send, std::vector<AllToAllBlock> recv,
             std::vector<at::Tensor> keep_alive,
             std::vector<std::pair<at::Tensor, at::Tensor>> copy_back,
             std::vector<at::Tensor> outputs);
  void finalize() override;

 protected:
  void fill_desc(Context& ctx, CollDesc* d) override;
  void validate(Context& ctx, const std::vector<const CollDesc*>& descs) override;
  bool data_step(Context& ctx) override;

 private:
  int dtype_;
  std::vector<AllToAllBlock> send_, recv_;
  std::vector<at::Tensor> keep_alive_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back_;
  std::vector<int64_t> sent_, received_;  // chunks per peer (a direct block counts as one)
  std::vector<int64_t> nsend_, nrecv_;     // chunks to move per peer
  // How each block moves: staged through the ring, read by syscall, read in place, or copied
  // out of the sender's eager area.
  enum : char { kStaged = 0, kDirectSyscall = 1, kDirectHeap = 2, kEager = 3 };
  std::vector<char> direct_send_, direct_recv_;
  std::vector<uint64_t> src_addr_;         // where rank i keeps its block for this rank (eager:
                                           // its offset in i's eager area)
  std::vector<int64_t> direct_done_;       // bytes read so far per direct source
  int64_t region_bytes_ = 0, slot_bytes_ = 0, nslots_ = 0;
  bool local_done_ = false;
};

}  // namespace cam
