#include "ucx_p2p_backend.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>

#include "../core/errors.hpp"

namespace cam {

namespace {

uint64_t wire_tag(int sender, int tag) { return (uint64_t(uint32_t(sender)) << 32) | uint32_t(tag); }
constexpr uint64_t kAnySender = 0xffffffffull;  // the mask that matches a tag from every sender

// Whether a message with `tag` from any sender waits unmatched (left to UCX's matching).
bool arrived(UcxTransport& x, int tag) {
  uint64_t sender_tag = 0;
  size_t length = 0;
  return x.probe_tagged(uint32_t(tag), kAnySender, false, &sender_tag, &length) != nullptr;
}

class UcxP2PWork : public c10d::Work {
 public:
  UcxP2PWork(std::shared_ptr<UcxP2PBackend::State> state, UcxTagged request, at::Tensor user, at::Tensor buffer,
             int rank, int peer, std::string what, c10d::OpType type)
      : c10d::Work(rank, type), state_(std::move(state)), request_(request), user_(std::move(user)),
        buffer_(std::move(buffer)), peer_(peer), what_(std::move(what)) {}

  ~UcxP2PWork() override {
    if (finished_) return;
    try {
      abandon();
    } catch (...) {  // a destructor must not throw; the request then goes with the worker
    }
  }

  bool isCompleted() override {
    if (finished_) return true;
    std::string error;
    size_t received = 0;
    if (!state_->ucx.locked([&](UcxTransport& t) { return t.tagged_done(request_, &error, &received); })) return false;
    finish(error, received);
    return true;
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (!finished_) run_to_completion(timeout);
    TORCH_CHECK(error_.empty(), error_);
    return true;
  }

 private:
  void run_to_completion(std::chrono::milliseconds timeout) {
    const auto& opts = state_->ucx.options();
    const auto limit = timeout == ::kNoTimeout ? opts.timeout : timeout;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    const auto interval = std::chrono::milliseconds(opts.liveness_interval_ms);
    std::string error;
    size_t received = 0;
    while (true) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      const bool done = state_->ucx.drive(
          [&](UcxTransport& t) { return t.tagged_done(request_, &error, &received); },
          std::clamp(left, std::chrono::milliseconds(0), interval));
      if (done) return finish(error, received);
      const std::string lost = state_->ucx.locked([&](UcxTransport& t) { return t.peer_failure(peer_); });
      if (!lost.empty()) return fail(str("rank ", peer_, " ", lost));
      if (std::chrono::steady_clock::now() >= deadline) return fail(str("timeout after ", limit.count(), " ms"));
    }
  }

  // The request is done: release it, judge it, and give a strided receiver its bytes.
  void finish(const std::string& error, size_t received) {
    state_->ucx.inspect([&](UcxTransport& t) { t.release(request_); });  // frees, starts nothing
    finished_ = true;
    error_ = outcome(error, received);
    if (error_.empty() && buffer_.data_ptr() != user_.data_ptr()) user_.copy_(buffer_);
  }

  std::string outcome(const std::string& error, size_t received) const {
    const size_t expected = size_t(buffer_.nbytes());
    if (error.find("truncated") != std::string::npos)
      return str(what_, ": rank ", peer_, " sent more than the ", expected, " bytes this rank expects");
    if (!error.empty()) return str(what_, ": ", error);
    if (retrieveOpType() == c10d::OpType::RECV && received != expected)
      return str(what_, ": rank ", peer_, " sent ", received, " bytes, this rank expects ", expected);
    return {};
  }

  void fail(const std::string& why) {
    error_ = str(what_, ": ", why);
    abandon();
  }

  // Leaves an unfinished request and its tensor with the backend until UCX is done with them.
  void abandon() {
    finished_ = true;
    state_->ucx.locked([&](UcxTransport& t) { t.cancel(request_); });
    std::lock_guard<std::mutex> lk(state_->orphans_mu);
    state_->orphans.push_back({request_, buffer_});
  }

  std::shared_ptr<UcxP2PBackend::State> state_;
  UcxTagged request_;
  at::Tensor user_, buffer_;
  int peer_;
  std::string what_;
  bool finished_ = false;
  std::string error_;
};

}  // namespace

void UcxP2PBackend::State::sweep() {
  std::lock_guard<std::mutex> lk(orphans_mu);
  if (orphans.empty()) return;
  ucx.locked([&](UcxTransport& t) {
    std::string error;
    size_t received = 0;
    auto gone = std::remove_if(orphans.begin(), orphans.end(), [&](Orphan& o) {
      if (!t.tagged_done(o.request, &error, &received)) return false;
      t.release(o.request);
      return true;
    });
    orphans.erase(gone, orphans.end());
  });
}

