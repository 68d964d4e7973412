// Python module torch_cam._C: the backend class and its factory. Registration with
// torch.distributed happens in torch_cam/__init__.py (Python), never at library load.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/python.h>

#include "../backend/cam_backend.hpp"
#include "../backend/hierarchical_backend.hpp"
#include "../backend/one_sided_backend.hpp"
#include "../transport/loopback_transport.hpp"
#ifdef CAM_HAVE_UCX
#include "../backend/ucx_p2p_backend.hpp"
#include "../transport/ucx_arena_link.hpp"
#include "../transport/ucx_transport.hpp"
#endif
#include "../transport/heap_allocator.hpp"
#include "../transport/shm_heap.hpp"
#include "../transport/wait_policy.hpp"
#include "../../kernels/copy.hpp"
#include "moe_op_bindings.hpp"

namespace py = pybind11;

#ifdef CAM_HAVE_UCX
namespace {
// The UCX settings of an inter-host part of a spanning group, from the group's cam options.
cam::UcxOptions ucx_options(int rank, int size, double timeout_s, const std::map<std::string, std::string>& options,
                            const std::string& group_desc, const std::vector<std::string>& names) {
  auto config = cam::CamConfig::from_map(options, std::chrono::milliseconds(int64_t(timeout_s * 1000.0)));
  config.validate(size);
  cam::UcxOptions o;
  o.rank = rank;
  o.size = size;
  o.timeout = config.timeout;
  o.liveness_interval_ms = config.liveness_interval_ms;
  o.spin_us = config.spin_us;
  o.group_desc = group_desc;
  o.names = names;
  return o;
}
}  // namespace
#endif

