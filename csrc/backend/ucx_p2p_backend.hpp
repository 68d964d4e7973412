// UcxP2PBackend: point-to-point between hosts of a group that spans hosts (the
// HierarchicalBackend sends to ranks of other hosts through it), over UCX's tagged messages.
//
// Contract:
//   - send(t, dst, tag) and recv(t, src, tag) match on (sender, tag), in order per sender and
//     tag, as c10d promises; a message moves straight from the sender's tensor into the
//     receiver's (a non-contiguous tensor goes through a contiguous copy).
//   - Both return at once; SharedUcx's server thread progresses the transfer while the caller
//     computes, so a send completes without its sender waiting (a rendezvous needs both sides).
//   - wait() has the group's deadline (or the one given) and raises, naming op, rank and peer:
//     when the message is longer or shorter than the receiving tensor ("rank 2 sent 400 bytes,
//     this rank expects 800"), when the peer's endpoint fails (it died or its host is down),
//     or at the deadline.
//   - A Work dropped before it completes leaves its request and tensor with the backend until
//     UCX is done with them (a receive is cancelled first): no buffer is freed under UCX.
//   - A receive from any source is not posted here: any_arrived() probes for a message of the
//     tag from any sender, leaving it to UCX's matching, and recv_arrived() takes and receives
//     it, so that the caller can withdraw its receive on its own host between the two.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <mutex>
#include <vector>

#include "../transport/ucx_shared.hpp"

namespace cam {

class UcxP2PBackend : public c10d::Backend {
 public:
  UcxP2PBackend(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts);
  ~UcxP2PBackend() override;

  const std::string getBackendName() const override { return "cam-ucx-p2p"; }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  // For a receive from any source (HierarchicalBackend::recvAnysource), in two steps so that
  // the caller can withdraw its receive on its own host in between: whether a message with
  // `tag` from a rank of another host has arrived that no receive has matched; then receiving
  // the earliest such into `tensors`, `*src` its sender (null when none is left: a receive
  // posted meanwhile matched it).
  bool any_arrived(int tag);
  // Waits until such a message arrives (this thread progresses UCX meanwhile) or `for_at_most`
  // passes.
  void await_any(int tag, std::chrono::microseconds for_at_most);
  c10::intrusive_ptr<c10d::Work> recv_arrived(std::vector<at::Tensor>& tensors, int tag, int* src);
  // The first rank whose endpoint failed, said as "rank 3 its UCX endpoint failed with ...";
  // "" while none has. A receive from any source gives up on it, as cam's does on a dead peer.
  std::string lost_rank();

  // A request whose Work was dropped in flight, kept until UCX has finished with its tensor.
  struct Orphan {
    UcxTagged request;
    at::Tensor tensor;
  };
  struct State {
    std::mutex orphans_mu;
    std::vector<Orphan> orphans;  // declared before ucx: their tensors outlive the worker
    SharedUcx ucx;
    State(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts) : ucx(std::move(store), std::move(opts)) {}
    void sweep();  // releases the orphans UCX is done with
  };

 private:
  static constexpr int kAnySource = -1;  // checked(): a receive from any source
  at::Tensor checked(std::vector<at::Tensor>& tensors, const char* op, int peer) const;
  std::shared_ptr<State> state_;
};

}  // namespace cam
