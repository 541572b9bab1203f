// Python bindings: the `fastcomm._C` module. Every call that can block releases the GIL
// first; argument checking happens in the engine (C++) so the Python layer stays a thin
// pass-through and errors carry rank, group and argument names.
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include "algorithms/reduce.h"
#include "backend/backend.h"
#include "engine/engine.h"
#ifdef FASTCOMM_WITH_NCCL
#include "engine/cuda_ops.h"
#endif

namespace py = pybind11;
using namespace fastcomm;

namespace {

// A read-only property giving one of the engine's Gloo counters (it takes the engine lock, so
// the GIL is released meanwhile).
auto gloo_counter(uint64_t Engine::GlooCounters::*field) {
  return [field](Engine& e) {
    Engine::GlooCounters c;
    {
      py::gil_scoped_release nogil;
      c = e.gloo_counters();
    }
    return c.*field;
  };
}

template <typename W>
py::object to_py_work(c10::intrusive_ptr<W> w) {
  return py::cast(c10::intrusive_ptr<c10d::Work>(std::move(w)));
}

// Accepts torch.distributed.ReduceOp, its RedOpType members, or a plain int.
c10d::ReduceOp::RedOpType to_redop(const py::handle& op, const Engine& e, const GroupHandle& g,
                                   const char* api) {
  // Checked by type, not by trying casts: a failed pybind cast costs a C++ exception per call.
  if (py::isinstance<c10d::ReduceOp::RedOpType>(op)) return op.cast<c10d::ReduceOp::RedOpType>();
  if (py::isinstance<c10d::ReduceOp>(op)) return op.cast<c10d::ReduceOp>().op_;
  if (py::isinstance<py::int_>(op)) return (c10d::ReduceOp::RedOpType)op.cast<int>();
  throw py::type_error(std::string("fastcomm.") + api + ": rank " + std::to_string(e.rank()) +
                       ", group " + g.label() + ": argument 'op' must be a torch.distributed.ReduceOp, got " +
                       std::string(py::str(py::type::of(op))));
}

// Ops issued inside `with fastcomm.batch()`: prepared (validated) at issue time, posted
// together when the block ends.
struct Batch {
  std::vector<Engine::Prepared> ops;
#ifdef FASTCOMM_WITH_NCCL
  std::vector<CudaOp> cuda_ops;  // a batch holds CPU ops or CUDA ops, not both
  int cuda_device = -1;
#endif
  bool posted = false;
};

// The `batch` argument of every collective binding: a Batch or None (the common case). Loaded
// by hand because pybind11's generic caster, given None for a Batch*, first probes None's type
// for a foreign module-local binding (an AttributeError raised and cleared), fails the
// no-convert pass, and so re-converts every argument and probes again: about a microsecond
// per blocking call, a fifth of a small all_reduce.
struct BatchArg {
  Batch* p = nullptr;
  operator Batch*() const { return p; }
};

// Posts `ops` as one Work; a blocking call also waits for it and raises its error. The caller
// has released the GIL.
c10::intrusive_ptr<Work> post_ops(Engine& e, std::vector<Engine::Prepared> ops, bool async_op) {
  auto w = e.post(std::move(ops), async_op);
  if (!async_op) {
    e.wait(*w, std::chrono::milliseconds(0));
    w->rethrow_if_failed();
  }
  return w;
}

// Common tail of every collective binding: queue into the batch, or post and (for a blocking
// call) wait, with the GIL released. kTakesLock: preparing takes the engine lock (send/recv
// find their channel), which is never waited for with the GIL held, even into a batch.
template <bool kTakesLock = false, typename Prepare>
py::object issue(Engine& e, bool async_op, Batch* batch, Prepare&& prepare) {
  if (batch != nullptr) {
    TORCH_CHECK(!batch->posted, "fastcomm: rank ", e.rank(), ": op issued into a batch that was already posted");
#ifdef FASTCOMM_WITH_NCCL
    TORCH_CHECK_VALUE(batch->cuda_ops.empty(), "fastcomm.batch: rank ", e.rank(),
                      ": a batch holds CPU ops or CUDA ops, not both (this op's tensor is on the CPU)");
#endif
    if constexpr (kTakesLock) {
      Engine::Prepared prep = [&] {
        py::gil_scoped_release nogil;
        return prepare();
      }();
      TORCH_CHECK(!batch->posted, "fastcomm: rank ", e.rank(), ": op issued into a batch that was already posted");
      batch->ops.push_back(std::move(prep));
    } else {
      batch->ops.push_back(prepare());
    }
    return py::none();
  }
  c10::intrusive_ptr<Work> w;
  {
    py::gil_scoped_release nogil;
    std::vector<Engine::Prepared> ops;
    ops.push_back(prepare());
    w = post_ops(e, std::move(ops), async_op);
  }
  return async_op ? to_py_work(std::move(w)) : py::none();
}

#ifdef FASTCOMM_WITH_NCCL
// The CUDA path (engine/cuda_ops.h): the world NCCL communicator is made at the first CUDA op,
// which can wait on other ranks, so everything here runs without the GIL.
template <typename Prepare>
py::object issue_cuda(Engine& e, const at::Tensor& t, bool async_op, Batch* batch, Prepare&& prepare) {
  c10::intrusive_ptr<CudaWork> w;
  {
    py::gil_scoped_release nogil;
    auto c = CudaOps::get(e, t.device().index());
    if (batch != nullptr) {
      TORCH_CHECK(!batch->posted, "fastcomm: rank ", e.rank(), ": op issued into a batch that was already posted");
      TORCH_CHECK_VALUE(batch->ops.empty(), "fastcomm.batch: rank ", e.rank(),
                        ": a batch holds CPU ops or CUDA ops, not both (this op's tensor is on ", t.device(), ")");
      batch->cuda_ops.push_back(prepare(*c));
      batch->cuda_device = c->device();
    } else {
      std::vector<CudaOp> ops;
      ops.push_back(prepare(*c));
      w = c->post(std::move(ops), async_op);
    }
  }
  // Python objects (even None's reference count) only with the GIL held again.
  return batch == nullptr && async_op ? to_py_work(std::move(w)) : py::none();
}
// One branch on the CPU path: the tensor's device bit, read inline.
#define FASTCOMM_CUDA_DISPATCH(tensor, call)                                                   \
  if ((tensor).is_cuda())                                                                       \
    return issue_cuda(e, (tensor), async_op, batch, [&](CudaOps& c) { return c.call; });
#else
#define FASTCOMM_CUDA_DISPATCH(tensor, call)
#endif

}  // namespace

