// OneSidedBackend: the inter-host engine of a group that spans hosts, written against
// OneSidedTransport's operations (UcxTransport between hosts; LoopbackTransport in tests): the
// HierarchicalBackend's rail, leaders and all-ranks collectives. gloo remains the engine where
// this build has no UCX, and for point-to-point.
//
// Every collective is built on one exchange: each rank registers what it sends, puts a
// descriptor (address, length, rkey) into each reader's control slot and announces it with an
// atomic add; each reader gets the bytes straight into its output (one copy, no staging) and
// adds one to the sender's done counter; an exchange ends when every reader of this rank is done.
// Blocks up to kEagerBytes travel inside the descriptor instead (one put, no get: a round trip
// less for small messages).
//   broadcast     the root's tensor read by every rank
//   all_to_all    block p read by rank p (the own block copied locally); list forms flattened
//   all_gather    every rank's input read by every rank into its row of the output
//   reduce_scatter  rank p reads block p of every input and reduces them in rank order
//   gather/scatter  the root reads every block / every rank reads its block from the root
//   barrier       an exchange of empty blocks
//   all_reduce    up to kOneShotMaxBytes: every rank reads every input and reduces them in rank
//                 order; above: reduce-scatter (rank p reduces shard p in rank order), then
//                 every rank reads every shard. Either way each element is reduced in rank
//                 order over the group's ranks: results are bit-identical on every rank.
//   reduce        the root reads every input and reduces in rank order
// Ops run synchronously on the calling thread (the HierarchicalBackend's worker) and return a
// completed Work: the inter-host step is the whole op.
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
  // What this rank lets peer p read (bytes from `base`, inside the registered send tensor) and
  // what it reads from peer p (into `dst`). `sends` / `recvs` hold one entry per rank; an entry
  // with present == false takes no part.
  struct Block {
    bool present = false;
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  void exchange(const std::string& what, const at::Tensor* send_region, const std::vector<Block>& sends,
                const std::vector<Block>& recvs);
  void allreduce_one(const at::Tensor& t, const c10d::ReduceOp& op);
  // Rank p reduces, in rank order, block p (elements off[p] .. off[p + 1]) of every rank's `in`
  // into `out`, which holds this rank's block's elements and may be that block itself.
  void reduce_blocks(const std::string& what, const at::Tensor& in, const std::vector<int64_t>& off,
                     const c10d::ReduceOp& op, void* out);
  std::string op_name(const char* op) const;
  int root_of(int64_t root, const char* op) const;  // raises unless root is a rank of the group

  std::unique_ptr<OneSidedTransport> t_;
  // Buffers peers' blocks are read into, recycled across ops (fresh ones page-fault every call).
  std::shared_ptr<RecyclingPool> scratch_ = std::make_shared<RecyclingPool>(512ll << 20);
  uint64_t seq_ = 0;
  std::vector<uint64_t> consumed_;  // descriptors read from each peer
  std::vector<uint64_t> readers_;   // exchanges in which each peer read this rank's memory
};

}  // namespace cam
