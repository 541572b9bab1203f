// Python bindings: the `fastcomm._C` module. Every call that can block releases the GIL
// first; argument checking happens in the engine (C++) so the Python layer stays a thin
// pass-through and errors carry rank, group and argument names.
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include "engine/engine.h"

namespace py = pybind11;
using namespace fastcomm;

namespace {

py::object to_py_work(c10::intrusive_ptr<Work> w) {
  return py::cast(c10::intrusive_ptr<c10d::Work>(std::move(w)));
}

// Accepts torch.distributed.ReduceOp, its RedOpType members, or a plain int.
c10d::ReduceOp::RedOpType to_redop(const py::handle& op) {
  if (py::isinstance<py::int_>(op)) return (c10d::ReduceOp::RedOpType)op.cast<int>();
  try {
    return op.cast<c10d::ReduceOp>().op_;
  } catch (const py::cast_error&) {
  }
  return op.cast<c10d::ReduceOp::RedOpType>();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastcomm native engine";

  py::class_<GroupHandle>(m, "GroupHandle")
      .def_readonly("ranks", &GroupHandle::ranks)
      .def_readonly("rank", &GroupHandle::rank)
      .def_readonly("id", &GroupHandle::id)
      .def_property_readonly("is_member", [](const GroupHandle& g) { return g.state != nullptr; })
      .def("__repr__", [](const GroupHandle& g) { return "<fastcomm group " + g.label() + ">"; });

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](int rank, int world_size, const std::string& token, std::vector<int> host_of,
                       std::vector<int64_t> pids, size_t ring_bytes, int64_t timeout_ms,
                       int64_t spin_ns, int64_t yield_ns) {
             EngineOptions o;
             o.rank = rank;
             o.world_size = world_size;
             o.token = token;
             o.host_of = std::move(host_of);
             o.pids = std::move(pids);
             o.ring_bytes = ring_bytes;
             o.timeout_ms = timeout_ms;
             o.spin_ns = spin_ns;
             o.yield_ns = yield_ns;
             return std::make_shared<Engine>(std::move(o));
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("token"), py::arg("host_of"),
           py::arg("pids"), py::arg("ring_bytes"), py::arg("timeout_ms"), py::arg("spin_ns") = -1,
           py::arg("yield_ns") = -1)
      .def("attach_peers", &Engine::attach_peers, py::call_guard<py::gil_scoped_release>())
      .def("unlink_segment", &Engine::unlink_segment, py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::world_size)
      .def_property_readonly("timeout_ms", &Engine::timeout_ms)
      .def_property_readonly("is_shut_down", &Engine::is_shut_down)
      .def("new_group", &Engine::new_group, py::arg("ranks"))
      .def("new_groups", &Engine::new_groups, py::arg("lists"))
      .def(
          "all_reduce",
          [](Engine& e, const GroupHandle& g, const at::Tensor& t, const py::handle& op, bool async_op) {
            const auto rop = to_redop(op);
            c10::intrusive_ptr<Work> w;
            {
              py::gil_scoped_release nogil;
              w = e.all_reduce(g, t, rop, async_op);
              if (!async_op) {
                e.wait(*w, std::chrono::milliseconds(0));
                w->rethrow_if_failed();
              }
            }
            return async_op ? to_py_work(std::move(w)) : py::none();
          },
          py::arg("group"), py::arg("tensor"), py::arg("op"), py::arg("async_op"));
}
