// Python bindings: the `fastcomm._C` module. Every call that can block releases the GIL
// first; argument checks happen in the engine (C++), so the Python layer stays a thin
// pass-through and errors carry rank, group and argument names. Every op enters through one
// binding, `issue`, whatever its kind or device.
// This file: the module and its pybind11 classes (Settings, GroupHandle, Engine, Plan, ...).
// bindings_entries: Engine.issue and the fast entries (fastcomm.all_reduce, ...);
// bindings_batch: batches (fastcomm.batch, begin_batch/end_batch); bindings_work: fastcomm.Work.
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include "algorithms/reduce.h"
#include "backend/backend.h"
#include "bindings_batch.h"
#include "bindings_entries.h"
#include "bindings_work.h"
#include "device/runtime.h"
#include "engine/engine.h"
#include "transport/shm/buffers.h"

namespace py = pybind11;
using namespace fastcomm;

namespace {

// Dropping a plan's graph waits for its runs in flight (up to the plan's timeout where a member
// stalls): the last Python reference lets go of it without the GIL, so other threads go on.
std::shared_ptr<DeviceGraph> dropped_without_gil(std::shared_ptr<DeviceGraph> g) {
  DeviceGraph* raw = g.get();
  return std::shared_ptr<DeviceGraph>(raw, [g = std::move(g)](DeviceGraph*) mutable {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      g.reset();
    } else {
      g.reset();
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastcomm native engine";
  m.def("reduce_kernels", &reduce_kernels,
        "The build of the reduction loops this process runs: 'avx2' or 'baseline' (picked when "
        "an engine starts; FASTCOMM_REDUCE_KERNELS=baseline forces the baseline one)");
  m.def("shared_empty", &shared_empty, py::arg("sizes"), py::arg("dtype"),
        "A contiguous CPU tensor in a new buffer that same-host ranks can map (fastcomm.empty)");
  m.attr("has_nccl") = device_engine_factory(c10::kCUDA) != nullptr;
  m.def("_fake_process_capture", &device::fake_process_capture, py::arg("begin"), py::arg("global_mode") = true,
        "Test hook of the CPU fake of CUDA: a capture under way in the process begins, or ends (1, or 0 where "
        "it was invalidated)");
  py::dict kinds;
#define FASTCOMM_OP_KIND_PY(kind, name, type) kinds[name] = (int)OpKind::kind;
  FASTCOMM_OP_KINDS(FASTCOMM_OP_KIND_PY)
#undef FASTCOMM_OP_KIND_PY
  m.attr("op_kinds") = kinds;

  py::class_<Settings>(m, "Settings", "Every FASTCOMM_* setting, read once from the environment")
      .def_static("from_env", &Settings::from_env)
      .def_readwrite("host_id", &Settings::host_id)
      .def_readwrite("ring_bytes", &Settings::ring_bytes)
      .def_readwrite("spin_ns", &Settings::spin_ns)
      .def_readwrite("yield_ns", &Settings::yield_ns)
      .def_readwrite("exit_idle", &Settings::exit_idle)
      .def_readwrite("hierarchical", &Settings::hierarchical)
      .def_readwrite("rsag_threshold", &Settings::rsag_threshold)
      .def_readwrite("gloo_bulk_bytes", &Settings::gloo_bulk_bytes)
      .def_readwrite("baseline_kernels", &Settings::baseline_kernels)
      .def_readwrite("shm_stream_stores", &Settings::shm_stream_stores)
      .def_readwrite("shm_direct_bytes", &Settings::shm_direct_bytes)
      .def_readwrite("fake_device", &Settings::fake_device)
      .def_readwrite("device_single_stream", &Settings::device_single_stream)
      .def_readwrite("device_idle_ms", &Settings::device_idle_ms)
      .def_readwrite("device_max_comms", &Settings::device_max_comms)
      .def_readwrite("device_max_kernels", &Settings::device_max_kernels)
      .def_readwrite("device_pair_blocking", &Settings::device_pair_blocking)
      .def_readwrite("device_ipc", &Settings::device_ipc)
      .def_readwrite("device_ipc_ring_bytes", &Settings::device_ipc_ring_bytes)
      .def_readwrite("device_ipc_fuse_bytes", &Settings::device_ipc_fuse_bytes)
      .def_readwrite("device_ipc_group_max", &Settings::device_ipc_group_max);

  py::class_<GroupHandle>(m, "GroupHandle")
      .def_readonly("ranks", &GroupHandle::ranks)
      .def_readonly("rank", &GroupHandle::rank)
      .def_readonly("id", &GroupHandle::id)
      .def_property_readonly("is_member", [](const GroupHandle& g) { return g.state != nullptr; })
      // How long each op of the group may take (fixed at creation); 0 on a non-member.
      .def_property_readonly("timeout_ms",
                             [](const GroupHandle& g) { return g.state ? (int64_t)g.state->timeout.count() : 0; })
      .def("__repr__", [](const GroupHandle& g) { return "<fastcomm group " + g.label() + ">"; });

  // The engine lock is taken without the GIL, always: a progress pass holding it may need the
  // GIL to drop an op's last reference to a tensor Python sees.
  auto counter = [](const char* name) {
    return [name](Engine& e) {
      std::map<std::string, uint64_t> c;
      {
        py::gil_scoped_release nogil;
        c = e.counters();
      }
      auto it = c.find(name);
      return it == c.end() ? uint64_t(0) : it->second;
    };
  };
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](int rank, int world_size, const std::string& token, std::vector<int> host_of,
                       std::vector<int64_t> pids, int64_t timeout_ms, const Settings& settings) {
             EngineOptions o;
             o.rank = rank;
             o.world_size = world_size;
             o.token = token;
             o.host_of = std::move(host_of);
             o.pids = std::move(pids);
             o.timeout_ms = timeout_ms;
             o.settings = settings;
             return std::make_shared<Engine>(std::move(o));
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("token"), py::arg("host_of"), py::arg("pids"),
           py::arg("timeout_ms"), py::arg("settings"))
      .def("attach_peers", &Engine::attach_peers, py::call_guard<py::gil_scoped_release>())
      .def("unlink_segment", &Engine::unlink_segment, py::call_guard<py::gil_scoped_release>())
      .def("abandon_init", &Engine::abandon_init, py::call_guard<py::gil_scoped_release>())
      .def("start_gloo", &Engine::start_gloo, py::call_guard<py::gil_scoped_release>())
      .def(
          "gloo_wanted",
          [](Engine& e, int64_t timeout_ms) {
            GlooWants w;
            {
              py::gil_scoped_release nogil;
              w = e.gloo_wanted(timeout_ms);
            }
            return py::make_tuple(w.peers, w.look, w.stopping);
          },
          py::arg("timeout_ms") = -1)
      .def("gloo_connect", &Engine::gloo_connect, py::arg("peer"), py::call_guard<py::gil_scoped_release>())
      .def("gloo_attach", &Engine::gloo_attach, py::arg("peer"), py::arg("process_group"), py::arg("peer_rank"),
           py::call_guard<py::gil_scoped_release>())
      .def("gloo_attach_failed", &Engine::gloo_attach_failed, py::arg("peer"), py::arg("why"),
           py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def(
          "init_cuda", [](Engine& e, int device) { e.init_device(c10::Device(c10::kCUDA, (c10::DeviceIndex)device)); },
          py::arg("device"), py::call_guard<py::gil_scoped_release>())
      // Device tests: the device as a string ("cpu" is the fake device runtime).
      .def(
          "device_synchronize", [](Engine& e, const std::string& device) { e.device_synchronize(c10::Device(device)); },
          py::arg("device"), py::call_guard<py::gil_scoped_release>())
      .def(
          "device_debug",
          [](Engine& e, const std::string& device, const std::string& what, int64_t arg) {
            return e.device_debug(c10::Device(device), what, arg);
          },
          py::arg("device"), py::arg("what"), py::arg("arg") = 0, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::world_size)
      .def_property_readonly("timeout_ms", &Engine::timeout_ms)
      .def_property_readonly("is_shut_down", &Engine::is_shut_down)
      .def_property_readonly("stalled_sleeps", &Engine::stalled_sleeps)
      .def("counters", &Engine::counters, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("gloo_frames_sent", counter("gloo.frames_sent"))
      .def_property_readonly("gloo_closes_sent", counter("gloo.closes_sent"))
      .def_property_readonly("gloo_connected", counter("gloo.connected"))
      .def_property_readonly("gloo_bulk_started", counter("gloo.bulk_started"))
      .def_property_readonly("gloo_bulk_live", counter("gloo.bulk_live"))
      .def_property_readonly("gloo_frames_unreaped", counter("gloo.frames_unreaped"))
      .def("new_group", &Engine::new_group, py::arg("ranks"), py::arg("timeout_ms") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("new_groups", &Engine::new_groups, py::arg("lists"), py::arg("timeout_ms") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "make_plan",
          [](Engine& e, Batch& b) {
            TORCH_CHECK(!b.posted, "fastcomm: rank ", e.rank(), ": batch posted twice");
            b.posted = true;
            py::gil_scoped_release nogil;  // the ops' last tensor references may be dropped
            return e.make_plan(std::move(b.ops));
          },
          py::arg("batch"));

  // Made by begin_batch only (it holds the engine that posts it).
  py::class_<Batch>(m, "Batch").def("__len__", [](const Batch& b) { return b.ops.size(); });

  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def("__len__", &Plan::size)
      .def(
          "start",
          [](const std::shared_ptr<Plan>& p, bool async_op) -> py::object {
            c10::intrusive_ptr<Work> w;
            {
              py::gil_scoped_release nogil;
              w = p->engine().start(p, async_op);
            }
            return async_op ? wrap_work(std::move(w)) : py::none();
          },
          py::arg("async_op") = true)
      .def(
          "capture",
          [](const std::shared_ptr<Plan>& p, bool naive) {
            std::shared_ptr<DeviceGraph> g;
            {
              py::gil_scoped_release nogil;
              g = p->engine().capture(p, naive);
            }
            return dropped_without_gil(std::move(g));
          },
          py::arg("naive") = false);

  // A plan captured into a CUDA graph (fastcomm.plan.capture).
  py::class_<DeviceGraph, std::shared_ptr<DeviceGraph>>(m, "PlanGraph")
      .def("replay", &DeviceGraph::replay, py::call_guard<py::gil_scoped_release>())
      .def(
          "wait", [](DeviceGraph& g, int64_t timeout_ms) { g.wait(std::chrono::milliseconds(timeout_ms)); },
          py::arg("timeout_ms") = 0, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("replays", &DeviceGraph::replays)
      .def_property_readonly("recorded", &DeviceGraph::recorded)
      .def_property_readonly("user_runs", &DeviceGraph::user_runs);

  add_entries(m);  // Engine.issue, the fast entries, set_current, set_fast_entry
  add_batch_functions(m);

  add_work_type(m);
  add_batch_type(m);
  register_backend_bindings(m);  // the torch.distributed backend (csrc/backend)
}
