// torch_cam._C's KV-transfer part: the layout and block-id conversions from Python, the local
// block copy (torch_cam.kv.copy_blocks) and the KVTransfer class (torch_cam/kv.py wraps both).
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include "../backend/cam_backend.hpp"
#include "../core/config.hpp"
#include "../kv/kv_transfer.hpp"
#ifdef CAM_HAVE_UCX
#include "../kv/kv_peer_ucx.hpp"
#endif

#include <optional>

namespace py = pybind11;

namespace {
using cam::kv::BlockIds;
using cam::kv::KVLayoutDesc;

// A torch_cam.kv_reference.KVLayout as the native descriptor.
KVLayoutDesc layout_desc(py::handle L) {
  KVLayoutDesc d;
  const auto kind = L.attr("kind").cast<std::string>();
  d.mla = kind == "mla";
  d.num_layers = L.attr("num_layers").cast<int64_t>();
  d.num_blocks = L.attr("num_blocks").cast<int64_t>();
  d.block_size = L.attr("block_size").cast<int64_t>();
  d.num_kv_heads = L.attr("num_kv_heads").cast<int64_t>();
  d.head_dim = L.attr("head_dim").cast<int64_t>();
  py::object dtype = L.attr("dtype");
  TORCH_CHECK_VALUE(THPDtype_Check(dtype.ptr()), "KVLayout.dtype must be a torch.dtype");
  d.dtype = int64_t(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
  d.hnd = L.attr("order").cast<std::string>() == "HND";
  d.tp_rank = L.attr("tp_rank").cast<int64_t>();
  d.tp_size = L.attr("tp_size").cast<int64_t>();
  d.total_kv_heads = L.attr("total_kv_heads").cast<int64_t>();
  return d;
}

py::dict layout_fields(const KVLayoutDesc& d) {
  py::dict f;
  f["kind"] = d.mla ? "mla" : "mha";
  f["num_layers"] = d.num_layers;
  f["num_blocks"] = d.num_blocks;
  f["block_size"] = d.block_size;
  f["num_kv_heads"] = d.num_kv_heads;
  f["head_dim"] = d.head_dim;
  f["dtype"] = py::reinterpret_borrow<py::object>(
      reinterpret_cast<PyObject*>(torch::getTHPDtype(c10::ScalarType(d.dtype))));
  f["order"] = d.hnd ? "HND" : "NHD";
  f["tp_rank"] = d.tp_rank;
  f["tp_size"] = d.tp_size;
  f["total_kv_heads"] = d.total_kv_heads;
  return f;
}

// Block ids from a 1-D integer tensor (read in place when int64 and contiguous) or a sequence of
// ints (read without building Python objects: a list of 1024 ids costs a few microseconds).
struct IdsArg {
  std::vector<int64_t> owned;
  at::Tensor tensor;
  BlockIds view{nullptr, 0};

  IdsArg(py::handle obj, const char* what) {
    if (THPVariable_Check(obj.ptr())) {
      const at::Tensor& t = THPVariable_Unpack(obj.ptr());
      TORCH_CHECK_VALUE(t.dim() == 1 && !at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kBool &&
                            !at::isComplexType(t.scalar_type()),
                        what, " must be a 1-D integer tensor or a sequence of ints");
      tensor = t.to(at::kCPU, at::kLong).contiguous();
      view = {tensor.data_ptr<int64_t>(), tensor.numel()};
      return;
    }
    PyObject* seq = PySequence_Fast(obj.ptr(), "block ids must be a sequence");
    if (seq == nullptr) throw py::error_already_set();
    py::object keep = py::reinterpret_steal<py::object>(seq);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    owned.resize(size_t(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* x = items[i];
      int overflow = 0;
      long long v = 0;
      if (PyLong_CheckExact(x)) {
        v = PyLong_AsLongLongAndOverflow(x, &overflow);
      } else {
        TORCH_CHECK_VALUE(!PyBool_Check(x) && !PyFloat_Check(x) && PyIndex_Check(x), what, " must hold ints, got ",
                          py::repr(x).cast<std::string>());
        py::object idx = py::reinterpret_steal<py::object>(PyNumber_Index(x));
        if (!idx) throw py::error_already_set();
        v = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
      }
      TORCH_CHECK_INDEX(overflow == 0, what, "[", i, "] does not fit in 64 bits");
      owned[size_t(i)] = v;
    }
    view = {owned.data(), int64_t(n)};
  }
};

// layers: None (all), an int, or a sequence of ints.
std::pair<std::vector<int64_t>, bool> layers_arg(py::handle obj) {
  if (obj.is_none()) return {{}, true};
  auto one = [](py::handle x) {
    TORCH_CHECK_VALUE(PyLong_Check(x.ptr()) && !PyBool_Check(x.ptr()), "layers must hold ints, got ",
                      py::repr(x).cast<std::string>());
    return x.cast<int64_t>();
  };
  if (PyLong_Check(obj.ptr())) return {{one(obj)}, false};
  std::vector<int64_t> out;
  for (py::handle x : obj) out.push_back(one(x));
  return {out, false};
}

std::vector<char*> bases(const std::vector<at::Tensor>& pools, const KVLayoutDesc& L, const char* what) {
  TORCH_CHECK_VALUE(int64_t(pools.size()) == L.num_layers, what, " must hold ", L.num_layers,
                    " per-layer tensors, got ", pools.size());
  std::vector<char*> out;
  for (size_t l = 0; l < pools.size(); ++l) {
    const at::Tensor& t = pools[l];
    L.check_pool(t, cam::str(what, "[", l, "]"));
    out.push_back(static_cast<char*>(t.data_ptr()));
  }
  return out;
}
}  // namespace

void bind_kv(py::module& m) {
  py::register_local_exception<cam::kv::KVTimeout>(m, "KVTimeout", PyExc_TimeoutError);
  m.def(
      "kv_copy_blocks",
      [](const std::vector<at::Tensor>& src_pools, py::handle src_layout, py::handle src_ids,
         const std::vector<at::Tensor>& dst_pools, py::handle dst_layout, py::handle dst_ids, int64_t num_tokens,
         py::handle layers) {
        const KVLayoutDesc s = layout_desc(src_layout), d = layout_desc(dst_layout);
        IdsArg si(src_ids, "src_block_ids"), di(dst_ids, "dst_block_ids");
        auto [ls, all] = layers_arg(layers);
        cam::kv::KVCopyPlan plan(s, si.view, d, di.view, num_tokens, std::move(ls), all);
        const auto sb = bases(src_pools, s, "src_pools"), db = bases(dst_pools, d, "dst_pools");
        py::gil_scoped_release nogil;
        int64_t n = 0;
        for (int64_t l : plan.layers()) n += plan.copy_layer(sb[size_t(l)], db[size_t(l)]);
        return n;
      },
      py::arg("src_pools"), py::arg("src_layout"), py::arg("src_block_ids"), py::arg("dst_pools"),
      py::arg("dst_layout"), py::arg("dst_block_ids"), py::arg("num_tokens"), py::arg("layers"),
      "Checked, planned KV block copy between two local pool lists (torch_cam.kv.copy_blocks)");
  m.def(
      "kv_plan_pieces",
      [](py::handle src_layout, py::handle dst_layout) {
        std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
        for (const auto& p : cam::kv::plan_pieces(layout_desc(src_layout), layout_desc(dst_layout)))
          out.emplace_back(p.src_head, p.dst_head, p.heads);
        return out;
      },
      "The native head plan: (src head, dst head, heads) this source rank feeds the destination rank");

  py::class_<cam::kv::KVTransferJob, std::shared_ptr<cam::kv::KVTransferJob>>(m, "KVTransferJob")
      .def_property_readonly("done", &cam::kv::KVTransferJob::done)
      .def_property_readonly("nbytes", &cam::kv::KVTransferJob::nbytes)
      .def_property_readonly("error", &cam::kv::KVTransferJob::error)
      .def_property_readonly("timed_out", &cam::kv::KVTransferJob::timed_out)
      .def_property_readonly("what", &cam::kv::KVTransferJob::what)
      .def("layer_done", &cam::kv::KVTransferJob::layer_done)
      .def("failed_blocks", &cam::kv::KVTransferJob::failed_blocks);


  py::class_<cam::kv::KVTransfer, std::shared_ptr<cam::kv::KVTransfer>>(m, "KVTransfer")
      .def(py::init([](cam::CamBackend& b, double timeout_s, int rank, int world) {
             return std::make_shared<cam::kv::KVTransfer>(
                 b.engine(), std::chrono::milliseconds(int64_t(timeout_s * 1000.0)), rank, world);
           }),
           py::arg("backend"), py::arg("timeout_s"), py::arg("rank") = -1, py::arg("world") = -1,
           "backend: the group's cam backend, or for a group across hosts its host's (then rank, world: in the "
           "group)")
      .def_property_readonly("control_offset", &cam::kv::KVTransfer::control_offset)
      .def("connect", py::overload_cast<const std::vector<int64_t>&>(&cam::kv::KVTransfer::connect),
           py::arg("offsets"))
#ifdef CAM_HAVE_UCX
      .def(
          "connect_across_hosts",
          [](cam::kv::KVTransfer& t, const std::vector<int64_t>& offsets, const std::vector<int>& local_of,
             cam::CamBackend& host, const std::shared_ptr<cam::UcxArenaLink>& link) {
            const cam::SymmetricHeap& heap = host.engine()->heap();
            const int64_t cap = host.engine()->config().tensor_heap_bytes;
            TORCH_CHECK_VALUE(int64_t(local_of.size()) == t.world(), "expected ", t.world(), " entries in local_of");
            t.connect(offsets, [&](int r, int64_t off) -> std::unique_ptr<cam::kv::KVPeer> {
              if (local_of[size_t(r)] >= 0)
                return std::make_unique<cam::kv::MappedKVPeer>(heap, local_of[size_t(r)], off, cap);
              return std::make_unique<cam::kv::UcxKVPeer>(link, r, off);
            });
          },
          py::arg("offsets"), py::arg("local_of"), py::arg("host"), py::arg("link"),
          "local_of[r]: rank r's index in this host's heap, or -1 when it is on another host (reached over link)")
#endif
      .def(
          "register",
          [](cam::kv::KVTransfer& t, const std::vector<at::Tensor>& pools, py::handle layout) {
            return int64_t(t.register_pools(pools, layout_desc(layout)));
          },
          py::arg("pools"), py::arg("layout"))
      .def(
          "peer_registration",
          [](cam::kv::KVTransfer& t, int peer) {
            std::pair<uint64_t, KVLayoutDesc> r;
            {
              py::gil_scoped_release nogil;
              r = t.peer_registration(peer);
            }
            return py::make_tuple(int64_t(r.first), r.first == 0 ? py::object(py::none()) : layout_fields(r.second),
                                  t.peer_offsets(peer));
          },
          py::arg("peer"))
      .def(
          "transfer",
          [](cam::kv::KVTransfer& t, int64_t kind, int peer, py::handle src_ids, py::handle dst_ids,
             int64_t num_tokens, py::handle layers, py::bytes request_id, int64_t expect_version, bool async_op) {
            const std::string rid = request_id;
            std::optional<IdsArg> si, di;
            std::pair<std::vector<int64_t>, bool> ls;
            try {
              si.emplace(src_ids, "src_block_ids");
              di.emplace(dst_ids, "dst_block_ids");
              ls = layers_arg(layers);
            } catch (const c10::Error& e) {
              // Ids that cannot be read fail the peer's wait too; the error keeps its type and
              // names the transfer.
              std::string msg;
              {
                py::gil_scoped_release nogil;
                msg = t.refuse(kind, peer, rid, e.msg());
              }
              cam::kv::throw_like(e, msg);
            } catch (py::error_already_set& e) {
              std::string msg;
              {
                py::gil_scoped_release nogil;
                msg = t.refuse(kind, peer, rid, e.what());
              }
              throw py::type_error(msg);
            }
            py::gil_scoped_release nogil;
            auto job = t.prepare(kind, peer, si->view, di->view, num_tokens, std::move(ls.first), ls.second, rid,
                                 expect_version);
            c10::intrusive_ptr<c10d::Work> work;
            if (async_op) work = t.submit(job);
            else t.run(*job);
            return std::make_pair(job, work);
          },
          py::arg("kind"), py::arg("peer"), py::arg("src_ids"), py::arg("dst_ids"), py::arg("num_tokens"),
          py::arg("layers"), py::arg("request_id"), py::arg("expect_version"), py::arg("async_op"))
      .def(
          "poll",
          [](cam::kv::KVTransfer& t) {
            std::vector<cam::kv::KVNotification> ns;
            {
              py::gil_scoped_release nogil;
              ns = t.poll();
            }
            py::list out;
            for (auto& n : ns)
              out.append(py::make_tuple(n.peer, py::bytes(n.request_id), n.kind, n.status, n.nbytes,
                                        py::str(n.message)));
            return out;
          })
      .def(
          "wait_notification",
          [](cam::kv::KVTransfer& t, py::bytes request_id, int peer, double timeout_s) {
            const std::string rid = request_id;
            cam::kv::KVNotification n;
            {
              py::gil_scoped_release nogil;
              n = t.wait_notification(rid, peer, std::chrono::milliseconds(int64_t(timeout_s * 1000.0)));
            }
            return py::make_tuple(n.peer, py::bytes(n.request_id), n.kind, n.status, n.nbytes, py::str(n.message));
          },
          py::arg("request_id"), py::arg("peer"), py::arg("timeout_s"));
}
