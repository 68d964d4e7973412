// CamBackend: the c10d::Backend registered as "cam". Each op checks its arguments on the
// calling thread, builds an algorithm op and hands it to the Engine; the returned CamWork
// completes when the op does. A check that fails raises on the calling thread and still takes
// part in the op as a refusal (OpIssuer::collective, p2p()), so the peers fail at once too.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <map>

#include "../algo/staged_rounds.hpp"
#include "../moe/moe_group.hpp"
#include "../runtime/cam_work.hpp"
#include "../runtime/engine.hpp"
#include "../runtime/op_issuer.hpp"

namespace cam {

// c10d's reduce op as a kernel op; PREMUL_SUM raises ArgumentError.
kernels::RedOp red_op_of(const c10d::ReduceOp& r);

// A tensor an op writes must not have elements that share memory (an expanded view): the
// copy back into it would fail after the data moved.
void check_writable(const at::Tensor& t, const char* what);

class CamBackend : public c10d::Backend {
 public:
  // group_id: the group's name (lookup); group_desc: how messages name it.
  CamBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, CamConfig cfg,
             std::string group_id, const std::string& group_desc);
  ~CamBackend() override;

  const std::string getBackendName() const override { return "cam"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  // Reductions and gathers (collectives.cpp).
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;

  // Coalescing (dist._coalescing_manager with a device): ops between start and end are issued
  // as usual (cam ops are asynchronous anyway); end returns one Work over all of them.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // Sequence numbers count collectives; every rank starts at 0 when the group is created.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;
  void shutdown() override;
  void abort() override { shutdown(); }

  std::string config_string() const { return engine_->config().to_string(); }
  const std::string& group_id() const { return group_id_; }
  int64_t timeout_ms() const { return engine_->config().timeout.count(); }
  int64_t window_bytes_mapped() const;
  bool direct_read_available() const { return engine_->heap().direct_read_available(); }
  std::string process_heap_problem() const { return engine_->heap().process_heap_problem(); }
  std::map<std::string, int64_t> stats() const;

  // Heap-resident tensors: allocated in this rank's tensor arena, read in place by peers.
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
  bool owns(const at::Tensor& t) const {
    return t.device().is_cpu() && t.numel() > 0 &&
           engine_->heap().arena()->offset_of(t.data_ptr(), int64_t(t.nbytes())) >= 0;
  }
  bool supportsTensorAlloc(c10::DeviceIndex) override { return true; }
  at::Tensor allocateTensor(long size, at::TensorOptions options) override;

  // One-sided access for extensions (KV transfer): rank r's tensor-arena bytes
  // [offset, offset + nbytes) as a uint8 tensor that keeps the mapping alive; the arena offset
  // of one of this rank's heap tensors (-1 if it is not one); why rank r is considered dead
  // (empty while alive).
  at::Tensor peer_arena_view(int r, int64_t offset, int64_t nbytes);
  int64_t arena_offset(const at::Tensor& t) const {
    return t.numel() == 0 ? -1 : engine_->heap().arena()->offset_of(t.data_ptr(), int64_t(t.nbytes()));
  }
  std::string peer_failure(int r) const { return engine_->heap().peer_failure(r); }
  // Waits until counters[index] >= target (an acquire load: what the writer stored before its
  // release is visible after), backing off by the group's wait policy (its sleep tier parked
  // until `peer` calls ring_parked_peers after storing) and asking every
  // liveness interval whether `peer` (the counter's writer) is still usable. Returns "" once
  // reached, "timeout" after timeout_s, or Engine::peer_problem's answer. For extensions'
  // control blocks in heap tensors (AFD); `counters` is int64, contiguous.
  std::string wait_signal(int peer, const at::Tensor& counters, int64_t index, int64_t target,
                          double timeout_s) const;
  // After storing extension signals: wakes the peers parked in wait_signal (or in ops) on them.
  void ring_parked_peers() const { engine_->heap().ring_parked_peers(); }
  // The group's engine, for extensions that run their own ops on it (KV transfer).
  const std::shared_ptr<Engine>& engine() const { return engine_; }

  // For front ends that check their own arguments (MoE in Python): this rank's next
  // collective, of the named kind ("moe_dispatch", ...), is a refusal under `op`'s name.
  [[noreturn]] void refuse(const std::string& kind, const std::string& op, const std::string& reason) {
    issuer_->refuse(kind, op, reason);
  }
  // MoE expert-parallel dispatch / combine over this group (csrc/moe/moe_group.hpp).
  MoeGroup& moe() { return *moe_; }

 private:
  // At log level info: what the group chose (transport, sizes, thresholds, wait policy).
  void log_init(int ncpus) const;
  const at::Tensor& single_tensor(std::vector<at::Tensor>& tensors) const;
  void check_tensor(const at::Tensor& t, const char* what = "tensor") const;
  void check_peer(int peer, const char* role) const;
  // p2p peers: out of range or this rank raises here only (no partner to tell).
  void check_p2p_peer(const char* op, int peer, const char* role) const;
  template <typename Build>
  c10::intrusive_ptr<c10d::Work> p2p(bool is_send, int peer, int tag, Build build);
  uint64_t next_recv_seq();
  void check_same_dtype(const std::vector<at::Tensor>& ts, c10::ScalarType dtype, const char* what,
                        bool written = false) const;
  // Coalesced (outputs[i], inputs[i]) pairs of one dtype; returns it.
  c10::ScalarType check_coalesced(const std::vector<at::Tensor>& outputs,
                                  const std::vector<at::Tensor>& inputs) const;
  // One list holding one tensor per rank (all_gather outputs, scatter inputs, ...).
  void check_rank_list(const std::vector<std::vector<at::Tensor>>& lists,
                       const char* what) const;
  void check_numel(const at::Tensor& t, int64_t expected, const std::string& what) const;
  kernels::RedOp reduction(const c10d::ReduceOp& r, c10::ScalarType dtype) const;
  StagedAlgo choose_allreduce(int64_t nbytes) const;
  c10::intrusive_ptr<c10d::Work> launch_staged(const char* op, CollKind kind, StagedRoundsArgs args,
                                               std::chrono::milliseconds timeout,
                                               c10d::OpType type, const char* title,
                                               std::vector<at::Tensor> inputs);

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<OpIssuer> issuer_;
  std::unique_ptr<MoeGroup> moe_;
  std::string group_id_;
  std::atomic<uint64_t> recv_seq_{0};
};

}  // namespace cam