namespace pybind11::detail {
template <>
struct type_caster<BatchArg> {
  PYBIND11_TYPE_CASTER(BatchArg, const_name("Batch | None"));
  bool load(handle src, bool convert) {
    if (src.is_none()) {
      value.p = nullptr;
      return true;
    }
    make_caster<Batch> c;
    if (!c.load(src, convert)) return false;
    value.p = &cast_op<Batch&>(c);
    return true;
  }
  static handle cast(const BatchArg&, return_value_policy, handle) { return none().release(); }
};
}  // namespace pybind11::detail

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastcomm native engine";
  m.def("reduce_kernels", &reduce_kernels,
        "The build of the reduction loops this process runs: 'avx2' or 'baseline' (picked when "
        "an engine starts; FASTCOMM_REDUCE_KERNELS=baseline forces the baseline one)");
#ifdef FASTCOMM_WITH_NCCL
  m.attr("has_nccl") = true;
#else
  m.attr("has_nccl") = false;
#endif

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
      .def("abandon_init", &Engine::abandon_init, py::call_guard<py::gil_scoped_release>())
      .def("set_gloo", &Engine::set_gloo, py::arg("process_group"),
           py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def("set_store", &Engine::set_store, py::arg("store"))
      .def(
          "init_cuda",
          [](Engine& e, int device) {
#ifdef FASTCOMM_WITH_NCCL
            CudaOps::get(e, device);
#else
            TORCH_CHECK(false, "fastcomm: rank ", e.rank(), ": this build of fastcomm has no NCCL path (torch ",
                        "was not a CUDA build, or NCCL was not found, when it was compiled)");
#endif
          },
          py::arg("device"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::world_size)
      .def_property_readonly("timeout_ms", &Engine::timeout_ms)
      .def_property_readonly("is_shut_down", &Engine::is_shut_down)
      .def_property_readonly("stalled_sleeps", &Engine::stalled_sleeps)
      .def_property_readonly("gloo_frames_sent", gloo_counter(&Engine::GlooCounters::frames_sent))
      .def_property_readonly("gloo_closes_sent", gloo_counter(&Engine::GlooCounters::closes_sent))
      .def_property_readonly("gloo_bulk_started", gloo_counter(&Engine::GlooCounters::bulk_started))
      .def_property_readonly("gloo_bulk_live", gloo_counter(&Engine::GlooCounters::bulk_live))
      .def_property_readonly("gloo_frames_unreaped",
                             gloo_counter(&Engine::GlooCounters::frames_unreaped))
      // The engine lock is taken without the GIL, always: a progress pass holding it may need
      // the GIL to drop an op's last reference to a tensor Python sees.
      .def("new_group", &Engine::new_group, py::arg("ranks"), py::call_guard<py::gil_scoped_release>())
      .def("new_groups", &Engine::new_groups, py::arg("lists"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce",
          [](Engine& e, const GroupHandle& g, const at::Tensor& t, const py::handle& op, bool async_op,
             BatchArg batch) {
            const auto rop = to_redop(op, e, g, "all_reduce");
            FASTCOMM_CUDA_DISPATCH(t, prepare_all_reduce(g, t, rop));
            return issue(e, async_op, batch, [&] { return e.prepare_all_reduce(g, t, rop); });
          },
          py::arg("group"), py::arg("tensor"), py::arg("op"), py::arg("async_op"), py::arg("batch"))
      .def(
          "broadcast",
          [](Engine& e, const GroupHandle& g, const at::Tensor& t, int src, bool async_op, BatchArg batch) {
            FASTCOMM_CUDA_DISPATCH(t, prepare_broadcast(g, t, src));
            return issue(e, async_op, batch, [&] { return e.prepare_broadcast(g, t, src); });
          },
          py::arg("group"), py::arg("tensor"), py::arg("src"), py::arg("async_op"), py::arg("batch"))
      .def(
          "all_gather",
          [](Engine& e, const GroupHandle& g, const std::vector<at::Tensor>& outs, const at::Tensor& in,
             bool async_op, BatchArg batch) {
            FASTCOMM_CUDA_DISPATCH(in, prepare_all_gather(g, outs, in));
            return issue(e, async_op, batch, [&] { return e.prepare_all_gather(g, outs, in); });
          },
          py::arg("group"), py::arg("tensor_list"), py::arg("tensor"), py::arg("async_op"), py::arg("batch"))
      .def(
          "all_gather_into_tensor",
          [](Engine& e, const GroupHandle& g, const at::Tensor& out, const at::Tensor& in, bool async_op,
             BatchArg batch) {
            FASTCOMM_CUDA_DISPATCH(in, prepare_all_gather_into_tensor(g, out, in));
            return issue(e, async_op, batch, [&] { return e.prepare_all_gather_into_tensor(g, out, in); });
          },
          py::arg("group"), py::arg("output_tensor"), py::arg("input_tensor"), py::arg("async_op"),
          py::arg("batch"))
      .def(
          "reduce_scatter",
          [](Engine& e, const GroupHandle& g, const at::Tensor& out, const std::vector<at::Tensor>& ins,
             const py::handle& op, bool async_op, BatchArg batch) {
            const auto rop = to_redop(op, e, g, "reduce_scatter");
            FASTCOMM_CUDA_DISPATCH(out, prepare_reduce_scatter(g, out, ins, rop));
            return issue(e, async_op, batch, [&] { return e.prepare_reduce_scatter(g, out, ins, rop); });
          },
          py::arg("group"), py::arg("output"), py::arg("input_list"), py::arg("op"), py::arg("async_op"),
          py::arg("batch"))
      .def(
          "reduce_scatter_tensor",
          [](Engine& e, const GroupHandle& g, const at::Tensor& out, const at::Tensor& in,
             const py::handle& op, bool async_op, BatchArg batch) {
            const auto rop = to_redop(op, e, g, "reduce_scatter_tensor");
            FASTCOMM_CUDA_DISPATCH(out, prepare_reduce_scatter_tensor(g, out, in, rop));
            return issue(e, async_op, batch, [&] { return e.prepare_reduce_scatter_tensor(g, out, in, rop); });
          },
          py::arg("group"), py::arg("output"), py::arg("input"), py::arg("op"), py::arg("async_op"),
          py::arg("batch"))
      .def(
          "barrier",
          [](Engine& e, const GroupHandle& g, bool async_op, BatchArg batch) {
            return issue(e, async_op, batch, [&] { return e.prepare_barrier(g); });
          },
          py::arg("group"), py::arg("async_op"), py::arg("batch"))
      .def(
          "send",
          [](Engine& e, const GroupHandle& g, const at::Tensor& t, int dst, int tag, bool async_op,
             BatchArg batch) {
            FASTCOMM_CUDA_DISPATCH(t, prepare_p2p(g, t, dst, true));
            return issue<true>(e, async_op, batch, [&] { return e.prepare_p2p(g, t, dst, tag, true); });
          },
          py::arg("group"), py::arg("tensor"), py::arg("dst"), py::arg("tag"), py::arg("async_op"),
          py::arg("batch"))
      .def(
          "recv",
          [](Engine& e, const GroupHandle& g, const at::Tensor& t, int src, int tag, bool async_op,
             BatchArg batch) {
            FASTCOMM_CUDA_DISPATCH(t, prepare_p2p(g, t, src, false));
            return issue<true>(e, async_op, batch, [&] { return e.prepare_p2p(g, t, src, tag, false); });
          },
          py::arg("group"), py::arg("tensor"), py::arg("src"), py::arg("tag"), py::arg("async_op"),
          py::arg("batch"))
      .def(
          "post_batch",
          // A blocking batch is driven by the caller alone: no background thread is woken.
          [](Engine& e, Batch& b, bool async_op) -> py::object {
            TORCH_CHECK(!b.posted, "fastcomm: rank ", e.rank(), ": batch posted twice");
            b.posted = true;
#ifdef FASTCOMM_WITH_NCCL
            if (!b.cuda_ops.empty()) {
              c10::intrusive_ptr<CudaWork> cw;
              {
                py::gil_scoped_release nogil;
                cw = CudaOps::get(e, b.cuda_device)->post(std::move(b.cuda_ops), async_op);
              }
              return async_op ? to_py_work(std::move(cw)) : py::none();
            }
#endif
            c10::intrusive_ptr<Work> w;
            {
              py::gil_scoped_release nogil;
              w = post_ops(e, std::move(b.ops), async_op);
            }
            return async_op ? to_py_work(std::move(w)) : py::none();
          },
          py::arg("batch"), py::arg("async_op") = true);

  py::class_<Batch>(m, "Batch")
      .def(py::init<>())
      .def("__len__", [](const Batch& b) { return b.ops.size(); });

  register_backend_bindings(m);  // the torch.distributed backend (csrc/backend)
}
