#include "shm_heap.hpp"

#include "../core/errors.hpp"
#include "heap_allocator.hpp"
#include "signal.hpp"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

namespace cam {
namespace {

constexpr const char* kShmDir = "/dev/shm";
constexpr const char* kNamePrefix = "torch_cam.";

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::string shm_device() {
  struct stat st {};
  if (stat(kShmDir, &st) != 0) return "?";
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

// Field 22 of /proc/<pid>/stat, and the state letter (field 3). Returns false if unreadable.
bool proc_stat(int64_t pid, char* state, uint64_t* start_time) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!std::getline(f, s)) return false;
  auto close = s.rfind(')');  // comm may contain spaces and parentheses
  if (close == std::string::npos) return false;
  std::istringstream rest(s.substr(close + 2));
  std::string field;
  rest >> *state;
  for (int i = 4; i <= 22 && rest >> field; ++i) {
    if (i == 22) *start_time = std::stoull(field);
  }
  return true;
}

bool pid_gone(int64_t pid) { return kill(pid_t(pid), 0) != 0 && errno == ESRCH; }

// Why the process that published (pid, start_time) is gone, or "" while it runs: the one
// liveness test of this transport (a zombie or a reused pid counts as gone).
std::string process_gone(int64_t pid, uint64_t start_time) {
  if (pid_gone(pid)) return "process " + std::to_string(pid) + " no longer exists";
  char state = 0;
  uint64_t start = 0;
  if (proc_stat(pid, &state, &start)) {
    if (state == 'Z' || state == 'X') return "process " + std::to_string(pid) + " has exited";
    if (start_time != 0 && start != start_time) return "process " + std::to_string(pid) + " exited (its pid was reused)";
  }
  return "";
}

std::string random_hex() {
  std::random_device rd;
  std::ostringstream os;
  os << std::hex << rd() << rd();
  return os.str();
}

std::string mib(double bytes) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed << bytes / (1 << 20) << " MiB";
  return os.str();
}

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string window_key(int r) { return "cam/window/" + std::to_string(r); }
std::string mapped_key(int r) { return "cam/mapped/" + std::to_string(r); }

// The restart attempt of this process's job: torchrun's count, or "0" outside torchrun.
std::string restart_attempt() {
  const char* c = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return c && *c ? c : "0";
}

// Window records: one field per line; the failure text, last, may span lines.
std::string serialize(const PeerInfo& p) {
  std::ostringstream os;
  os << p.segment << '\n' << p.pid << '\n' << p.start_time << '\n' << p.host << '\n' << p.shm_dev
     << '\n' << p.window_addr << '\n' << p.process_heap_fd << '\n' << p.process_heap_bytes << '\n'
     << p.attempt << '\n' << p.failure;
  return os.str();
}

PeerInfo deserialize(const std::vector<uint8_t>& b) {
  std::istringstream is(std::string(b.begin(), b.end()));
  PeerInfo p;
  std::string line;
  std::getline(is, p.segment);
  std::getline(is, line); p.pid = std::stoll(line);
  std::getline(is, line); p.start_time = std::stoull(line);
  std::getline(is, p.host);
  std::getline(is, p.shm_dev);
  std::getline(is, line); p.window_addr = std::stoull(line);
  std::getline(is, line); p.process_heap_fd = std::stoi(line);
  std::getline(is, line); p.process_heap_bytes = std::stoll(line);
  std::getline(is, p.attempt);
  p.failure.assign(std::istreambuf_iterator<char>(is), {});
  return p;
}

// "mapped" records: attempt, pid of the window's owner, whether it mapped every peer's process
// heap (1/0), then the failure text (empty: mapped).
std::string mapped_record(const std::string& attempt, int64_t pid, bool process_heaps, const std::string& failure) {
  return attempt + "\n" + std::to_string(pid) + "\n" + (process_heaps ? "1" : "0") + "\n" + failure;
}

}  // namespace

