#include "cam_backend.hpp"

#include <sched.h>

#include "../algo/collective.hpp"
#include "../algo/p2p.hpp"
#include "../transport/shm_heap.hpp"

namespace cam {

CamBackend::CamBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       CamConfig cfg, std::string group_id)
    : c10d::Backend(rank, size), group_id_(std::move(group_id)) {
  cfg.validate(size);
  // More ranks than usable CPUs: a rank that pause-spins may be holding the very core the
  // peer it waits for needs, so go straight to yielding.
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0 && size > CPU_COUNT(&cpus)) cfg.spin_us = 0;
  WindowLayout layout(size, cfg.p2p_ring_bytes(size), cfg.coll_region_bytes(size),
                      cfg.tensor_heap_bytes, cfg.eager_max_bytes);
  auto heap = std::make_unique<ShmHeap>(store, rank, size, layout, cfg.timeout);
  output_pool_ = std::make_shared<OutputPool>(cfg.moe_output_cache_bytes);
  engine_ = std::make_shared<Engine>(std::move(heap), std::move(cfg));
}

CamBackend::~CamBackend() { engine_->shutdown(); }

void CamBackend::shutdown() { engine_->shutdown(); }

uint64_t CamBackend::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lk(issue_mu_);
  return coll_seq_;
}

int64_t CamBackend::window_bytes_mapped() const {
  return int64_t(engine_->heap().layout().total_bytes()) * size_;
}

std::map<std::string, int64_t> CamBackend::stats() const {
  const Stats& s = engine_->stats();
  return {{"heap_bytes", window_bytes_mapped()},
          {"window_bytes", int64_t(engine_->heap().layout().total_bytes())},
          {"staged_bytes", int64_t(s.staged_bytes.load())},
          {"direct_read_bytes", int64_t(s.direct_read_bytes.load())},
          {"heap_read_bytes", int64_t(s.heap_read_bytes.load())},
          {"tensor_heap_bytes", engine_->heap().arena()->capacity()},
          {"tensor_heap_in_use", engine_->heap().arena()->bytes_in_use()},
          {"moe_stage_bytes", moe_stage_bytes()},
          {"moe_output_cache_bytes", output_pool_->cached_bytes()}};
}

at::Tensor CamBackend::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  return engine_->heap().arena()->empty(sizes, dtype);
}

at::Tensor CamBackend::peer_arena_view(int r, int64_t offset, int64_t nbytes) {
  TORCH_CHECK(r >= 0 && r < size_, "cam peer_arena_view on rank ", rank_, ": rank ", r,
              " is outside the group of ", size_);
  const int64_t cap = engine_->config().tensor_heap_bytes;
  TORCH_CHECK(offset >= 0 && nbytes >= 0 && offset + nbytes <= cap, "cam peer_arena_view on rank ", rank_,
              ": bytes [", offset, ", ", offset + nbytes, ") of rank ", r, "'s tensor heap are outside its ",
              cap, " bytes");
  char* p = engine_->heap().layout().arena(engine_->heap().base(r)) + offset;
  auto keep = engine_;  // the peer's mapping lives as long as the engine's heap
  return at::from_blob(p, {nbytes}, [keep](void*) {}, at::TensorOptions().dtype(at::kByte));
}

at::Tensor CamBackend::allocateTensor(long size, at::TensorOptions options) {
  TORCH_CHECK(!options.has_device() || options.device().is_cpu(), "cam allocateTensor on rank ",
              rank_, ": the tensor heap holds CPU tensors, got device ", options.device());
  return empty({int64_t(size)}, c10::typeMetaToScalarType(options.dtype()));
}

Clock::time_point CamBackend::deadline(std::chrono::milliseconds op_timeout) const {
  auto t = op_timeout == c10d::kUnsetTimeout || op_timeout.count() <= 0 ? engine_->config().timeout
                                                                        : op_timeout;
  return Clock::now() + t;
}

void CamBackend::check_tensor(const char* op, const at::Tensor& t, const char* what) const {
  TORCH_CHECK(t.defined(), "cam ", op, " on rank ", rank_, ": the ", what, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), "cam ", op, " on rank ", rank_, ": expected a CPU ", what,
              ", got one on ", t.device(),
              " (this build of cam moves CPU tensors through host shared memory)");
  TORCH_CHECK(t.layout() == at::kStrided, "cam ", op, " on rank ", rank_, ": expected a dense ",
              what, ", got layout ", t.layout());
}

const at::Tensor& CamBackend::single_tensor(const char* op, std::vector<at::Tensor>& tensors) const {
  TORCH_CHECK(tensors.size() == 1, "cam ", op, " on rank ", rank_,
              ": expected exactly one tensor, got ", tensors.size());
  check_tensor(op, tensors[0]);
  return tensors[0];
}

