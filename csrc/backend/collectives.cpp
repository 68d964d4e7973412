// CamBackend: the reduction and gather families (all_reduce, reduce, reduce_scatter,
// all_gather, gather, scatter and their coalesced forms) and monitored_barrier. Each method
// checks its arguments on the calling thread, brings them into one contiguous input and
// output per rank (flattening coalesced lists; copying back into strided or listed user
// tensors on success) and issues one staged-rounds (or all-to-all) op.
#include "cam_backend.hpp"

#include "../algo/collective.hpp"
#include "../algo/staged_rounds.hpp"

namespace cam {

kernels::RedOp red_op_of(const c10d::ReduceOp& r) {
  using T = c10d::ReduceOp::RedOpType;
  switch (r.op_) {
    case T::SUM: return kernels::RedOp::kSum;
    case T::AVG: return kernels::RedOp::kAvg;
    case T::PRODUCT: return kernels::RedOp::kProduct;
    case T::MIN: return kernels::RedOp::kMin;
    case T::MAX: return kernels::RedOp::kMax;
    case T::BAND: return kernels::RedOp::kBand;
    case T::BOR: return kernels::RedOp::kBor;
    case T::BXOR: return kernels::RedOp::kBxor;
    default:
      throw ArgumentError(str("reduce op ", int(r.op_),
                              " (PREMUL_SUM) is not supported; use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR"));
  }
}

namespace {

// A contiguous tensor to compute into; when `user` is not contiguous, a fresh one whose
// contents are copied back on success (and, if `load`, initialised from `user`).
at::Tensor dense(const at::Tensor& user, bool load,
                 std::vector<std::pair<at::Tensor, at::Tensor>>& copy_back) {
  if (user.is_contiguous()) return user;
  check_writable(user, "output tensor");
  at::Tensor t = load ? user.contiguous() : at::empty_like(user, at::MemoryFormat::Contiguous);
  copy_back.emplace_back(user, t);
  return t;
}

// One flat tensor holding every tensor of the list, in order.
at::Tensor flatten(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> flat;
  flat.reserve(ts.size());
  for (const auto& t : ts) flat.push_back(t.reshape(-1));
  return at::cat(flat);
}

}  // namespace

void CamBackend::check_same_dtype(const std::vector<at::Tensor>& ts, c10::ScalarType dtype,
                                  const char* what, bool written) const {
  for (size_t i = 0; i < ts.size(); ++i) {
    check_tensor(ts[i], what);
    if (written) check_writable(ts[i], what);
    CAM_CHECK_ARG(ts[i].scalar_type() == dtype, "every ", what,
                " must be ", dtype, " but ", what, " ", i, " is ", ts[i].scalar_type());
  }
}

void CamBackend::check_numel(const at::Tensor& t, int64_t expected,
                             const std::string& what) const {
  CAM_CHECK_ARG(t.numel() == expected, what, " has ",
              t.numel(), " elements, expected ", expected);
}

c10::ScalarType CamBackend::check_coalesced(const std::vector<at::Tensor>& outputs,
                                            const std::vector<at::Tensor>& inputs) const {
  CAM_CHECK_ARG(!inputs.empty() && inputs.size() == outputs.size(), "expected as many outputs as inputs (at least one), got ", outputs.size(), " and ",
              inputs.size());
  const auto dtype = inputs[0].scalar_type();
  check_same_dtype(inputs, dtype, "input tensor");
  check_same_dtype(outputs, dtype, "output tensor", true);
  return dtype;
}

void CamBackend::check_rank_list(const std::vector<std::vector<at::Tensor>>& lists,
                                 const char* what) const {
  CAM_CHECK_ARG(lists.size() == 1 && int(lists[0].size()) == size_, "expected one list of ", size_, " ", what, " tensors (one per rank), got ",
              lists.size(), " list(s)", lists.empty() ? std::string() : str(" of ", lists[0].size()));
}

kernels::RedOp CamBackend::reduction(const c10d::ReduceOp& r,
                                     c10::ScalarType dtype) const {
  kernels::RedOp red = red_op_of(r);
  const char* why = kernels::reduce_unsupported(dtype, red);
  CAM_CHECK_ARG(*why == 0, "cannot reduce ", dtype,
              " tensors with ", kernels::red_op_name(red), ": ", why);
  return red;
}

StagedAlgo CamBackend::choose_allreduce(int64_t nbytes) const {
  const CamConfig& cfg = engine_->config();
  if (size_ == 1) return StagedAlgo::kAllReduceOneShot;
  const bool eager = nbytes <= cfg.eager_max_bytes;
  switch (cfg.allreduce_algo) {
    case AllReduceAlgo::kOneShot: return eager ? StagedAlgo::kAllReduceEager : StagedAlgo::kAllReduceOneShot;
    case AllReduceAlgo::kTwoShot: return StagedAlgo::kAllReduceTwoShot;
    case AllReduceAlgo::kAuto: break;
  }
  if (nbytes > cfg.one_shot_max_bytes) return StagedAlgo::kAllReduceTwoShot;
  return eager ? StagedAlgo::kAllReduceEager : StagedAlgo::kAllReduceOneShot;
}

c10::intrusive_ptr<c10d::Work> CamBackend::launch_staged(const char* op, CollKind kind,
                                                         StagedRoundsArgs args,
                                                         std::chrono::milliseconds timeout,
                                                         c10d::OpType type, const char* title,
                                                         std::vector<at::Tensor> inputs) {
  auto dl = issuer_->deadline(timeout);
  return issuer_->issue_collective(
      [&](uint64_t seq) { return make_staged_rounds_op(op, kind, seq, dl, std::move(args)); },
      type, title, std::move(inputs));
}

c10::intrusive_ptr<c10d::Work> CamBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  const char* op = "all_reduce";
  return issuer_->collective(op, CollKind::kAllReduce, [&] {
    const at::Tensor& t = single_tensor(tensors);
    StagedRoundsArgs a;
    a.red_op = reduction(opts.reduceOp, t.scalar_type());
    a.input = dense(t, true, a.copy_back);
    a.output = a.input;
    a.algo = choose_allreduce(int64_t(t.nbytes()));
    a.outputs = {t};
    return launch_staged(op, CollKind::kAllReduce, std::move(a), opts.timeout,
                         c10d::OpType::ALLREDUCE, "cam:all_reduce", tensors);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "all_reduce_coalesced";
  return issuer_->collective(op, CollKind::kAllReduce, [&] {
    CAM_CHECK_ARG(!tensors.empty(), "expected at least one tensor");
    check_same_dtype(tensors, tensors[0].scalar_type(), "tensor", true);
    StagedRoundsArgs a;
    a.red_op = reduction(opts.reduceOp, tensors[0].scalar_type());
    a.input = flatten(tensors);
    a.output = a.input;
    int64_t off = 0;
    for (const auto& t : tensors) {
      a.copy_back.emplace_back(t, a.input.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
    a.algo = choose_allreduce(int64_t(a.input.nbytes()));
    a.outputs = tensors;
    return launch_staged(op, CollKind::kAllReduce, std::move(a), opts.timeout,
                         c10d::OpType::ALLREDUCE_COALESCED, "cam:all_reduce_coalesced", tensors);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::reduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  return issuer_->collective(op, CollKind::kReduce, [&] {
    const at::Tensor& t = single_tensor(tensors);
    check_peer(int(opts.rootRank), "root");
    CAM_CHECK_ARG(opts.rootTensor == 0, "expected rootTensor 0 (one tensor per rank), got ", opts.rootTensor);
    StagedRoundsArgs a;
    a.algo = StagedAlgo::kReduce;
    a.root = int(opts.rootRank);
    a.red_op = reduction(opts.reduceOp, t.scalar_type());
    if (a.root == rank_) {
      a.input = dense(t, true, a.copy_back);
      a.output = a.input;
    } else {
      a.input = t.contiguous();
    }
    a.outputs = {t};
    return launch_staged(op, CollKind::kReduce, std::move(a), opts.timeout, c10d::OpType::REDUCE,
                         "cam:reduce", tensors);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather";
  return issuer_->collective(op, CollKind::kAllGather, [&] {
    const at::Tensor& in = single_tensor(inputs);
    check_rank_list(outputs, "output");
    check_same_dtype(outputs[0], in.scalar_type(), "output tensor", true);
    check_numel(outputs[0][rank_], in.numel(), str("output tensor ", rank_, " (this rank's)"));
    bool even = true;
    for (int r = 0; r < size_; ++r) even &= outputs[0][r].numel() == in.numel();
    if (!even) {
      // Ranks contribute different sizes (as Megatron's expert-tensor-parallel dispatcher does):
      // every rank sends its input to every peer over the all-to-all channels, whose split
      // check verifies each output size against the sender's input.
      std::vector<AllToAllBlock> send(size_), recv(size_);
      std::vector<at::Tensor> keep;
      std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
      at::Tensor c = in.contiguous();
      keep.push_back(c);
      for (int r = 0; r < size_; ++r) {
        send[r] = {static_cast<char*>(c.data_ptr()), int64_t(c.nbytes())};
        at::Tensor o = dense(outputs[0][r], false, copy_back);
        recv[r] = {static_cast<char*>(o.data_ptr()), int64_t(o.nbytes())};
        keep.push_back(o);
      }
      auto dl = issuer_->deadline(opts.timeout);
      return issuer_->issue_collective(
          [&](uint64_t seq) {
            return std::make_shared<AllToAllOp>(op, CollKind::kAllGather, seq, dl, int(in.scalar_type()),
                                                std::move(send), std::move(recv), std::move(keep),
                                                std::move(copy_back), outputs[0]);
          },
          c10d::OpType::ALLGATHER, "cam:all_gather", inputs);
    }
    StagedRoundsArgs a;
    a.algo = StagedAlgo::kAllGather;
    a.input = in.contiguous();
    a.output = at::empty({int64_t(size_) * in.numel()}, in.options().memory_format(at::MemoryFormat::Contiguous));
    for (int r = 0; r < size_; ++r) {
      a.copy_back.emplace_back(outputs[0][r], a.output.narrow(0, r * in.numel(), in.numel()).view(outputs[0][r].sizes()));
    }
    a.outputs = outputs[0];
    return launch_staged(op, CollKind::kAllGather, std::move(a), opts.timeout,
                         c10d::OpType::ALLGATHER, "cam:all_gather", inputs);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor";
  return issuer_->collective(op, CollKind::kAllGather, [&] {
    check_tensor(input, "input tensor");
    check_tensor(output, "output tensor");
    CAM_CHECK_ARG(input.scalar_type() == output.scalar_type(), "input is ", input.scalar_type(), " but output is ", output.scalar_type());
    check_numel(output, int64_t(size_) * input.numel(),
                str("the output tensor (", size_, " x the input's ", input.numel(), ")"));
    StagedRoundsArgs a;
    a.algo = StagedAlgo::kAllGather;
    a.input = input.contiguous();
    a.output = dense(output, false, a.copy_back);
    a.outputs = {output};
    return launch_staged(op, CollKind::kAllGather, std::move(a), opts.timeout,
                         c10d::OpType::_ALLGATHER_BASE, "cam:all_gather_into_tensor", {input});
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_coalesced";
  return issuer_->collective(op, CollKind::kAllGather, [&] {
    CAM_CHECK_ARG(!inputs.empty(), "expected at least one input");
    const auto dtype = inputs[0].scalar_type();
    check_same_dtype(inputs, dtype, "input tensor");
    CAM_CHECK_ARG(int(output_lists.size()) == size_, "expected ",
                size_, " output lists (one per rank), got ", output_lists.size());
    for (int r = 0; r < size_; ++r) {
      CAM_CHECK_ARG(output_lists[r].size() == inputs.size(), "output list ", r, " holds ", output_lists[r].size(), " tensors, expected ",
                  inputs.size(), " (one per input)");
      check_same_dtype(output_lists[r], dtype, "output tensor", true);
      for (size_t i = 0; i < inputs.size(); ++i) {
        check_numel(output_lists[r][i], inputs[i].numel(), str("output ", i, " of rank ", r));
      }
    }
    StagedRoundsArgs a;
    a.algo = StagedAlgo::kAllGather;
    a.input = flatten(inputs);
    const int64_t total = a.input.numel();
    a.output = at::empty({int64_t(size_) * total}, a.input.options());
    for (int r = 0; r < size_; ++r) {
      int64_t off = r * total;
      for (size_t i = 0; i < inputs.size(); ++i) {
        auto& dst = output_lists[r][i];
        a.copy_back.emplace_back(dst, a.output.narrow(0, off, dst.numel()).view(dst.sizes()));
        off += dst.numel();
      }
    }
    for (auto& l : output_lists) a.outputs.insert(a.outputs.end(), l.begin(), l.end());
    return launch_staged(op, CollKind::kAllGather, std::move(a), opts.timeout,
                         c10d::OpType::ALLGATHER_COALESCED, "cam:all_gather_coalesced", inputs);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor_coalesced";
  return issuer_->collective(op, CollKind::kAllGather, [&] {
    check_coalesced(outputs, inputs);
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_numel(outputs[i], int64_t(size_) * inputs[i].numel(), str("output ", i));
      CAM_CHECK_ARG(outputs[i].is_contiguous(), "output ", i,
                  " must be contiguous");
    }
    StagedRoundsArgs a;
    a.algo = StagedAlgo::kAllGather;
    a.input = flatten(inputs);
    const int64_t total = a.input.numel();
    a.output = at::empty({int64_t(size_), total}, a.input.options());
    int64_t off = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t n = inputs[i].numel();
      // Output i is rank-major: [rank 0's input i, rank 1's input i, ...].
      a.copy_back.emplace_back(outputs[i].view({int64_t(size_), n}), a.output.narrow(1, off, n));
      off += n;
    }
    a.output = a.output.view(-1);
    a.outputs = outputs;
    return launch_staged(op, CollKind::kAllGather, std::move(a), opts.timeout,
                         c10d::OpType::COALESCED, "cam:all_gather_into_tensor_coalesced", inputs);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::GatherOptions& opts) {
  const char* op = "gather";
  return issuer_->collective(op, CollKind::kGather, [&] {
    const at::Tensor& in = single_tensor(inputs);
    check_peer(int(opts.rootRank), "root");
    const int root = int(opts.rootRank);
    StagedRoundsArgs a;
    a.algo = StagedAlgo::kGather;
    a.root = root;
    a.input = in.contiguous();
    if (rank_ == root) {
      check_rank_list(outputs, "output");
      check_same_dtype(outputs[0], in.scalar_type(), "output tensor", true);
      a.output = at::empty({int64_t(size_) * in.numel()}, a.input.options());
      for (int r = 0; r < size_; ++r) {
        check_numel(outputs[0][r], in.numel(), str("output tensor ", r));
        a.copy_back.emplace_back(outputs[0][r], a.output.narrow(0, r * in.numel(), in.numel()).view(outputs[0][r].sizes()));
      }
      a.outputs = outputs[0];
    } else {
      CAM_CHECK_ARG(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), "only the root rank ", root, " passes output tensors");
    }
    return launch_staged(op, CollKind::kGather, std::move(a), opts.timeout, c10d::OpType::GATHER,
                         "cam:gather", inputs);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  return issuer_->collective(op, CollKind::kScatter, [&] {
    const at::Tensor& out = single_tensor(outputs);
    check_peer(int(opts.rootRank), "root");
    const int root = int(opts.rootRank);
    std::vector<AllToAllBlock> send(size_), recv(size_);
    std::vector<at::Tensor> keep;
    std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
    if (rank_ == root) {
      check_rank_list(inputs, "input");
      check_same_dtype(inputs[0], out.scalar_type(), "input tensor");
      for (int r = 0; r < size_; ++r) {
        check_numel(inputs[0][r], out.numel(), str("input tensor ", r));
        at::Tensor c = inputs[0][r].contiguous();
        send[r] = {static_cast<char*>(c.data_ptr()), int64_t(c.nbytes())};
        keep.push_back(c);
      }
    } else {
      CAM_CHECK_ARG(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "only the root rank ", root, " passes input tensors");
    }
    at::Tensor o = dense(out, false, copy_back);
    recv[root] = {static_cast<char*>(o.data_ptr()), int64_t(o.nbytes())};
    keep.push_back(o);
    auto dl = issuer_->deadline(opts.timeout);
    const int dtype = int(out.scalar_type());
    return issuer_->issue_collective(
        [&](uint64_t seq) {
          return std::make_shared<AllToAllOp>(op, CollKind::kScatter, seq, dl, dtype, std::move(send),
                                              std::move(recv), std::move(keep), std::move(copy_back),
                                              outputs);
        },
        c10d::OpType::SCATTER, "cam:scatter", outputs);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  return issuer_->collective(op, CollKind::kReduceScatter, [&] {
    const at::Tensor& out = single_tensor(outputs);
    check_rank_list(inputs, "input");
    check_same_dtype(inputs[0], out.scalar_type(), "input tensor");
    check_numel(inputs[0][rank_], out.numel(), str("input tensor ", rank_, " (this rank's block)"));
    StagedRoundsArgs a;
    // Blocks may differ in size per destination (uneven lists); all ranks must agree on them.
    for (int r = 0; r < size_; ++r) a.blocks.push_back(int64_t(inputs[0][r].nbytes()));
    a.algo = StagedAlgo::kReduceScatter;
    a.red_op = reduction(opts.reduceOp, out.scalar_type());
    a.input = flatten(inputs[0]);
    a.output = dense(out, false, a.copy_back);
    a.outputs = outputs;
    return launch_staged(op, CollKind::kReduceScatter, std::move(a), opts.timeout,
                         c10d::OpType::REDUCE_SCATTER, "cam:reduce_scatter", inputs[0]);
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor";
  return issuer_->collective(op, CollKind::kReduceScatter, [&] {
    check_tensor(input, "input tensor");
    check_tensor(output, "output tensor");
    CAM_CHECK_ARG(input.scalar_type() == output.scalar_type(), "input is ", input.scalar_type(), " but output is ", output.scalar_type());
    check_numel(input, int64_t(size_) * output.numel(),
                str("the input tensor (", size_, " x the output's ", output.numel(), ")"));
    StagedRoundsArgs a;
    a.algo = StagedAlgo::kReduceScatter;
    a.red_op = reduction(opts.reduceOp, input.scalar_type());
    a.input = input.contiguous();
    a.output = dense(output, false, a.copy_back);
    a.outputs = {output};
    return launch_staged(op, CollKind::kReduceScatter, std::move(a), opts.timeout,
                         c10d::OpType::_REDUCE_SCATTER_BASE, "cam:reduce_scatter_tensor", {input});
  });
}

c10::intrusive_ptr<c10d::Work> CamBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor_coalesced";
  return issuer_->collective(op, CollKind::kReduceScatter, [&] {
    const auto dtype = check_coalesced(outputs, inputs);
    std::vector<at::Tensor> rows;  // input i as [N, n_i]: block r goes to rank r
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_numel(inputs[i], int64_t(size_) * outputs[i].numel(), str("input ", i));
      rows.push_back(inputs[i].reshape({int64_t(size_), outputs[i].numel()}));
    }
    StagedRoundsArgs a;
    a.algo = StagedAlgo::kReduceScatter;
    a.red_op = reduction(opts.reduceOp, dtype);
    a.input = at::cat(rows, 1).view(-1);  // rank-major: rank r's block holds every output's piece
    const int64_t total = a.input.numel() / size_;
    a.output = at::empty({total}, a.input.options());
    int64_t off = 0;
    for (auto& o : outputs) {
      a.copy_back.emplace_back(o, a.output.narrow(0, off, o.numel()).view(o.sizes()));
      off += o.numel();
    }
    a.outputs = outputs;
    return launch_staged(op, CollKind::kReduceScatter, std::move(a), opts.timeout,
                         c10d::OpType::COALESCED, "cam:reduce_scatter_tensor_coalesced", inputs);
  });
}

void CamBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  // A zero timeout means "now" here (gloo's semantics), not "the group's default".
  auto dl = opts.timeout.count() == 0 ? Clock::now() : issuer_->deadline(opts.timeout);
  auto work = issuer_->issue_collective(
      [&](uint64_t seq) { return std::make_shared<MonitoredBarrierOp>(seq, dl, wait_all_ranks); },
      c10d::OpType::BARRIER, "cam:monitored_barrier", {});
  work->wait();
}

}  // namespace cam