std::string host_key() {
  if (const char* id = std::getenv("TORCH_CAM_HOST_ID"); id != nullptr && *id != '\0') return std::string("id:") + id;
  return "boot:" + read_first_line("/proc/sys/kernel/random/boot_id") + "/shm:" + shm_device();
}

std::string host_name() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

int ShmHeap::sweep_stale_segments() {
  // Names are torch_cam.<uid>.<pid>.<random>; only this user's, only dead owners.
  const std::string mine = std::string(kNamePrefix) + std::to_string(getuid()) + ".";
  int removed = 0;
  DIR* d = opendir(kShmDir);
  if (!d) return 0;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.rfind(mine, 0) != 0) continue;
    auto dot = name.find('.', mine.size());
    if (dot == std::string::npos) continue;
    int64_t pid = std::atoll(name.substr(mine.size(), dot - mine.size()).c_str());
    if (pid > 0 && pid_gone(pid) && shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  closedir(d);
  return removed;
}

ShmHeap::ShmHeap(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                 WindowLayout layout, std::chrono::milliseconds timeout, std::string group)
    : rank_(rank), world_(world_size), where_(str("cam init of group ", group, " on rank ", rank)),
      layout_(layout), bases_(world_size, nullptr), peers_(world_size) {
  sweep_stale_segments();
  PeerInfo& me = peers_[rank_];
  me.pid = getpid();
  char state = 0;
  proc_stat(me.pid, &state, &me.start_time);
  me.host = host_key();
  me.shm_dev = shm_device();
  me.attempt = restart_attempt();
  try {
    own_process_heap_ = ProcessHeap::own(&process_heap_note_);
  } catch (const c10::Error& e) {
    process_heap_note_ = e.what_without_backtrace();  // the group works without it
  }
  if (own_process_heap_) {
    me.process_heap_fd = own_process_heap_->fd();
    me.process_heap_bytes = own_process_heap_->mapped_bytes();
  }
  me.segment = "/" + std::string(kNamePrefix) + std::to_string(getuid()) + "." +
               std::to_string(me.pid) + "." + random_hex();
  own_name_ = me.segment;
  bool published = false;
  try {
    create_own_window();
    me.window_addr = reinterpret_cast<uint64_t>(bases_[rank_]);
    store->set(window_key(rank_), to_bytes(serialize(me)));
    published = true;
    rendezvous(store, timeout);
  } catch (const std::exception&) {
    // Tell the peers why, under the key they wait on next, so that they fail now.
    const std::string why = error_text(std::current_exception());
    try {
      if (!published) {
        me.failure = why;
        store->set(window_key(rank_), to_bytes(serialize(me)));
      }
      store->set(mapped_key(rank_), to_bytes(mapped_record(me.attempt, me.pid, false, why)));
    } catch (const std::exception&) {
      // The store itself failed: the peers learn of it from their own store calls.
    }
    if (!own_unlinked_) shm_unlink(own_name_.c_str());
    own_unlinked_ = true;
    for (int r = 0; r < world_; ++r) {
      if (r != rank_ && peers_[r].pid > 0 && pid_gone(peers_[r].pid))
        shm_unlink(peers_[r].segment.c_str());
    }
    unmap_all();
    throw;
  }
}

std::string ShmHeap::current_record(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int r,
                                    std::chrono::steady_clock::time_point deadline, const char* what,
                                    const std::function<std::string(const std::string&)>& stale) {
  auto pause = std::chrono::milliseconds(1);
  std::string why_stale;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      store->wait({key}, std::max(left, std::chrono::milliseconds(1)));
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, where_, ": rank ", r, " did not ", what, " within the group timeout: ",
                  e.what_without_backtrace());
    }
    const auto bytes = store->get(key);
    std::string value(bytes.begin(), bytes.end());
    why_stale = stale(value);
    if (why_stale.empty()) return value;
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, where_, ": rank ", r, " did not ", what,
                " within the group timeout; the store holds only a stale record for it (", why_stale,
                "). A restarted job reusing the store (torchrun --max-restarts) is handled by "
                "TORCHELASTIC_RESTART_COUNT; otherwise give each attempt a fresh store "
                "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