void CamBackend::check_peer(const char* op, int peer, const char* role) const {
  TORCH_CHECK(peer >= 0 && peer < size_, "cam ", op, " on rank ", rank_, ": ", role, " rank ",
              peer, " is out of range for a group of ", size_, " ranks (expected 0..", size_ - 1, ")");
}

c10::intrusive_ptr<c10d::Work> CamBackend::launch(std::shared_ptr<Op> op, c10d::OpType type,
                                                  const char* title, std::vector<at::Tensor> inputs) {
  auto work = c10::make_intrusive<CamWork>(engine_, op, rank_, type, title, std::move(inputs));
  engine_->submit(std::move(op));
  std::lock_guard<std::mutex> lk(issue_mu_);
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

void CamBackend::startCoalescing() {
  std::lock_guard<std::mutex> lk(issue_mu_);
  TORCH_CHECK(!coalescing_, "cam on rank ", rank_, ": startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> CamBackend::endCoalescing() {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  {
    std::lock_guard<std::mutex> lk(issue_mu_);
    TORCH_CHECK(coalescing_, "cam on rank ", rank_, ": endCoalescing called without startCoalescing");
    coalescing_ = false;
    works.swap(coalesced_);
  }
  return c10::make_intrusive<CamCoalescedWork>(rank_, std::move(works));
}

c10::intrusive_ptr<c10d::Work> CamBackend::barrier(const c10d::BarrierOptions& opts) {
  auto dl = deadline(opts.timeout);
  return launch_collective([&](uint64_t seq) { return std::make_shared<BarrierOp>(seq, dl); },
                           c10d::OpType::BARRIER, "cam:barrier", {});
}

c10::intrusive_ptr<c10d::Work> CamBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single_tensor("broadcast", tensors);
  check_peer("broadcast", int(opts.rootRank), "root");
  TORCH_CHECK(opts.rootTensor == 0, "cam broadcast on rank ", rank_,
              ": expected rootTensor 0 (one tensor per rank), got ", opts.rootTensor);
  auto dl = deadline(opts.timeout);
  const int root = int(opts.rootRank);
  return launch_collective(
      [&](uint64_t seq) { return std::make_shared<BroadcastOp>(seq, dl, root, root == rank_, t); },
      c10d::OpType::BROADCAST, "cam:broadcast", tensors);
}

namespace {
// Row offsets of each peer's block along dim 0, from split sizes (empty: equal splits).
std::vector<int64_t> resolve_splits(const char* op, int rank, int world, const at::Tensor& t,
                                    const std::vector<int64_t>& splits, const char* which) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  if (splits.empty()) {
    TORCH_CHECK(rows % world == 0, "cam ", op, " on rank ", rank, ": the ", which,
                " tensor has ", rows, " rows along dim 0, which does not split evenly over ",
                world, " ranks; pass ", which, "_split_sizes");
    return std::vector<int64_t>(world, rows / world);
  }
  TORCH_CHECK(int(splits.size()) == world, "cam ", op, " on rank ", rank, ": ", which,
              "_split_sizes has ", splits.size(), " entries, expected one per rank (", world, ")");
  int64_t sum = 0;
  for (int j = 0; j < world; ++j) {
    TORCH_CHECK(splits[j] >= 0, "cam ", op, " on rank ", rank, ": ", which, "_split_sizes[", j,
                "] is negative (", splits[j], ")");
    sum += splits[j];
  }
  TORCH_CHECK(sum == rows, "cam ", op, " on rank ", rank, ": ", which,
              "_split_sizes add up to ", sum, " but the ", which, " tensor has ", rows,
              " rows along dim 0");
  return splits;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> CamBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_splits,
                                                         std::vector<int64_t>& input_splits,
                                                         const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all_single";
  check_tensor(op, input, "input tensor");
  check_tensor(op, output, "output tensor");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "cam ", op, " on rank ", rank_,
              ": input is ", input.scalar_type(), " but output is ", output.scalar_type());
  auto in_rows = resolve_splits(op, rank_, size_, input, input_splits, "input");
  auto out_rows = resolve_splits(op, rank_, size_, output, output_splits, "output");
  // Bytes of one row along dim 0 (a 0-d tensor is one row).
  auto row_bytes = [](const at::Tensor& t) -> int64_t {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    return rows == 0 ? 0 : int64_t(t.nbytes()) / rows;
  };
  const int64_t in_row_bytes = row_bytes(input);
  const int64_t out_row_bytes = row_bytes(output);
  if (input.numel() > 0 && output.numel() > 0) {
    TORCH_CHECK(in_row_bytes == out_row_bytes, "cam ", op, " on rank ", rank_,
                ": input rows hold ", in_row_bytes, " bytes but output rows hold ", out_row_bytes,
                " bytes; dims after the first must match");
  }
  at::Tensor in = input.contiguous();
  at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
  if (!out.is_same(output)) copy_back.emplace_back(output, out);
  std::vector<AllToAllBlock> send(size_), recv(size_);
  char* in_ptr = static_cast<char*>(in.data_ptr());
  char* out_ptr = static_cast<char*>(out.data_ptr());
  int64_t in_off = 0, out_off = 0;
  for (int j = 0; j < size_; ++j) {
    send[j] = {in_ptr + in_off, in_rows[j] * in_row_bytes};
    recv[j] = {out_ptr + out_off, out_rows[j] * out_row_bytes};
    in_off += send[j].nbytes;
    out_off += recv[j].nbytes;
  }
  auto dl = deadline(opts.timeout);
  const int dtype = int(input.scalar_type());
  return launch_collective(
      [&](uint64_t seq) {
        return std::make_shared<AllToAllOp>(op, CollKind::kAllToAll, seq, dl, dtype, std::move(send), std::move(recv),
                                            std::vector<at::Tensor>{in, out}, std::move(copy_back),
                                            std::vector<at::Tensor>{output});
      },
      c10d::OpType::ALLTOALL_BASE, "cam:all_to_all_single", {input});
}

