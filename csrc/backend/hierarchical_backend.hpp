// HierarchicalBackend: the "cam" backend of a group whose ranks span hosts (host_key()).
//
// The ranks of one host form an inner CamBackend over their shared-memory heap. Between hosts
// the ops run over c10d backends that the Python creator makes on the group's store (OneSidedBackend
// where the build has UCX; torch's gloo, the fallback that needs nothing installed, otherwise
// and for point-to-point):
//   all     every rank of the group (gloo; null when collectives and p2p are given)
//   collectives  every rank of the group: gather, scatter, all_to_all (null: `all`)
//   p2p     every rank of the group: point-to-point to other hosts (UcxP2PBackend; null: `all`)
//   rail    the ranks of one local index on every host, when every host has as many ranks
//   leaders local index 0 of every host (rail 0 when hosts are uniform, its own group otherwise)
// Collectives are compositions of inner and inter-host steps (hierarchical_collectives.cpp
// states each), run in issue order, one at a time; the Work completes after the last step. A
// caller that waits on its op runs the queue up to it on its own thread (drive_until); a worker
// thread runs the ops nobody waits on (found by its polls, as the local engine's progress
// thread finds them) and, between ops, serves the one-sided engines (their sends still in
// flight, peers' operations on this rank's memory). Point-to-point goes straight to the inner
// backend (same host) or to `p2p`.
//
// Results are bit-identical on every rank: each output element is computed on one rank and
// copied to the others. Reduction order: cam's order over a host's ranks, then the inter-host
// engine's order over the hosts' partial sums.
//
// Failure: a step that fails fails the group. The inner engine publishes the cause (ranks of
// this host raise within one liveness interval) and a key in the group's store names it (ranks
// of other hosts, waiting on an inter-host step, read it every liveness interval and raise);
// every later op raises at once. Every step has the group's deadline (cam's own; the inter-host
// backends are made with the group's timeout).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <poll.h>
#include <thread>

#include "../core/recycling_pool.hpp"
#include "cam_backend.hpp"

namespace cam {

class OneSidedBackend;

// Which host each rank of the group is on; hosts are numbered by their lowest rank, and a
// host's ranks by rank (their local index).
struct HostMap {
  std::vector<int> host_of;              // group rank -> host index
  std::vector<int> local_of;             // group rank -> local index on its host
  std::vector<std::vector<int>> ranks;   // host index -> its group ranks, ascending
  std::vector<std::string> names;        // host index -> hostname, for messages

  static HostMap from_keys(const std::vector<std::string>& keys, const std::vector<std::string>& hostnames);
  int hosts() const { return int(ranks.size()); }
  int max_local() const;
  bool uniform() const;  // every host has as many ranks
  bool in_rank_order() const;  // uniform, and host h's ranks are h*L .. h*L+L-1
};

class HierarchicalBackend : public c10d::Backend {
 public:
  struct InterHost {
    c10::intrusive_ptr<c10d::Backend> all;      // every rank
    c10::intrusive_ptr<c10d::Backend> collectives;  // every rank; null: all
    c10::intrusive_ptr<c10d::Backend> rail;     // uniform hosts only; else null
    c10::intrusive_ptr<c10d::Backend> leaders;  // on local index 0 only; else null
    c10::intrusive_ptr<c10d::Backend> p2p;      // every rank: point-to-point to other hosts; null: all
  };
  HierarchicalBackend(int rank, int size, HostMap map, c10::intrusive_ptr<CamBackend> local, InterHost inter,
                      c10::intrusive_ptr<c10d::Store> store, std::string group_desc);
  ~HierarchicalBackend() override;