ShmHeap::Mapped ShmHeap::mapped_record_of(const c10::intrusive_ptr<c10d::Store>& store, int r,
                                          std::chrono::steady_clock::time_point deadline) {
  const std::string& me = peers_[rank_].attempt;
  auto record = current_record(store, mapped_key(r), r, deadline, "map the heap", [&](const std::string& v) {
    std::istringstream is(v);
    std::string attempt, pid;
    std::getline(is, attempt);
    std::getline(is, pid);
    if (attempt != me || pid != std::to_string(peers_[r].pid)) return str("it is of attempt ", attempt, " and process ", pid);
    return std::string();
  });
  // attempt \n pid \n process heaps \n failure
  const size_t second = record.find('\n', record.find('\n') + 1);
  const size_t third = second == std::string::npos ? second : record.find('\n', second + 1);
  if (third == std::string::npos) return {};
  return {record.substr(third + 1), record.compare(second + 1, third - second - 1, "1") == 0};
}

void ShmHeap::rendezvous(const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout) {
  const PeerInfo& me = peers_[rank_];
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    auto record = current_record(store, window_key(r), r, deadline, "publish its window", [&](const std::string& v) {
      PeerInfo p = deserialize(to_bytes(v));
      if (p.attempt != me.attempt) return str("it is of restart attempt ", p.attempt, ", this rank's is ", me.attempt);
      // A failure record stays meaningful after its owner exits (it may exit right after).
      if (p.failure.empty() && p.host == me.host) return process_gone(p.pid, p.start_time);
      return std::string();
    });
    peers_[r] = deserialize(to_bytes(record));
    const PeerInfo& p = peers_[r];
    TORCH_CHECK(p.failure.empty(), where_, ": rank ", r, " could not set up its window: ", p.failure);
    TORCH_CHECK(p.host == me.host, where_, ": rank ", r, " runs on host '", p.host, "' but this rank runs on '",
                me.host, "'; the cam shared-memory transport needs every rank of a group on one host");
    TORCH_CHECK(p.shm_dev == me.shm_dev, where_, ": rank ", r, " sees a different /dev/shm (device ", p.shm_dev,
                " vs ", me.shm_dev, "); run the ranks in one container or share /dev/shm between them");
    int fd = shm_open(p.segment.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      // Most often the peer failed after publishing (and removed its window): say why.
      const int err = errno;
      const std::string why = mapped_record_of(store, r, deadline).failure;
      TORCH_CHECK(why.empty(), where_, ": rank ", r, " could not map the heap: ", why);
      TORCH_CHECK(false, where_, ": cannot open rank ", r, "'s window ", p.segment, ": ", std::strerror(err));
    }
    // A peer window laid out otherwise (other window options, another torch_cam) would fault
    // (SIGBUS) where this rank reads past its end: refuse it while it is still only a file.
    struct stat st{};
    const bool sized = fstat(fd, &st) == 0;
    if (!sized || uint64_t(st.st_size) != uint64_t(layout_.total_bytes())) {
      const int err = errno;
      ::close(fd);
      TORCH_CHECK(false, where_, ": rank ", r, "'s window is ", sized ? mib(double(st.st_size)) : std::strerror(err),
                  " but this rank lays it out in ", mib(layout_.total_bytes()),
                  "; window options must be equal on every rank of a group");
    }
    void* ptr = mmap(nullptr, layout_.total_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    ::close(fd);
    TORCH_CHECK(ptr != MAP_FAILED, where_, ": cannot map rank ", r, "'s window (", mib(layout_.total_bytes()),
                "): ", std::strerror(err));
    bases_[r] = static_cast<char*>(ptr);
    auto* h = layout_.header(bases_[r]);
    TORCH_CHECK(h->magic == kWindowMagic && h->world_size == world_ && h->rank == r, where_, ": rank ", r,
                "'s window has a different layout (was it built by another torch_cam version?)");
  }
  // Every peer is alive and its window exists now: the moment to probe direct reads.
  direct_read_ = probe_direct_read();
  if (process_heap_note_.empty()) process_heap_note_ = map_process_heaps();
  bool all_mapped = process_heap_note_.empty();
  store->set(mapped_key(rank_), to_bytes(mapped_record(me.attempt, me.pid, all_mapped, "")));
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const Mapped m = mapped_record_of(store, r, deadline);
    TORCH_CHECK(m.failure.empty(), where_, ": rank ", r, " could not map the heap: ", m.failure);
    if (!m.process_heaps && all_mapped) {
      all_mapped = false;
      process_heap_note_ = str("rank ", r, " could not map every peer's process heap");
    }
  }
  process_heaps_mapped_ = all_mapped;
  if (all_mapped && world_ > 1) heap_allocator_group_ready();
  shm_unlink(own_name_.c_str());
  own_unlinked_ = true;
}

