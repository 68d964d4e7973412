// Python module torch_cam._C: the backend class and its factory. Registration with
// torch.distributed happens in torch_cam/__init__.py (Python), never at library load.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/python.h>

#include "../backend/cam_backend.hpp"
#include "../transport/shm_heap.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_cam native backend";
  py::class_<cam::CamBackend, c10d::Backend, c10::intrusive_ptr<cam::CamBackend>>(m, "CamBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       double timeout_s, const std::map<std::string, std::string>& options,
                       const std::string& group_id) {
             auto timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000.0));
             auto cfg = cam::CamConfig::from_map(options, timeout);
             return c10::make_intrusive<cam::CamBackend>(store, rank, size, std::move(cfg), group_id);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
           py::arg("options"), py::arg("group_id"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("config", &cam::CamBackend::config_string)
      .def_property_readonly("group_id", &cam::CamBackend::group_id)
      .def_property_readonly("heap_bytes", &cam::CamBackend::window_bytes_mapped,
                             "Bytes of symmetric heap this rank maps (all windows of the group)")
      .def_property_readonly("direct_read_available", &cam::CamBackend::direct_read_available,
                             "Whether this rank can read peers' memory directly (single-copy path)")
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
      .def("stats", &cam::CamBackend::stats,
           "Heap sizes and bytes moved per path (staged through windows, read directly)");
  m.def("sweep_stale_segments", &cam::ShmHeap::sweep_stale_segments,
        "Remove /dev/shm names left by cam processes of this user that no longer exist");
}
