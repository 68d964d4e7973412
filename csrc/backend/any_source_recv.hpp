// AnySourceRecvWork: a receive from any source on a group whose ranks span hosts
// (HierarchicalBackend::recvAnysource). A message from this host arrives through the host's
// cam group, one from another host through UCX's tagged messages; the receive must take
// exactly one of them, the earliest either engine has.
//
// Contract:
//   - At issue an any-source recv is posted on the host's cam group (unless this rank is alone
//     on its host). Each pass: that recv has matched: done; else a UCX message with the tag has
//     arrived unmatched (a probe that leaves it there): the cam recv is withdrawn (the engine
//     says whether a message bound to it first, which then wins), and only then is the UCX
//     message taken and received. So no message is ever taken by both, or lost.
//   - A UCX message taken away between probe and take (by a receive naming its sender, posted
//     meanwhile) re-posts the cam recv. Order against receives posted later: within a host cam
//     keeps posting order; across hosts a later receive naming the sender may match first.
//   - wait() drives the passes with the ranks' back-off (asleep, it is woken by a UCX message
//     and sees a message of this host within sleep_max_us), has the group's deadline (or the
//     one given), and raises when the group failed or a rank of another host is lost (its UCX
//     endpoint failed; a dead rank of this host fails the cam recv). isCompleted() makes one
//     pass. sourceRank() is the sender's group rank; the Future completes once a pass finishes
//     the receive.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace cam {

class CamBackend;
class UcxP2PBackend;

class AnySourceRecvWork : public c10d::Work {
 public:
  // local: this host's cam group (null: this rank is alone on its host); host_ranks: group rank
  // of each local index; raise_if_failed: throws when the group failed elsewhere.
  AnySourceRecvWork(int rank, std::string group_desc, at::Tensor tensor, int tag,
                    c10::intrusive_ptr<CamBackend> local, std::vector<int> host_ranks,
                    c10::intrusive_ptr<UcxP2PBackend> remote, std::function<void()> raise_if_failed);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  // One pass (under mu_): true once the receive is finished.
  bool pass();
  void post_local();
  void finish(const c10::intrusive_ptr<c10d::Work>& w, int src);

  const std::string where_;
  at::Tensor tensor_;
  const int tag_;
  c10::intrusive_ptr<CamBackend> local_;
  const std::vector<int> host_ranks_;
  c10::intrusive_ptr<UcxP2PBackend> remote_;
  std::function<void()> raise_if_failed_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;

  std::mutex mu_;
  c10::intrusive_ptr<c10d::Work> local_work_;   // the posted cam recv
  c10::intrusive_ptr<c10d::Work> remote_work_;  // the UCX message taken
  int remote_src_ = -1;
  std::atomic<bool> finished_{false};
  std::atomic<bool> future_set_{false};
  int source_ = -1;
  std::exception_ptr error_;
};

}  // namespace cam