UcxP2PBackend::UcxP2PBackend(c10::intrusive_ptr<c10d::Store> store, UcxOptions opts)
    : c10d::Backend(opts.rank, opts.size) {
  opts.tagged = true;
  state_ = std::make_shared<State>(std::move(store), std::move(opts));
}

UcxP2PBackend::~UcxP2PBackend() {
  // Orphans still in flight go with the worker (their tensors stay referenced until then).
  state_->sweep();
}

at::Tensor UcxP2PBackend::checked(std::vector<at::Tensor>& tensors, const char* op, int peer) const {
  const auto& o = state_->ucx.options();
  TORCH_CHECK_VALUE(tensors.size() == 1, "cam ", op, " on rank ", o.rank, " of group ", o.group_desc,
                    ": expects one tensor, got ", tensors.size());
  TORCH_CHECK_VALUE(peer == kAnySource || (peer >= 0 && peer < o.size && peer != o.rank), "cam ", op, " on rank ",
                    o.rank, " of group ", o.group_desc, ": peer ", peer, " is not another rank of the group of ", o.size);
  const at::Tensor& t = tensors[0];
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.layout() == at::kStrided, "cam ", op, " on rank ", o.rank,
                    ": expects a dense CPU tensor, got ", t.device(), " ", t.layout());
  return t;
}

c10::intrusive_ptr<c10d::Work> UcxP2PBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  at::Tensor t = checked(tensors, "send", dst);
  const auto& o = state_->ucx.options();
  state_->sweep();
  at::Tensor buf = t.contiguous();
  UcxTagged r = state_->ucx.locked(
      [&](UcxTransport& x) { return x.send_tagged(dst, buf.data_ptr(), size_t(buf.nbytes()), wire_tag(o.rank, tag)); });
  return c10::make_intrusive<UcxP2PWork>(state_, r, t, buf, o.rank, dst,
                                         str("cam send to rank ", dst, " (tag ", tag, ") on rank ", o.rank,
                                             " of group ", o.group_desc),
                                         c10d::OpType::SEND);
}

c10::intrusive_ptr<c10d::Work> UcxP2PBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  at::Tensor t = checked(tensors, "recv", src);
  const auto& o = state_->ucx.options();
  state_->sweep();
  at::Tensor buf = t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous);
  UcxTagged r = state_->ucx.locked([&](UcxTransport& x) {
    return x.recv_tagged(buf.data_ptr(), size_t(buf.nbytes()), wire_tag(src, tag), ~uint64_t(0));
  });
  return c10::make_intrusive<UcxP2PWork>(state_, r, t, buf, o.rank, src,
                                         str("cam recv from rank ", src, " (tag ", tag, ") on rank ", o.rank,
                                             " of group ", o.group_desc),
                                         c10d::OpType::RECV);
}

bool UcxP2PBackend::any_arrived(int tag) {
  return state_->ucx.inspect([&](UcxTransport& x) { return arrived(x, tag); });
}

void UcxP2PBackend::await_any(int tag, std::chrono::microseconds for_at_most) {
  state_->ucx.drive([&](UcxTransport& x) { return arrived(x, tag); }, for_at_most);
}

std::string UcxP2PBackend::lost_rank() {
  return state_->ucx.inspect([&](UcxTransport& x) {
    for (int p = 0; p < x.options().size; ++p) {
      const std::string why = x.peer_failure(p);
      if (!why.empty()) return str("rank ", p, " ", why);
    }
    return std::string();
  });
}

c10::intrusive_ptr<c10d::Work> UcxP2PBackend::recv_arrived(std::vector<at::Tensor>& tensors, int tag, int* src) {
  at::Tensor t = checked(tensors, "recv", kAnySource);
  const auto& o = state_->ucx.options();
  state_->sweep();
  at::Tensor buf = t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous);
  uint64_t sender_tag = 0;
  size_t length = 0;
  std::optional<UcxTagged> r = state_->ucx.locked([&](UcxTransport& x) -> std::optional<UcxTagged> {
    void* m = x.probe_tagged(uint32_t(tag), kAnySender, true, &sender_tag, &length);
    if (m == nullptr) return std::nullopt;
    return x.recv_taken(m, length, buf.data_ptr(), size_t(buf.nbytes()));
  });
  if (!r) return {};
  *src = int(sender_tag >> 32);
  return c10::make_intrusive<UcxP2PWork>(state_, *r, t, buf, o.rank, *src,
                                         str("cam recv from any source (rank ", *src, " sent it; tag ", tag,
                                             ") on rank ", o.rank, " of group ", o.group_desc),
                                         c10d::OpType::RECV);
}

}  // namespace cam
