// OneSidedBackend: the inter-host engine of a group that spans hosts, written against
// OneSidedTransport's operations (UcxTransport between hosts; LoopbackTransport in tests): the
// HierarchicalBackend's rail, leaders and all-ranks collectives. gloo remains the engine where
// this build has no UCX, and for point-to-point.
//
// Every collective is built on one exchange between partners (ranks that send each other a block
// in either direction): each rank posts each partner a descriptor (the size of the block it
// sends, the size it expects back, the blocks' dtype and reduction, and where in its registered
// memory that block goes; blocks up to kEagerBytes travel inside the descriptor: one message, no
// registration), checks the partner's against its own view (so both sides name a mismatch),
// puts a larger block straight into the partner's output (one copy, no staging); once every partner's descriptor has passed it
// adds one to each partner's done counter, ordered after its puts; an exchange ends when every
// partner is done (so a mismatch anywhere fails every rank of the exchange). Where no block is
// put and every rank sees every mismatch anyway (two ranks alone; a uniform exchange: everyone's
// partner, one block size) done is skipped: an exchange of small blocks is one message each way.
// Puts, not gets: over a stream transport (UCX over TCP) a get's request travels behind whatever
// data the same connection already carries the other way, so two ranks reading each other took
// turns (16 MiB each way between two hosts at 1 Gbit/s: 278 ms instead of 140). A put's data
// follows the descriptor on the writer's own stream.
//   broadcast     the root's tensor put to every rank
//   all_to_all    block p put to rank p (the own block copied locally); list forms flattened
//   all_gather    every rank's input put to every rank, into its row of the output
//   reduce_scatter  block p of every input put to rank p, which reduces them in rank order
//   gather/scatter  every block put to the root / the root puts each rank its block
//   barrier       an exchange of empty blocks
//   all_reduce    up to kOneShotMaxBytes: every input put to every rank, which reduces them in
//                 rank order; above: reduce-scatter (rank p reduces shard p in rank order), then
//                 every shard put to every rank. Either way each element is reduced in rank
//                 order over the group's ranks: results are bit-identical on every rank.
//   reduce        every input put to the root, which reduces in rank order
// Ops run synchronously on the calling thread (the HierarchicalBackend's driving thread) and
// return a completed Work: the inter-host step is the whole op.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <memory>

#include "../core/recycling_pool.hpp"
#include "../transport/one_sided.hpp"

namespace cam {

class OneSidedBackend : public c10d::Backend {
 public:
  static constexpr int64_t kOneShotMaxBytes = 64 << 10;
  static constexpr size_t kEagerBytes = 16 << 10;

  explicit OneSidedBackend(std::unique_ptr<OneSidedTransport> transport);

  // "cam-ucx" or "cam-loopback".
  const std::string getBackendName() const override { return "cam-" + t_->name(); }
  void set_interrupt(std::function<void()> hook) { t_->set_interrupt(std::move(hook)); }
  // Serving between ops (OneSidedTransport's contract): the owner's thread, idle, calls
  // drain_and_arm() and sleeps on event_fd() until it is readable. An exchange ends when this
  // rank has every partner's block, not when its own have left: their tail moves as it serves.
  int event_fd() const { return t_->event_fd(); }
  bool drain_and_arm() { return t_->drain_and_arm(); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

 private:
  // What this rank sends peer p and where peer p's block goes. `sends` / `recvs` hold one entry
  // per rank; an entry with present == false takes no part.
  struct Block {
    bool present = false;
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  // `kind`: what the blocks hold (their dtype, and a reduction's operator), compared between
  // partners like the sizes; 0: not compared (barrier).
  void exchange(const std::string& what, const std::vector<Block>& sends, const std::vector<Block>& recvs,
                uint32_t kind = 0);
  void allreduce_one(const at::Tensor& t, const c10d::ReduceOp& op);
  // Rank p reduces, in rank order, block p (elements off[p] .. off[p + 1]) of every rank's `in`
  // into `out`, which holds this rank's block's elements and may be that block itself.
  void reduce_blocks(const std::string& what, const at::Tensor& in, const std::vector<int64_t>& off,
                     const c10d::ReduceOp& op, void* out);
  std::string op_name(const char* op) const;
  int root_of(int64_t root, const char* op) const;  // raises unless root is a rank of the group

  std::unique_ptr<OneSidedTransport> t_;
  // Buffers peers' blocks are put into, recycled across ops (fresh ones page-fault every call).
  std::shared_ptr<RecyclingPool> scratch_ = std::make_shared<RecyclingPool>(512ll << 20);
  uint64_t seq_ = 0;
  std::vector<uint64_t> consumed_;   // descriptors read from each peer
  std::vector<uint64_t> dones_due_;  // the dones each peer owes this rank, over all exchanges
};

}  // namespace cam