c10::intrusive_ptr<c10d::Work> CamBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all";
  TORCH_CHECK(int(inputs.size()) == size_ && int(outputs.size()) == size_, "cam ", op, " on rank ",
              rank_, ": expected ", size_, " input and ", size_, " output tensors, got ",
              inputs.size(), " and ", outputs.size());
  const auto dtype = inputs[0].scalar_type();
  std::vector<AllToAllBlock> send(size_), recv(size_);
  std::vector<at::Tensor> keep;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
  for (int j = 0; j < size_; ++j) {
    check_tensor(op, inputs[j], "input tensor");
    check_tensor(op, outputs[j], "output tensor");
    TORCH_CHECK(inputs[j].scalar_type() == dtype && outputs[j].scalar_type() == dtype, "cam ", op,
                " on rank ", rank_, ": every tensor must be ", dtype, "; input ", j, " is ",
                inputs[j].scalar_type(), " and output ", j, " is ", outputs[j].scalar_type());
    at::Tensor in = inputs[j].contiguous();
    at::Tensor out = outputs[j].is_contiguous() ? outputs[j]
                                                : at::empty_like(outputs[j], at::MemoryFormat::Contiguous);
    if (!out.is_same(outputs[j])) copy_back.emplace_back(outputs[j], out);
    send[j] = {static_cast<char*>(in.data_ptr()), int64_t(in.nbytes())};
    recv[j] = {static_cast<char*>(out.data_ptr()), int64_t(out.nbytes())};
    keep.push_back(in);
    keep.push_back(out);
  }
  auto dl = deadline(opts.timeout);
  return launch_collective(
      [&](uint64_t seq) {
        return std::make_shared<AllToAllOp>(op, CollKind::kAllToAll, seq, dl, int(dtype), std::move(send), std::move(recv),
                                            std::move(keep), std::move(copy_back), outputs);
      },
      c10d::OpType::ALLTOALL, "cam:all_to_all", inputs);
}

c10::intrusive_ptr<c10d::Work> CamBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  const at::Tensor& t = single_tensor("send", tensors);
  check_peer("send", dst, "destination");
  TORCH_CHECK(dst != rank_, "cam send on rank ", rank_, ": a rank cannot send to itself");
  auto op = std::make_shared<SendOp>(deadline(c10d::kUnsetTimeout), dst, tag, t);
  return launch(std::move(op), c10d::OpType::SEND, "cam:send", tensors);
}

c10::intrusive_ptr<c10d::Work> CamBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  const at::Tensor& t = single_tensor("recv", tensors);
  check_peer("recv", src, "source");
  TORCH_CHECK(src != rank_, "cam recv on rank ", rank_, ": a rank cannot receive from itself");
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(issue_mu_);
    seq = ++recv_seq_;
  }
  auto op = std::make_shared<RecvOp>(seq, deadline(c10d::kUnsetTimeout), src, tag, t);
  return launch(std::move(op), c10d::OpType::RECV, "cam:recv", tensors);
}

c10::intrusive_ptr<c10d::Work> CamBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const at::Tensor& t = single_tensor("recv", tensors);
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(issue_mu_);
    seq = ++recv_seq_;
  }
  auto op = std::make_shared<RecvOp>(seq, deadline(c10d::kUnsetTimeout), -1, tag, t);
  return launch(std::move(op), c10d::OpType::RECVANYSOURCE, "cam:recvAnySource", tensors);
}

}  // namespace cam