  const std::string getBackendName() const override { return "cam"; }
  const HostMap& host_map() const { return map_; }
  // This rank's host: its ranks' own cam backend (their heap, their engine).
  const c10::intrusive_ptr<CamBackend>& local() const { return local_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  // The engine of the inter-host collectives ("cam-ucx" or "gloo").
  std::string inter_host_engine() const { return inter_.collectives->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& output_lists,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // As gloo's: rank 0 names the first rank that did not arrive within the timeout (every such
  // rank with wait_all_ranks), the others that rank 0 did not release them.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // For an extension that composes its own exchange from this group's parts (MoE's two-hop
  // dispatch): run() executes body on the worker, in issue order with the group's collectives,
  // as one op called `name` (a failure fails the group, as any op's does), and returns when it
  // is done. Inside a body, host_alltoall is an all_to_all_single on this host's cam group
  // (splits by local index) and rail_alltoall one on this rank's rail (splits by host; uniform
  // hosts only).
  using Body = std::function<void()>;
  void run(const std::string& name, Body body);
  void host_alltoall(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits, std::vector<int64_t> in_splits);
  void rail_alltoall(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits, std::vector<int64_t> in_splits);

  // Called by a Work's wait(): when no thread drives the queue and op `seq` has not started, the
  // caller runs the queue up to it itself instead of handing it to the worker and waiting to be
  // woken (two thread hand-offs per op; with more ranks than cores each costs a turn on a core).
  // Returns without running anything when the op is already taken, or at `deadline` (null:
  // none of the caller's own; each step still has the group's).
  void drive_until(uint64_t seq, const std::chrono::steady_clock::time_point* deadline);

  // dist._coalescing_manager with a device (DeepSpeed's ZeRO-3): the ops issued between start
  // and end run as usual (all_reduce, all_gather and reduce_scatter blocks arrive as one
  // coalesced op, the others one by one); endCoalescing's Work completes with all of them.
  // supportsCoalescing stays false, so batch_isend_irecv keeps issuing its ops one by one.
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;
  void shutdown() override;
  void abort() override { shutdown(); }

 private:
  // Queues body on the worker; the Work's result is `outputs`.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::string name, std::vector<at::Tensor> outputs,
                                         Body body);
  // Notes w in the open coalescing block, if any; returns it.
  c10::intrusive_ptr<c10d::Work> noted(c10::intrusive_ptr<c10d::Work> w);
  void worker_main();
  // The idle worker's wait when one-sided engines need serving between ops: serves each, then
  // sleeps until one has traffic, a ring (wake_fd_) or `bound`. Called and returns with `lk`
  // (on mu_) held.
  void serve_between_ops(std::unique_lock<std::mutex>& lk, std::chrono::milliseconds bound);
  static constexpr int kMissedWakePollMs = 100;  // the parked worker's poll bound with an eventfd
  static constexpr int kUnrungPollMs = 1;        // and without one (nothing rings it)
  void fail_group(const std::string& why);
  // Waits for a step: inner steps raise through cam's own waits; inter-host steps block on their
  // Future and wake every liveness interval, so that a failure another host published in the
  // store ends the wait.
  void local_step(const c10::intrusive_ptr<c10d::Work>& w) const;
  void inter_step(const c10::intrusive_ptr<c10d::Work>& w) const;
  // The failure a rank published in the store ("" while there is none), and a throw of it.
  std::string published_failure() const;
  void raise_published() const;

  // The compositions (hierarchical_collectives.cpp). Tensors are contiguous.
  void allreduce_one(at::Tensor t, c10d::ReduceOp op);
  void reduce_one(at::Tensor t, int root, c10d::ReduceOp op);
  void broadcast_one(at::Tensor t, int root);
  void gather_rows(const at::Tensor& input, at::Tensor out_rows);           // out_rows: [size, n]
  // by_host (H equal blocks) gets every host's `mine` over `hosts`, a group of one rank per host.
  void exchange_blocks(c10d::Backend& hosts, const at::Tensor& mine, at::Tensor by_host);
  void reduce_scatter_rows(const at::Tensor& in_rows, at::Tensor out, c10d::ReduceOp op);
  // all_to_all between hosts of equal size, more than one rank each, in two hops: a rank's
  // blocks for rank l of every host go to this host's rank l (over the host's cam group),
  // which sends rank l of host h, over rail l, every local rank's block for it in one message.
  // `send` / `recv`: this rank's block for / from each group rank, as bytes.
  bool alltoall_in_two_hops() const;
  void alltoall_two_hops(const std::vector<at::Tensor>& send, const std::vector<at::Tensor>& recv, const char* what);
  void barrier_all();
  // Arrivals and the release travel through the group's store (a debugging op: no data, and
  // a rank that never comes leaves nothing posted in any engine).
  void monitored_barrier_all(std::chrono::milliseconds timeout, bool wait_all_ranks);
  // An all_gather / reduce_scatter list (one tensor per rank, `role` "output" or "input"):
  // every tensor of `mine`'s dtype and this rank's of its size. Sets `sizes` and returns the
  // block every rank's tensor is padded to (the largest); when the sizes differ, every rank's
  // list is first compared with this rank's (check_same_sizes).
  int64_t list_blocks(const std::vector<at::Tensor>& list, const at::Tensor& mine, const char* role, const char* other,
                      const char* what, std::vector<int64_t>& sizes);
  // Every rank's `sizes` (one per rank of the group: an uneven list's block sizes), checked
  // equal to this rank's: padded ops would otherwise mix up blocks silently.
  void check_same_sizes(const std::vector<int64_t>& sizes, const char* what);
  // One tensor's op from the user's arguments: checks, contiguity, AVG, the copy back.
  void allreduce_tensor(const at::Tensor& t, const c10d::ReduceOp& op, const char* name);
  void allgather_tensor(const at::Tensor& out, const at::Tensor& in);
  void reduce_scatter_tensor(const at::Tensor& out, const at::Tensor& in, const c10d::ReduceOp& op,
                             const char* name);
  // AVG runs as SUM and divides at the end (the inter-host engine has no AVG); PREMUL_SUM and
  // AVG of integers are refused. Returns the op to run.
  c10d::ReduceOp reduction(const c10d::ReduceOp& op, const at::Tensor& t, const char* name) const;
  // A buffer for a composition's intermediate rows, from scratch_ (contents undefined).
  at::Tensor scratch(int64_t numel, const at::TensorOptions& options) const {
    return scratch_->empty({numel}, options.dtype().toScalarType());
  }
  bool leader() const { return map_.local_of[rank_] == 0; }
  int my_host() const { return map_.host_of[rank_]; }
  int local_size() const { return int(map_.ranks[my_host()].size()); }

  HostMap map_;
  c10::intrusive_ptr<CamBackend> local_;
  InterHost inter_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string group_desc_;
  // The compositions' intermediate buffers, recycled: a large all_gather's would otherwise
  // page-fault all of its fresh memory every call (more than the copy itself).
  std::shared_ptr<RecyclingPool> scratch_;

  struct Task {
    uint64_t seq;
    std::string name;
    Body body;
    std::function<void(std::exception_ptr)> finish;
  };
  void run_task(Task& task);  // on the driving thread
  std::mutex mu_;
  std::condition_variable idle_cv_;   // the idle worker without engines to serve: enqueue rings it parked
  std::condition_variable drive_cv_;  // driving_ went false
  std::deque<Task> queue_;
  bool stop_ = false;
  uint64_t seq_ = 0;
  // A coalescing block is open (written under coalescing_mu_, read without it first by every
  // op), and the Works issued in it (under coalescing_mu_).
  std::mutex coalescing_mu_;
  std::atomic<bool> coalescing_{false};
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
  uint64_t monitored_seq_ = 0;  // the driving thread only
  // (under mu_) a thread runs tasks or serves the one-sided engines: the worker, or a caller in
  // drive_until. The engines are single-threaded, and tasks run in issue order.
  bool driving_ = false;
  std::string fatal_;  // the driving thread only
  std::thread worker_;
  std::once_flag shutdown_once_;
  std::vector<OneSidedBackend*> served_;  // the one-sided engines (owned by inter_)
  int wake_fd_ = -1;                      // an eventfd written by shutdown() and by enqueue() while the worker is parked
  bool worker_parked_ = false;            // (under mu_) the idle worker sleeps until rung (PollSchedule::park)
  std::chrono::steady_clock::time_point last_enqueue_;  // (under mu_)
  std::vector<pollfd> idle_fds_;          // wake_fd_ (where there is one), then each served engine's event fd
};

}  // namespace cam
