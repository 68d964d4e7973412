// CamWork: the c10d Work of every cam op. The op's Future is the source of truth: wait()
// drives the engine until it completes, then rethrows the op's error, as gloo's Work does.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mutex>

#include "engine.hpp"

namespace cam {

class CamWork : public c10d::Work {
 public:
  // The profiler (when it listens) notes the op under `profiling_title` with its `inputs`.
  CamWork(std::shared_ptr<Engine> engine, std::shared_ptr<Op> op, int rank, c10d::OpType type,
          const char* profiling_title, const std::vector<at::Tensor>& inputs);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return op_->future(); }
  uint64_t getSequencenumber() const override { return op_->seq(); }
  const std::shared_ptr<Op>& op() const { return op_; }

 private:
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<Op> op_;
};

// The Work of a coalesced block (dist._coalescing_manager with a device, as DeepSpeed's ZeRO-3
// uses): the block's ops were issued as usual; this waits for all of them. Its Future completes
// when the last op's does; an op whose Work has no Future (gloo's send / recv, in a block of a
// group across hosts) counts once wait() or isCompleted() has seen it done.
class CamCoalescedWork : public c10d::Work {
 public:
  CamCoalescedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  struct Settle {  // shared with the ops' Future callbacks
    std::mutex mu;
    size_t pending = 0;
    std::vector<at::Tensor> outputs;
  };
  // One op finished: its error fails the block's Future, the last completes it.
  static void settle(Settle& s, c10::ivalue::Future& fut, std::exception_ptr error,
                     const std::vector<at::Tensor>& outputs);
  void settle_unfutured();

  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<Settle> state_;
  std::mutex unsettled_mu_;
  std::vector<size_t> unsettled_;  // works_ without a Future, not yet counted
};

}  // namespace cam