void ShmHeap::create_own_window() {
  const size_t bytes = layout_.reserved_bytes();
  struct statvfs vfs {};
  if (statvfs(kShmDir, &vfs) == 0) {
    const double total = double(vfs.f_blocks) * vfs.f_frsize;
    const double avail = double(vfs.f_bavail) * vfs.f_frsize;
    TORCH_CHECK(double(bytes) <= avail, where_, ": the window needs ",
                mib(bytes), " of shared memory but ", kShmDir, " has only ", mib(avail),
                " free (of ", mib(total), "). Enlarge it (docker --shm-size, a memory-backed "
                "emptyDir) or lower TORCH_CAM_WINDOW_BYTES / Options.window_bytes");
  }
  int fd = shm_open(own_name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, where_, ": shm_open(", own_name_,
              ") failed: ", std::strerror(errno));
  int rc = ftruncate(fd, off_t(layout_.total_bytes()));
  if (rc == 0) rc = posix_fallocate(fd, 0, off_t(bytes));
  else rc = errno;
  if (rc != 0) {
    ::close(fd);
    shm_unlink(own_name_.c_str());
    own_unlinked_ = true;
    TORCH_CHECK(false, where_, ": cannot reserve ", mib(bytes),
                " of shared memory in ", kShmDir, " for this rank's window: ",
                std::strerror(rc), ". Enlarge ", kShmDir,
                " or lower TORCH_CAM_WINDOW_BYTES / Options.window_bytes");
  }
  // The arena stays sparse: its pages are reserved by TensorArena as tensors are allocated.
  void* ptr = mmap(nullptr, layout_.total_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  if (ptr == MAP_FAILED) ::close(fd);
  TORCH_CHECK(ptr != MAP_FAILED, where_, ": cannot map own window: ",
              std::strerror(err));
  madvise(ptr, bytes, MADV_WILLNEED);
  bases_[rank_] = static_cast<char*>(ptr);
  // Heap-resident tensors keep the mapping alive past the group (the arena holds it).
  const size_t total = layout_.total_bytes();
  auto mapping = std::shared_ptr<void>(ptr, [total](void* p) { munmap(p, total); });
  arena_ = std::make_shared<TensorArena>(std::move(mapping), layout_.arena(bases_[rank_]),
                                         layout_.arena_bytes(), fd, off_t(bytes), rank_);
  std::memset(bases_[rank_], 0, layout_.control_bytes());
  auto* h = layout_.header(bases_[rank_]);
  h->rank = rank_;
  h->world_size = world_;
  h->pid = getpid();
  h->data_bytes = int64_t(bytes - layout_.control_bytes());
  signal_release(h->magic, kWindowMagic);
}

bool ShmHeap::probe_direct_read() const {
  // Refused where ptrace is restricted (Yama scope 2-3, seccomp in some containers, different
  // user namespaces): then every transfer stages through the windows.
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    uint64_t magic = 0;
    iovec local{&magic, sizeof(magic)};
    iovec remote{reinterpret_cast<void*>(peers_[r].window_addr), sizeof(magic)};
    if (process_vm_readv(pid_t(peers_[r].pid), &local, 1, &remote, 1, 0) != ssize_t(sizeof(magic)) ||
        magic != kWindowMagic)
      return false;
  }
  return true;
}

