#include "any_source_recv.hpp"

#include <ATen/core/ivalue.h>

#include <algorithm>

#include "../core/errors.hpp"
#include "../runtime/cam_work.hpp"
#include "../runtime/engine.hpp"
#include "../transport/wait_policy.hpp"
#include "cam_backend.hpp"
#include "ucx_p2p_backend.hpp"

namespace cam {

AnySourceRecvWork::AnySourceRecvWork(int rank, std::string group_desc, at::Tensor tensor, int tag,
                                     c10::intrusive_ptr<CamBackend> local, std::vector<int> host_ranks,
                                     c10::intrusive_ptr<UcxP2PBackend> remote, std::function<void()> raise_if_failed)
    : c10d::Work(rank, c10d::OpType::RECVANYSOURCE),
      where_(str("cam recv from any source (tag ", tag, ") on rank ", rank, " of group ", group_desc)),
      tensor_(std::move(tensor)), tag_(tag), local_(std::move(local)), host_ranks_(std::move(host_ranks)),
      remote_(std::move(remote)), raise_if_failed_(std::move(raise_if_failed)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
  post_local();
}

void AnySourceRecvWork::post_local() {
  if (host_ranks_.size() < 2) return;  // alone on its host: every message comes over UCX
  std::vector<at::Tensor> ts{tensor_};
  local_work_ = local_->recvAnysource(ts, tag_);
}

// Withdraws the posted cam recv: false when a message matched it first (it then finishes).
static bool withdraw(const c10::intrusive_ptr<CamBackend>& local, const c10::intrusive_ptr<c10d::Work>& w) {
  auto* cw = dynamic_cast<CamWork*>(w.get());
  return cw != nullptr && local->engine()->withdraw_recv(cw->op());
}

bool AnySourceRecvWork::pass() {
  if (finished_) return true;
  if (remote_work_) {
    if (!remote_work_->isCompleted()) return false;
    finish(remote_work_, remote_src_);
    return true;
  }
  if (local_work_ && local_work_->isCompleted()) {
    auto* cw = dynamic_cast<CamWork*>(local_work_.get());
    const int l = cw != nullptr ? cw->op()->source_rank() : -1;  // -1: failed before any message matched
    finish(local_work_, l >= 0 && l < int(host_ranks_.size()) ? host_ranks_[size_t(l)] : -1);
    return true;
  }
  if (!remote_->any_arrived(tag_)) return false;
  if (local_work_) {
    if (!withdraw(local_, local_work_)) return false;  // a message of this host matched first: it wins
    local_work_.reset();
  }
  std::vector<at::Tensor> ts{tensor_};
  remote_work_ = remote_->recv_arrived(ts, tag_, &remote_src_);
  if (!remote_work_) post_local();  // a receive naming its sender took it meanwhile
  return false;
}

void AnySourceRecvWork::finish(const c10::intrusive_ptr<c10d::Work>& w, int src) {
  try {
    w->wait();  // done: returns, or raises its error
  } catch (...) {
    error_ = std::current_exception();
  }
  source_ = src;
  finished_ = true;
}

bool AnySourceRecvWork::isCompleted() {
  {
    std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
    if (!lk.owns_lock() || !pass()) return false;
  }
  if (!future_set_.exchange(true)) {  // two threads may both see it finished
    if (error_) future_->setError(error_);
    else future_->markCompleted(c10::IValue(std::vector<at::Tensor>{tensor_}));
  }
  return true;
}

bool AnySourceRecvWork::isSuccess() const { return finished_ && !error_; }

std::exception_ptr AnySourceRecvWork::exception() const { return error_; }

int AnySourceRecvWork::sourceRank() const {
  TORCH_CHECK(finished_ && !error_, where_, ": no source before the receive completed");
  return source_;
}

std::vector<at::Tensor> AnySourceRecvWork::result() { return {tensor_}; }

bool AnySourceRecvWork::wait(std::chrono::milliseconds timeout) {
  const CamConfig& cfg = local_->engine()->config();
  const auto limit = timeout == kNoTimeout ? cfg.timeout : timeout;
  const auto start = std::chrono::steady_clock::now();
  const auto interval = std::chrono::milliseconds(cfg.liveness_interval_ms);
  auto next_check = start + interval;
  // Asleep, it is woken by a message of another host (UCX's server thread); one of this host
  // is seen within the sleep (sleep_max_us at most).
  Backoff backoff(cfg.spin_us, cfg.yield_us, cfg.sleep_max_us,
                  [this](int64_t us) { remote_->await_any(tag_, std::chrono::microseconds(us)); });
  {
    std::lock_guard<std::mutex> lk(mu_);
    while (!pass()) {
      const auto now = std::chrono::steady_clock::now();
      std::string why;
      if (now - start >= limit) {
        why = str("timeout after ", limit.count(), " ms: no message with this tag from any rank");
      } else if (now >= next_check) {
        next_check = now + interval;
        why = remote_->lost_rank();
        if (why.empty()) {
          try {
            raise_if_failed_();
          } catch (const std::exception& e) {
            why = e.what();
          }
        }
      }
      if (!why.empty()) {
        // Withdrawn first, so that no later message lands in the tensor; one that matched it
        // meanwhile is taken instead.
        if (local_work_ && !withdraw(local_, local_work_)) continue;
        error_ = std::make_exception_ptr(std::runtime_error(str(where_, ": ", why)));
        finished_ = true;
        break;
      }
      if (remote_work_) {
        // Taken from UCX: its own wait has the deadline and notices a lost sender.
        try {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(limit - (now - start));
          remote_work_->wait(std::max(left, std::chrono::milliseconds(1)));  // 0 would mean no limit
        } catch (...) {
        }
        continue;
      }
      backoff.pause();
    }
  }
  isCompleted();  // completes the Future outside the lock
  if (error_) std::rethrow_exception(error_);
  return true;
}

}  // namespace cam