void bind_kv(py::module& m);  // kv_bindings.cpp
void bind_afd(py::module& m);  // afd_bindings.cpp
void bind_hosts_moe(py::module& m);  // hosts_moe_bindings.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_cam native backend";
  py::class_<cam::CamBackend, c10d::Backend, c10::intrusive_ptr<cam::CamBackend>> cam_backend(m, "CamBackend");
  cam_backend
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       double timeout_s, const std::map<std::string, std::string>& options,
                       const std::string& group_id, const std::string& group_desc) {
             auto timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000.0));
             auto cfg = cam::CamConfig::from_map(options, timeout);
             return c10::make_intrusive<cam::CamBackend>(store, rank, size, std::move(cfg), group_id, group_desc);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
           py::arg("options"), py::arg("group_id"), py::arg("group_desc") = "", py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("config", &cam::CamBackend::config_string)
      .def_property_readonly("group_id", &cam::CamBackend::group_id)
      .def_property_readonly(
          "timeout_s", [](const cam::CamBackend& b) { return b.timeout_ms() / 1000.0; },
          "The group's timeout, which bounds every wait")
      .def_property_readonly("heap_bytes", &cam::CamBackend::window_bytes_mapped,
                             "Bytes of symmetric heap this rank maps (all windows of the group)")
      .def_property_readonly("direct_read_available", &cam::CamBackend::direct_read_available,
                             "Whether this rank can read peers' memory directly (single-copy path)")
      .def_property_readonly("process_heap_problem", &cam::CamBackend::process_heap_problem,
                             "'' when tensors of the heap allocator mode are read in place by this group, else why not")
      .def(
          "empty",
          [](cam::CamBackend& b, const std::vector<int64_t>& sizes, py::object dtype) {
            TORCH_CHECK(THPDtype_Check(dtype.ptr()), "torch_cam.empty: dtype must be a torch.dtype");
            return b.empty(sizes, reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
          },
          py::arg("sizes"), py::arg("dtype"),
          "A tensor in this rank's tensor heap (peers read it in place in collectives)")
      .def(
          "owns",
          [](cam::CamBackend& b, const at::Tensor& t) { return b.owns(t); }, py::arg("tensor"),
          "Whether the tensor's memory lies in this rank's tensor heap")
      .def(
          "all_reduce_",
          [](cam::CamBackend& b, at::Tensor t, int op) {
            // The blocking all_reduce without torch.distributed's Python layer and Work
            // object: for latency-bound callers (tensor-parallel inference).
            std::vector<at::Tensor> ts{t};
            c10d::AllreduceOptions opts;
            opts.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
            b.allreduce(ts, opts)->wait();
            return t;
          },
          py::arg("tensor"), py::arg("op"), py::call_guard<py::gil_scoped_release>(),
          "In-place blocking all_reduce of one tensor; op is a ReduceOp code")
      .def(
          "refuse",
          [](cam::CamBackend& b, const std::string& kind, const std::string& op, const std::string& reason) {
            b.refuse(kind, op, reason);
          },
          py::arg("kind"), py::arg("op"), py::arg("reason"), py::call_guard<py::gil_scoped_release>(),
          "Takes part in this rank's next collective (kind: 'moe_dispatch', 'all_reduce', ...) as a refusal of "
          "its arguments: every peer's op fails at once naming this rank and the reason; raises here")
      .def(
          "moe_empty",
          [](cam::CamBackend& b, const std::vector<int64_t>& sizes, py::object dtype) {
            return b.moe().empty(sizes, reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
          },
          py::arg("sizes"), py::arg("dtype"), "An MoE output tensor from the recycling pool")
      .def("peer_arena_view", &cam::CamBackend::peer_arena_view, py::arg("rank"), py::arg("offset"),
           py::arg("nbytes"), "Bytes of a peer's tensor heap, mapped here (one-sided access)")
      .def("arena_offset", &cam::CamBackend::arena_offset, py::arg("tensor"),
           "Offset of a heap tensor in this rank's tensor heap, or -1")
      .def("peer_failure", &cam::CamBackend::peer_failure, py::arg("rank"),
           "Why a peer is considered dead; empty while it is alive")
      .def("wait_signal", &cam::CamBackend::wait_signal, py::arg("peer"), py::arg("counters"), py::arg("index"),
           py::arg("target"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "Wait until counters[index] >= target: '' when reached, 'timeout', or why the peer is unusable")
      .def("ring_parked_peers", &cam::CamBackend::ring_parked_peers,
           "Wake the peers parked waiting for this rank's signals (after signal_store)")
      .def("stats", &cam::CamBackend::stats,
           "Heap sizes and bytes moved per path (staged through windows, read directly)");
  cam::python::def_moe_ops(
      cam_backend,
      [](cam::CamBackend& b, cam::MoeDispatchArgs a, std::chrono::milliseconds timeout) {
        return b.moe().dispatch(std::move(a), timeout);
      },
      [](cam::CamBackend& b, cam::MoeCombineArgs a, std::chrono::milliseconds timeout) {
        return b.moe().combine(std::move(a), timeout);
      });
  bind_kv(m);
  bind_afd(m);
  bind_hosts_moe(m);
  // 64-bit signals in shared tensors (extensions' control blocks): a release store after the
  // data it publishes, an acquire load before reading it (csrc/transport/signal.hpp).
  m.def(
      "signal_store",
      [](const at::Tensor& t, int64_t index, int64_t value) {
        TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && index >= 0 && index < t.numel(),
                    "cam signal_store: expected a contiguous int64 tensor and an index inside it");
        cam::kernels::store_fence();  // copies before it may have used non-temporal stores
        cam::signal_release(reinterpret_cast<uint64_t*>(t.data_ptr<int64_t>())[index], uint64_t(value));
      },
      py::arg("tensor"), py::arg("index"), py::arg("value"));
  m.def(
      "signal_load",
      [](const at::Tensor& t, int64_t index) {
        TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && index >= 0 && index < t.numel(),
                    "cam signal_load: expected a contiguous int64 tensor and an index inside it");
        return int64_t(cam::signal_acquire(reinterpret_cast<const uint64_t*>(t.data_ptr<int64_t>())[index]));
      },
      py::arg("tensor"), py::arg("index"));
  m.def("set_trace_rank", &cam::FlightRecorder::set_process_rank, py::arg("rank"),
        "The global rank flight-recorder dumps carry and are named by");
  m.def("flight_recorder_json", &cam::FlightRecorder::dump_json, py::arg("reason"),
        "Every live group's flight recorder as one JSON document");
  m.def(
      "dump_flight_recorder",
      [](const std::string& path, const std::string& reason) {
        const std::string err = cam::FlightRecorder::dump_to(path, reason);
        TORCH_CHECK(err.empty(), "torch_cam.dump_flight_recorder: ", err);
      },
      py::arg("path"), py::arg("reason"));
  m.def("set_heap_allocator", &cam::set_heap_allocator, py::arg("min_bytes"),
        "Born-in-the-heap CPU tensors from min_bytes up (<= 0: restore the previous allocator)");
  m.def("heap_allocator_stats", &cam::heap_allocator_stats, "The heap allocator mode's counters");
  m.def("sweep_stale_segments", &cam::ShmHeap::sweep_stale_segments,
        "Remove /dev/shm names left by cam processes of this user that no longer exist");
  m.def("host_key", &cam::host_key,
        "This process's host identity: ranks with equal keys share a kernel and /dev/shm (TORCH_CAM_HOST_ID overrides)");
  m.def("host_name", &cam::host_name, "This machine's hostname (for messages)");
  m.def(
      "host_map",
      [](const std::vector<std::string>& keys, const std::vector<std::string>& hostnames) {
        const auto m = cam::HostMap::from_keys(keys, hostnames);
        return py::dict(py::arg("host_of") = m.host_of, py::arg("local_of") = m.local_of, py::arg("ranks") = m.ranks,
                        py::arg("names") = m.names);
      },
      py::arg("keys"), py::arg("hostnames"),
      "How a group of ranks with these host keys is split into hosts (the numbering every part uses)");
  py::class_<cam::HierarchicalBackend, c10d::Backend, c10::intrusive_ptr<cam::HierarchicalBackend>>(
      m, "HierarchicalBackend", "The cam backend of a group whose ranks span hosts")
      .def(py::init([](int rank, int size, const std::vector<std::string>& host_keys,
                       const std::vector<std::string>& host_names, const c10::intrusive_ptr<cam::CamBackend>& local,
                       const c10::intrusive_ptr<c10d::Backend>& all,
                       const c10::intrusive_ptr<c10d::Backend>& collectives,
                       const c10::intrusive_ptr<c10d::Backend>& rail,
                       const c10::intrusive_ptr<c10d::Backend>& leaders, const c10::intrusive_ptr<c10d::Backend>& p2p,
                       const c10::intrusive_ptr<c10d::Store>& store, const std::string& group_desc) {
             return c10::make_intrusive<cam::HierarchicalBackend>(
                 rank, size, cam::HostMap::from_keys(host_keys, host_names), local,
                 cam::HierarchicalBackend::InterHost{all, collectives, rail, leaders, p2p}, store, group_desc);
           }),
           py::arg("rank"), py::arg("size"), py::arg("host_keys"), py::arg("host_names"), py::arg("local"),
           py::arg("all"), py::arg("collectives"), py::arg("rail"), py::arg("leaders"), py::arg("p2p"),
           py::arg("store"), py::arg("group_desc"))
      .def_property_readonly("host_names", [](const cam::HierarchicalBackend& b) { return b.host_map().names; })
      .def_property_readonly("inter_host_engine", &cam::HierarchicalBackend::inter_host_engine,
                             "The engine of its collectives between hosts: \"cam-ucx\" or \"gloo\"")
      .def_property_readonly("host_ranks", [](const cam::HierarchicalBackend& b) { return b.host_map().ranks; },
                             "The group ranks on each host, hosts in order of their lowest rank")
      .def_property_readonly("host_of", [](const cam::HierarchicalBackend& b) { return b.host_map().host_of; },
                             "Group rank -> its host's index")
      .def_property_readonly("local_of", [](const cam::HierarchicalBackend& b) { return b.host_map().local_of; },
                             "Group rank -> its rank among its host's ranks")
      .def_property_readonly("local", &cam::HierarchicalBackend::local,
                             "The cam backend of this rank's host (its heap and engine)")
      .def_property_readonly("store", &cam::HierarchicalBackend::store, "The group's store");

  py::class_<cam::LoopbackFabric, std::shared_ptr<cam::LoopbackFabric>>(
      m, "LoopbackFabric", "Control windows of ranks that are threads of this process (tests of the inter-host engine)")
      .def(py::init([](int size, double timeout_s) {
             return std::make_shared<cam::LoopbackFabric>(size, std::chrono::milliseconds(int64_t(timeout_s * 1000.0)));
           }),
           py::arg("size"), py::arg("timeout_s"))
      .def("mark_dead", &cam::LoopbackFabric::mark_dead, py::arg("rank"),
           "Every other rank's wait raises as for a lost endpoint")
      .def("fail_posts_to", &cam::LoopbackFabric::fail_posts_to, py::arg("rank"),
           "Every post to this rank raises as a failed put");
  py::class_<cam::OneSidedBackend, c10d::Backend, c10::intrusive_ptr<cam::OneSidedBackend>>(
      m, "OneSidedBackend", "The inter-host engine of a spanning group, over one-sided operations")
      .def_static(
          "over_loopback",
          [](const std::shared_ptr<cam::LoopbackFabric>& fabric, int rank) {
            return c10::make_intrusive<cam::OneSidedBackend>(std::make_unique<cam::LoopbackTransport>(fabric, rank));
          },
          py::arg("fabric"), py::arg("rank"))
#ifdef CAM_HAVE_UCX
      .def_static(
          "over_ucx",
          [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s,
             const std::map<std::string, std::string>& options, const std::string& group_desc,
             const std::vector<std::string>& names) {
            const cam::UcxOptions o = ucx_options(rank, size, timeout_s, options, group_desc, names);
            return c10::make_intrusive<cam::OneSidedBackend>(std::make_unique<cam::UcxTransport>(store, o));
          },
          py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("options"),
          py::arg("group_desc"), py::arg("names"), py::call_guard<py::gil_scoped_release>())
#endif
      ;
#ifdef CAM_HAVE_UCX
  py::class_<cam::UcxP2PBackend, c10d::Backend, c10::intrusive_ptr<cam::UcxP2PBackend>>(
      m, "UcxP2PBackend", "Point-to-point between the hosts of a spanning group, over UCX's tagged messages")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s,
                       const std::map<std::string, std::string>& options, const std::string& group_desc,
                       const std::vector<std::string>& names) {
             return c10::make_intrusive<cam::UcxP2PBackend>(
                 store, ucx_options(rank, size, timeout_s, options, group_desc, names));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("options"),
           py::arg("group_desc"), py::arg("names"), py::call_guard<py::gil_scoped_release>());
  py::class_<cam::UcxArenaLink, std::shared_ptr<cam::UcxArenaLink>>(
      m, "UcxArenaLink", "Every rank's tensor heap of a group across hosts, reached over UCX (KV and weight transfer)")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s,
                       cam::CamBackend& host, const std::string& group_desc, const std::vector<std::string>& names) {
             const auto& cfg = host.engine()->config();
             cam::UcxOptions o;
             o.rank = rank;
             o.size = size;
             o.timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000.0));
             o.liveness_interval_ms = cfg.liveness_interval_ms;
             o.spin_us = cfg.spin_us;
             o.group_desc = group_desc;
             o.names = names;
             const auto& heap = host.engine()->heap();
             return std::make_shared<cam::UcxArenaLink>(store, o, heap.layout().arena(heap.base(heap.rank())),
                                                        cfg.tensor_heap_bytes);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("host"),
           py::arg("group_desc"), py::arg("names"), py::call_guard<py::gil_scoped_release>())
      .def(
          "read",
          [](cam::UcxArenaLink& l, const std::vector<std::tuple<int, int64_t, at::Tensor>>& reads,
             const std::string& what) {
            std::vector<cam::UcxArenaLink::Read> rs;
            for (const auto& [peer, offset, dst] : reads) {
              TORCH_CHECK_VALUE(dst.is_contiguous() && dst.device().is_cpu(), what,
                                ": a read lands in a contiguous CPU tensor");
              rs.push_back({peer, offset, dst.data_ptr(), int64_t(dst.nbytes())});
            }
            py::gil_scoped_release nogil;
            l.read(rs, what);
          },
          py::arg("reads"), py::arg("what"),
          "Fills each (peer, offset, dst) with dst.nbytes bytes of peer's tensor heap at offset (UCX gets, "
          "all issued, then completed)")
      .def(
          "write",
          [](cam::UcxArenaLink& l, const std::vector<std::tuple<int, int64_t, at::Tensor>>& data,
             const std::vector<std::tuple<int, int64_t, at::Tensor>>& after, const std::string& what) {
            auto writes = [&](const std::vector<std::tuple<int, int64_t, at::Tensor>>& list) {
              std::vector<cam::UcxArenaLink::Write> ws;
              for (const auto& [peer, offset, src] : list) {
                TORCH_CHECK_VALUE(src.is_contiguous() && src.device().is_cpu(), what,
                                  ": a write takes a contiguous CPU tensor");
                ws.push_back({peer, offset, src.data_ptr(), int64_t(src.nbytes())});
              }
              return ws;
            };
            auto d = writes(data), a = writes(after);
            py::gil_scoped_release nogil;
            l.write(d, a, what);
          },
          py::arg("data"), py::arg("after"), py::arg("what"),
          "Puts each (peer, offset, src) of data into peer's tensor heap at offset, then (fenced after them) "
          "each of after; completed before returning")
      .def("peer_failure", &cam::UcxArenaLink::peer_failure, py::arg("peer"), py::call_guard<py::gil_scoped_release>(),
           "Why peer is unreachable over UCX; empty while its endpoint is up")
      .def(
          "wait_signal",
          [](cam::UcxArenaLink& l, int peer, const at::Tensor& counters, int64_t index, int64_t target,
             double timeout_s) {
            TORCH_CHECK(counters.scalar_type() == at::kLong && counters.is_contiguous() && index >= 0 &&
                            index < counters.numel(),
                        "cam wait_signal: expected a contiguous int64 tensor and an index inside it");
            const auto& counter = reinterpret_cast<const uint64_t*>(counters.data_ptr<int64_t>())[index];
            py::gil_scoped_release nogil;
            return l.wait_signal(counter, uint64_t(target), timeout_s, peer);
          },
          py::arg("peer"), py::arg("counters"), py::arg("index"), py::arg("target"), py::arg("timeout_s"),
          "Wait until counters[index] (this rank's memory, put by peer over UCX) >= target: '' when reached, "
          "'timeout', or why the peer is unreachable");
#endif
#ifdef CAM_HAVE_UCX
  m.attr("ucx_version") = cam::ucx_version();
#else
  m.attr("ucx_version") = py::none();
#endif
}