void ShmHeap::read_peer(int r, void* local, uint64_t remote_addr, size_t n) const {
  char* dst = static_cast<char*>(local);
  while (n > 0) {
    iovec l{dst, n};
    iovec rem{reinterpret_cast<void*>(remote_addr), n};
    ssize_t got = process_vm_readv(pid_t(peers_[r].pid), &l, 1, &rem, 1, 0);
    if (got <= 0) {
      const int err = errno;
      const std::string dead = peer_failure(r);
      if (!dead.empty()) {
        throw FatalError(str("cam on rank ", rank_, ": peer rank ", r, " died (", dead,
                             ") while this rank was reading its data directly"));
      }
      throw FatalError(str("cam on rank ", rank_, ": direct read of ", n, " bytes from rank ", r,
                           " (pid ", peers_[r].pid, ") failed: ", std::strerror(err)));
    }
    dst += got;
    remote_addr += uint64_t(got);
    n -= size_t(got);
  }
}

std::string ShmHeap::map_process_heaps() {
  process_heaps_.assign(world_, nullptr);
  for (int r = 0; r < world_; ++r) {
    const PeerInfo& p = peers_[r];
    std::string why;
    process_heaps_[r] = map_process_heap(p.pid, p.start_time, p.process_heap_fd, p.process_heap_bytes, &why);
    if (!process_heaps_[r]) return str("cannot map rank ", r, "'s process heap: ", why);
  }
  return "";
}

int64_t ShmHeap::heap_offset(const void* p, int64_t n) const {
  if (const int64_t off = arena_ ? arena_->offset_of(p, n) : -1; off >= 0) return off;
  if (!process_heaps_mapped_) return -1;
  const int64_t off = own_process_heap_->arena().offset_of(p, n);
  return off < 0 ? -1 : off | kProcessHeapTag;
}

char* ShmHeap::peer_heap(int r, int64_t off) const {
  if (off & kProcessHeapTag) return const_cast<char*>(process_heaps_[r]->arena_base) + (off & ~kProcessHeapTag);
  return layout_.arena(bases_[r]) + off;
}

std::string ShmHeap::peer_failure(int r) const { return process_gone(peers_[r].pid, peers_[r].start_time); }

std::string ShmHeap::reported_failure(int r) const {
  const ErrorReport* rep = layout_.error(bases_[r]);
  if (signal_acquire(rep->seq) == 0) return std::string();
  return std::string(rep->text, strnlen(rep->text, kErrorTextBytes));
}

void ShmHeap::report_failure(const std::string& why) {
  ErrorReport* rep = layout_.error(bases_[rank_]);
  if (signal_relaxed(rep->seq) != 0) return;
  std::snprintf(rep->text, kErrorTextBytes, "%s", why.c_str());
  signal_release(rep->seq, 1);
}

void ShmHeap::park(int64_t timeout_us, const std::function<Idleness()>& still_idle) {
  park_on(*layout_.bell(bases_[rank_]), timeout_us, still_idle);
}

void ShmHeap::ring_parked_peers() {
  fence_before_ring();
  const PeerMask me = peer_bit(rank_);
  for (int r = 0; r < world_; ++r) {
    if (r != rank_) ring_if_parked(*layout_.bell(bases_[r]), me);
  }
}

void ShmHeap::unmap_all() {
  for (int r = 0; r < world_; ++r) {
    if (bases_[r] && r != rank_) munmap(bases_[r], layout_.total_bytes());
    bases_[r] = nullptr;
  }
  arena_.reset();  // the own window goes once the last heap-resident tensor is freed
  process_heaps_.clear();
  process_heaps_mapped_ = false;
}

ShmHeap::~ShmHeap() {
  if (!own_unlinked_) shm_unlink(own_name_.c_str());
  unmap_all();
}

}  // namespace cam
