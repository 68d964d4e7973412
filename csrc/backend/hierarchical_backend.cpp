#include "hierarchical_backend.hpp"

#include <ATen/core/ivalue.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#include "../core/errors.hpp"
#include "../core/log.hpp"
#include "../runtime/cam_work.hpp"
#include "one_sided_backend.hpp"
#ifdef CAM_HAVE_UCX
#include "any_source_recv.hpp"
#include "ucx_p2p_backend.hpp"
#endif

namespace cam {
namespace {

// Where a rank that failed an op says why, for the ranks of other hosts.
constexpr const char* kFailureKey = "cam_hierarchy_failure";
// Address space of freed intermediate buffers a group keeps for its next ops.
constexpr int64_t kScratchCacheBytes = 1ll << 30;

// Blocks until `fut` completes, woken by whoever completes it (never polling: the thread that
// completes it may need this core). After each `every` without completion calls between(),
// which may throw to end the wait.
void block_on(const c10::intrusive_ptr<c10::ivalue::Future>& fut, std::chrono::milliseconds every,
              const std::function<void()>& between) {
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  fut->addCallback([done](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lk(done->mu);
    done->done = true;
    done->cv.notify_all();
  });
  std::unique_lock<std::mutex> lk(done->mu);
  while (!done->cv.wait_for(lk, every, [&] { return done->done; })) {
    lk.unlock();
    between();
    lk.lock();
  }
}

}  // namespace

// The Work of a composed op: its Future completes when the last step has run. wait() runs the
// queue up to this op on the caller's thread unless another thread already drives it; the op
// then ends before wait() returns, whatever its timeout (every step has the group's deadline).
class HierarchicalWork : public c10d::Work {
 public:
  HierarchicalWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
                   c10::weak_intrusive_ptr<HierarchicalBackend> group, uint64_t seq)
      : Work(rank, type),
        outputs_(std::move(outputs)),
        group_(std::move(group)),
        seq_(seq),
        future_(c10::make_intrusive<at::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  void finish_with(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }
  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  bool wait(std::chrono::milliseconds timeout) override {
    const bool bounded = timeout != kNoTimeout;
    const auto deadline = std::chrono::steady_clock::now() + (bounded ? timeout : std::chrono::milliseconds(0));
    if (!future_->completed())
      if (auto group = group_.lock()) group->drive_until(seq_, bounded ? &deadline : nullptr);
    if (!bounded) {
      future_->wait();
    } else if (!future_->completed()) {
      // Every step has the group's deadline; this only bounds the caller's own wait.
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      block_on(future_, std::max(left, std::chrono::milliseconds(1)),
               [&] { TORCH_CHECK(false, "cam: Work.wait timed out after ", timeout.count(), " ms"); });
    }
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::weak_intrusive_ptr<HierarchicalBackend> group_;
  uint64_t seq_;
  c10::intrusive_ptr<at::ivalue::Future> future_;
};

HostMap HostMap::from_keys(const std::vector<std::string>& keys, const std::vector<std::string>& hostnames) {
  HostMap m;
  std::map<std::string, int> index;
  for (size_t r = 0; r < keys.size(); ++r) {
    auto it = index.find(keys[r]);
    if (it == index.end()) {
      it = index.emplace(keys[r], int(m.ranks.size())).first;
      m.ranks.emplace_back();
      m.names.push_back(r < hostnames.size() ? hostnames[r] : keys[r]);
    }
    m.host_of.push_back(it->second);
    m.local_of.push_back(int(m.ranks[it->second].size()));
    m.ranks[it->second].push_back(int(r));
  }
  return m;
}

int HostMap::max_local() const {
  size_t n = 0;
  for (const auto& h : ranks) n = std::max(n, h.size());
  return int(n);
}

bool HostMap::uniform() const {
  for (const auto& h : ranks)
    if (h.size() != ranks[0].size()) return false;
  return true;
}

bool HostMap::in_rank_order() const {
  if (!uniform()) return false;
  const size_t l = ranks[0].size();
  for (size_t h = 0; h < ranks.size(); ++h)
    for (size_t i = 0; i < l; ++i)
      if (ranks[h][i] != int(h * l + i)) return false;
  return true;
}

HierarchicalBackend::HierarchicalBackend(int rank, int size, HostMap map, c10::intrusive_ptr<CamBackend> local,
                                         InterHost inter, c10::intrusive_ptr<c10d::Store> store,
                                         std::string group_desc)
    : c10d::Backend(rank, size),
      map_(std::move(map)),
      local_(std::move(local)),
      inter_(std::move(inter)),
      store_(std::move(store)),
      group_desc_(std::move(group_desc)),
      scratch_(std::make_shared<RecyclingPool>(kScratchCacheBytes)) {
  TORCH_CHECK(int(map_.host_of.size()) == size && map_.hosts() > 1, "cam: a hierarchical group needs a host map of ",
              size, " ranks on more than one host");
  TORCH_CHECK(inter_.all || (inter_.collectives && inter_.p2p),
              "cam: a hierarchical group needs inter-host backends over every rank");
  TORCH_CHECK(!leader() || inter_.leaders, "cam: the leader of a host needs the leaders' backend");
  TORCH_CHECK(!map_.uniform() || inter_.rail, "cam: uniform hosts need a rail backend");
  if (!inter_.collectives) inter_.collectives = inter_.all;
  if (!inter_.p2p) inter_.p2p = inter_.all;
  // A one-sided engine's waits run on this worker inside the step: they read the failure key
  // themselves.
  for (auto* b : {inter_.collectives.get(), inter_.rail.get(), inter_.leaders.get()})
    if (auto* one_sided = dynamic_cast<OneSidedBackend*>(b)) {
      one_sided->set_interrupt([this] { raise_published(); });
      if (one_sided->event_fd() >= 0 && std::find(served_.begin(), served_.end(), one_sided) == served_.end())
        served_.push_back(one_sided);
    }
  if (!served_.empty()) {
    // Without the eventfd (descriptors exhausted) this rank still works, its idle worker
    // polling instead of being rung: raising here would fail this rank alone and leave its peers
    // to their first op's deadline.
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0 && local_->engine()->config().log_level >= LogLevel::kWarn)
      log_line(LogLevel::kWarn, local_->engine()->who(),
               str("cannot create the inter-host worker's eventfd (", std::strerror(errno), "): its idle worker polls every ",
                   kUnrungPollMs, " ms instead"));
    if (wake_fd_ >= 0) idle_fds_.push_back({wake_fd_, POLLIN, 0});
    for (auto* b : served_) idle_fds_.push_back({b->event_fd(), POLLIN, 0});
  }
  worker_ = std::thread([this] { worker_main(); });
}

HierarchicalBackend::~HierarchicalBackend() {
  shutdown();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

namespace {
void ring(int fd) {
  if (fd < 0) return;
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(fd, &one, sizeof one);  // full counter: already readable
}
}  // namespace

void HierarchicalBackend::shutdown() {
  std::call_once(shutdown_once_, [this] {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    idle_cv_.notify_all();
    drive_cv_.notify_all();
    ring(wake_fd_);
    if (worker_.joinable()) {
      if (worker_.get_id() == std::this_thread::get_id()) {
        worker_.detach();
      } else {
        worker_.join();
      }
    }
    local_->shutdown();
  });
}

uint64_t HierarchicalBackend::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lk(mu_);
  return seq_;
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::enqueue(c10d::OpType type, std::string name,
                                                            std::vector<at::Tensor> outputs, Body body) {
  std::unique_lock<std::mutex> lk(mu_);
  TORCH_CHECK(!stop_, "cam ", name, " on rank ", rank_, " of group ", group_desc_, ": the group was shut down");
  const uint64_t seq = ++seq_;
  auto work = c10::make_intrusive<HierarchicalWork>(
      rank_, type, std::move(outputs),
      c10::weak_intrusive_ptr<HierarchicalBackend>(
          c10::intrusive_ptr<HierarchicalBackend>::unsafe_reclaim_from_nonowning(this)),
      seq);
  queue_.push_back(Task{seq, str("cam ", name, " (seq ", seq, ") on rank ", rank_, " of group ", group_desc_),
                        std::move(body), [work](std::exception_ptr e) { work->finish_with(e); }});
  last_enqueue_ = std::chrono::steady_clock::now();
  // Only a parked worker is woken: otherwise its next poll finds the op if nobody waits on it
  // (a wake per op would take a core from the ranks that run it).
  const bool wake = worker_parked_;
  lk.unlock();
  if (wake) {
    idle_cv_.notify_one();
    ring(wake_fd_);
  }
  return noted(work);
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::noted(c10::intrusive_ptr<c10d::Work> w) {
  if (!coalescing_.load(std::memory_order_relaxed)) return w;  // every op outside a block: no lock
  std::lock_guard<std::mutex> lk(coalescing_mu_);
  if (coalescing_.load(std::memory_order_relaxed)) coalesced_.push_back(w);
  return w;
}

void HierarchicalBackend::startCoalescing() {
  std::lock_guard<std::mutex> lk(coalescing_mu_);
  TORCH_CHECK(!coalescing_.load(), "cam on rank ", rank_, " of group ", group_desc_,
              ": startCoalescing while a coalescing block is open (blocks do not nest)");
  coalesced_.clear();
  coalescing_.store(true);
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::endCoalescing() {
  std::lock_guard<std::mutex> lk(coalescing_mu_);
  TORCH_CHECK(coalescing_.load(), "cam on rank ", rank_, " of group ", group_desc_,
              ": endCoalescing without startCoalescing");
  coalescing_.store(false);
  return c10::make_intrusive<CamCoalescedWork>(rank_, std::move(coalesced_));
}

void HierarchicalBackend::run_task(Task& task) {
  std::exception_ptr error;
  if (!fatal_.empty()) {
    error = std::make_exception_ptr(FatalError(task.name + ": the group is unusable after an earlier error: " + fatal_));
  } else {
    try {
      task.body();
    } catch (...) {
      const std::string why = task.name + ": " + error_text(std::current_exception());
      fail_group(why);
      error = std::make_exception_ptr(FatalError(why));
    }
  }
  task.finish(error);
}

void HierarchicalBackend::drive_until(uint64_t seq, const std::chrono::steady_clock::time_point* deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    if (queue_.empty() || queue_.front().seq > seq) return;  // taken: the Future says when it is done
    if (!driving_) break;
    if (!deadline) {
      drive_cv_.wait(lk);  // whoever drives runs each step with the group's deadline
    } else if (drive_cv_.wait_until(lk, *deadline) == std::cv_status::timeout) {
      return;
    }
  }
  std::vector<Task> tasks;
  while (!queue_.empty() && queue_.front().seq <= seq) {
    tasks.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  driving_ = true;
  lk.unlock();
  for (auto& task : tasks) run_task(task);
  lk.lock();
  driving_ = false;
  lk.unlock();
  drive_cv_.notify_all();  // the worker serves the engines again
}

void HierarchicalBackend::worker_main() {
  // Polls for ops nobody waits on as the local engine's progress thread does (PollSchedule);
  // parked, it is rung by the next enqueue.
  PollSchedule polls{std::chrono::microseconds(local_->engine()->config().progress_interval_us)};
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    if (driving_) {
      // A caller runs the queue (drive_until). Afterwards the engines need serving again: a
      // put's tail moves only while this rank progresses.
      drive_cv_.wait(lk, [this] { return !driving_; });
      continue;
    }
    if (!queue_.empty()) {
      Task task = std::move(queue_.front());
      queue_.pop_front();
      driving_ = true;
      lk.unlock();
      run_task(task);
      lk.lock();
      driving_ = false;
      drive_cv_.notify_all();
      polls.found_work();
      continue;
    }
    if (stop_) return;
    const bool park = PollSchedule::park(last_enqueue_);
    worker_parked_ = park;
    if (!served_.empty()) {
      serve_between_ops(lk, park ? std::chrono::milliseconds(kMissedWakePollMs)
                                 : std::chrono::duration_cast<std::chrono::milliseconds>(polls.next_wait()));
    } else if (park) {
      idle_cv_.wait(lk);
    } else {
      idle_cv_.wait_for(lk, polls.next_wait());
    }
    worker_parked_ = false;
  }
}

void HierarchicalBackend::serve_between_ops(std::unique_lock<std::mutex>& lk, std::chrono::milliseconds bound) {
  driving_ = true;
  lk.unlock();
  bool armed = true;
  for (auto* b : served_) armed = b->drain_and_arm() && armed;
  lk.lock();
  driving_ = false;
  lk.unlock();
  drive_cv_.notify_all();
  if (armed) {  // else events were queued: progress them first
    // Woken by traffic, by a ring or at the bound.
    ::poll(idle_fds_.data(), idle_fds_.size(), wake_fd_ >= 0 ? std::max<int>(1, int(bound.count())) : kUnrungPollMs);
    if (wake_fd_ >= 0 && (idle_fds_.front().revents & POLLIN)) {
      uint64_t count;
      [[maybe_unused]] const ssize_t n = ::read(wake_fd_, &count, sizeof count);
    }
  }
  lk.lock();
}

void HierarchicalBackend::fail_group(const std::string& why) {
  if (!fatal_.empty()) return;
  fatal_ = why;
  local_->engine()->fail(why);
  try {
    if (!store_->check({kFailureKey})) store_->set(kFailureKey, std::vector<uint8_t>(why.begin(), why.end()));
  } catch (const std::exception&) {
    // The store is gone too: the other hosts fail at their own deadline.
  }
}

void HierarchicalBackend::local_step(const c10::intrusive_ptr<c10d::Work>& w) const {
  try {
    w->wait();
  } catch (...) {
    // The inner group numbers the host's ranks from 0: say which group ranks those are.
    const auto& mine = map_.ranks[my_host()];
    std::string ranks;
    for (size_t i = 0; i < mine.size(); ++i) ranks += str(i ? ", " : "", i, " = ", mine[i]);
    throw FatalError(str(error_text(std::current_exception()), " (cam ranks on host ", map_.names[my_host()],
                         ": ", ranks, ")"));
  }
}

std::string HierarchicalBackend::published_failure() const {
  if (!store_->check({kFailureKey})) return {};
  const auto bytes = store_->get(kFailureKey);
  return std::string(bytes.begin(), bytes.end());
}

void HierarchicalBackend::raise_published() const {
  const std::string why = published_failure();
  if (!why.empty()) throw FatalError("a rank of another host failed: " + why);
}

void HierarchicalBackend::inter_step(const c10::intrusive_ptr<c10d::Work>& w) const {
  block_on(w->getFuture(), std::chrono::milliseconds(local_->engine()->config().liveness_interval_ms),
           [this] { raise_published(); });
  try {
    w->wait();  // rethrows the inter-host engine's error (its timeout, a closed connection)
  } catch (...) {
    // A peer that failed first and then closed its connections: name its cause, not the socket.
    try {
      raise_published();
    } catch (const FatalError&) {
      throw;
    } catch (...) {
      // The store is unreachable: the engine's own error is all there is.
    }
    throw;
  }
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  TORCH_CHECK(dst >= 0 && dst < size_ && dst != rank_, "cam send on rank ", rank_, " of group ", group_desc_,
              ": peer ", dst, " is not another rank of the group (size ", size_, ")");
  if (map_.host_of[dst] == my_host()) return noted(local_->send(tensors, map_.local_of[dst], tag));
  return noted(inter_.p2p->send(tensors, dst, tag));
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  TORCH_CHECK(src >= 0 && src < size_ && src != rank_, "cam recv on rank ", rank_, " of group ", group_desc_,
              ": peer ", src, " is not another rank of the group (size ", size_, ")");
  if (map_.host_of[src] == my_host()) return noted(local_->recv(tensors, map_.local_of[src], tag));
  return noted(inter_.p2p->recv(tensors, src, tag));
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const std::string where = str("cam recv from any source on rank ", rank_, " of group ", group_desc_);
#ifdef CAM_HAVE_UCX
  if (auto remote = c10::dynamic_intrusive_pointer_cast<UcxP2PBackend>(inter_.p2p)) {
    TORCH_CHECK_VALUE(tensors.size() == 1, where, ": expects one tensor, got ", tensors.size());
    c10::weak_intrusive_ptr<HierarchicalBackend> self(
        c10::intrusive_ptr<HierarchicalBackend>::unsafe_reclaim_from_nonowning(this));
    return noted(c10::make_intrusive<AnySourceRecvWork>(
        rank_, group_desc_, tensors[0], tag, local_, map_.ranks[my_host()], remote, [self] {
          if (auto group = self.lock()) group->raise_published();
        }));
  }
#endif
  TORCH_CHECK(false, where, ": between hosts this needs UCX's tagged messages, and point-to-point between hosts runs "
              "over ", inter_.p2p->getBackendName(), " here (inter_host_engine=gloo, or a build without UCX); name the "
              "source rank");
}

}  // namespace cam
