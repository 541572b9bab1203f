#include "bindings_entries.h"

#include <array>
#include <climits>
#include <iterator>
#include <utility>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "bindings_batch.h"
#include "bindings_common.h"
#include "bindings_work.h"
#include "engine/engine.h"

namespace py = pybind11;

namespace fastcomm {

namespace {

// Accepts torch.distributed.ReduceOp, its RedOpType members, a plain int, or None (SUM).
// Checked by type, not by trying casts: a failed pybind cast costs a C++ exception per call.
RedOp to_redop(const py::handle& op, const Engine& e, const GroupHandle& g, OpKind k) {
  if (op.is_none()) return c10d::ReduceOp::SUM;
  if (auto* t = registered<c10d::ReduceOp::RedOpType>(op)) return *t;
  if (auto* r = registered<c10d::ReduceOp>(op)) return r->op_;
  if (py::isinstance<py::int_>(op)) return (RedOp)op.cast<int>();
  throw py::type_error(std::string("fastcomm.") + op_kind_name(k) + ": rank " + std::to_string(e.rank()) +
                       ", group " + g.label() + ": argument 'op' must be a torch.distributed.ReduceOp, got " +
                       std::string(py::str(py::type::of(op))));
}

at::Tensor tensor_arg(const py::handle& h, const Engine& e, OpKind k) {
  if (h.is_none()) return at::Tensor();
  if (THPVariable_Check(h.ptr())) return THPVariable_Unpack(h.ptr());
  throw py::type_error(std::string("fastcomm.") + op_kind_name(k) + ": rank " + std::to_string(e.rank()) +
                       ": expected a tensor, got " + std::string(py::str(py::type::of(h))));
}

std::vector<at::Tensor> tensor_list_arg(const py::handle& h) {
  if (h.is_none()) return {};
  // A list of tensors (gather's and scatter's common case) read directly: pybind11's list
  // caster goes through a generic sequence protocol and a caster per item.
  if (PyList_CheckExact(h.ptr())) {
    const Py_ssize_t n = PyList_GET_SIZE(h.ptr());
    std::vector<at::Tensor> v;
    v.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* x = PyList_GET_ITEM(h.ptr(), i);
      if (!THPVariable_Check(x)) return h.cast<std::vector<at::Tensor>>();  // reports the bad item
      v.push_back(THPVariable_Unpack(x));
    }
    return v;
  }
  return h.cast<std::vector<at::Tensor>>();
}

// all_to_all_single's (output_split_sizes, input_split_sizes), each None or a list of ints.
void splits_arg(const py::handle& h, OpRequest& r) {
  if (h.is_none()) return;
  auto pair = h.cast<std::pair<py::object, py::object>>();
  if (!pair.first.is_none()) r.output_splits = pair.first.cast<std::vector<int64_t>>();
  if (!pair.second.is_none()) r.input_splits = pair.second.cast<std::vector<int64_t>>();
}

// Every op's entry. inputs: all_to_all's input list; splits: all_to_all_single's (output,
// input) split sizes. Inside a batch or plan being recorded on this thread the op is added to
// it instead of issued.
py::object issue(Engine& e, int kind, const GroupHandle& g, const py::handle& tensor, const py::handle& output,
                 const py::handle& list, const py::handle& op, int peer, int tag, bool async_op,
                 const py::handle& inputs, const py::handle& splits, int64_t timeout_ms = 0) {
  TORCH_CHECK_VALUE(kind > (int)OpKind::kNone && kind < (int)OpKind::kCount, "fastcomm: rank ", e.rank(),
                    ": unknown op kind ", kind);
  const OpKind k = (OpKind)kind;
  OpRequest r;
  r.kind = k;
  r.tensor = tensor_arg(tensor, e, k);
  r.output = tensor_arg(output, e, k);
  r.list = tensor_list_arg(list);
  r.inputs = tensor_list_arg(inputs);
  splits_arg(splits, r);
  r.redop = to_redop(op, e, g, k);
  r.peer = peer;
  r.tag = tag;
  r.timeout = std::chrono::milliseconds(timeout_ms);
  if (Batch* batch = t_recording) {
    // send/recv take the engine lock to find their channel, never waited for with the GIL.
    if (collective_spec(k).p2p) {
      Engine::Prepared prep = [&] {
        py::gil_scoped_release nogil;
        return e.prepare(std::move(r), g);
      }();
      add_to_batch(e, *batch, std::move(prep));
    } else {
      add_to_batch(e, *batch, e.prepare(std::move(r), g));
    }
    return py::none();
  }
  c10::intrusive_ptr<Work> w;
  // Outlives the unlocked section: its requests hold the last C++ references to the caller's
  // tensors, and dropping such a reference releases the tensor's Python object, which without
  // the GIL means taking it again (a measurable part of a blocking op).
  Engine::PreparedOps ops;
  {
    py::gil_scoped_release nogil;
    ops.push_back(e.prepare(std::move(r), g));
    w = e.run(ops, async_op, /*rethrow=*/true);
  }
  // Python objects (even None's reference count) only with the GIL held again. A blocking recv
  // returns its sender's global rank (torch's recv does), found only now for one from any source.
  if (async_op) return wrap_work(std::move(w));
  if (k == OpKind::kRecv) return py::int_(g.ranks[w->sourceRank()]);  // a device recv's: set at post
  return py::none();
}

int int_arg(PyObject* o, const char* name) {
  const long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  TORCH_CHECK_VALUE(v >= INT32_MIN && v <= INT32_MAX, "fastcomm: argument '", name, "' out of range: ", v);
  return (int)v;
}

// Engine.issue as a bare CPython method (METH_FASTCALL): pybind11's dispatcher builds argument
// vectors and a keep-alive frame per call, about as much as the rest of a blocking op in a
// small group. Arguments as `issue` above, positional only.
PyObject* issue_entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs != 11 && nargs != 12)
      throw py::type_error("Engine.issue takes 11 or 12 positional arguments, got " + std::to_string(nargs));
    Engine* e = registered<Engine>(self);
    if (e == nullptr) throw py::type_error("Engine.issue: 'self' is not a fastcomm Engine");
    const GroupHandle* g = registered<GroupHandle>(args[1]);
    if (g == nullptr)
      throw py::type_error("fastcomm: rank " + std::to_string(e->rank()) +
                           ": argument 'group' must be a fastcomm group handle, got " +
                           std::string(py::str(py::type::of(args[1]))));
    const int async_op = PyObject_IsTrue(args[8]);
    if (async_op < 0) throw py::error_already_set();
    py::object r = issue(*e, int_arg(args[0], "kind"), *g, args[2], args[3], args[4], args[5],
                         int_arg(args[6], "peer"), int_arg(args[7], "tag"), async_op != 0, args[9], args[10],
                         nargs == 12 ? (int64_t)int_arg(args[11], "timeout_ms") : 0);
    return r.release().ptr();
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

// The hot calls (all_reduce, broadcast, reduce, gather, scatter) without a Python frame: the
// engine and the world group are set by fastcomm.init/shutdown (set_current), the Batch being
// recorded on this thread by batch/plan (begin_batch). Whatever is not the plain case (not
// initialized, a group that is not a fastcomm Group, a group-rank argument, odd arguments) goes
// to the op's Python wrapper, which handles and reports it as before. Strong references,
// dropped by set_current(None, None) at shutdown.
PyObject* g_engine = nullptr;
PyObject* g_world = nullptr;     // the world's GroupHandle
// The C++ objects of the two (null if either is not of its type: the wrapper takes every call).
Engine* g_engine_cpp = nullptr;
const GroupHandle* g_world_cpp = nullptr;

// What each parameter of a fast entry feeds in `issue`.
enum class Role : uint8_t { kTensor, kList, kOp, kPeer, kGroupPeer, kGroup, kAsync };
constexpr int kMaxParams = 6;
constexpr int kPeerRequired = INT32_MIN;  // no default: the wrapper reports the missing rank

struct FastEntry {
  const char* name;
  OpKind kind;
  int nparams;
  const char* params[kMaxParams];  // torch.distributed's names, in its order
  Role roles[kMaxParams];
  int default_peer;  // when neither the rank nor the group rank is given
  const char* doc;
  PyObject* fallback;  // the Python wrapper (fastcomm.collectives._<name>_py), set by set_fast_entry
  // `params` as interned strings, made at the first call: a keyword a caller wrote in source
  // arrives as the same interned object, so one pointer compare usually finds it.
  PyObject* names[kMaxParams];
};

using R = Role;
FastEntry g_entries[] = {
    {"all_reduce", OpKind::kAllReduce, 4, {"tensor", "op", "group", "async_op"},
     {R::kTensor, R::kOp, R::kGroup, R::kAsync}, -1,
     "all_reduce(tensor, op=None, group=None, async_op=False)\n--\n\n"
     "Reduces ``tensor`` in place across ``group`` (default: all ranks) with ``op`` (a "
     "torch.distributed.ReduceOp; None: SUM).",
     nullptr},
    {"broadcast", OpKind::kBroadcast, 5, {"tensor", "src", "group", "async_op", "group_src"},
     {R::kTensor, R::kPeer, R::kGroup, R::kAsync, R::kGroupPeer}, kPeerRequired,
     "broadcast(tensor, src=None, group=None, async_op=False, group_src=None)\n--\n\n"
     "Copies ``tensor`` from global rank ``src`` (or group rank ``group_src``) to all members.",
     nullptr},
    {"reduce", OpKind::kReduce, 6, {"tensor", "dst", "op", "group", "async_op", "group_dst"},
     {R::kTensor, R::kPeer, R::kOp, R::kGroup, R::kAsync, R::kGroupPeer}, kPeerRequired,
     "reduce(tensor, dst=None, op=None, group=None, async_op=False, group_dst=None)\n--\n\n"
     "Reduces ``tensor`` across ``group`` into ``tensor`` on global rank ``dst`` (or group rank "
     "``group_dst``); the other members' tensors are left unchanged.",
     nullptr},
    {"gather", OpKind::kGather, 6, {"tensor", "gather_list", "dst", "group", "async_op", "group_dst"},
     {R::kTensor, R::kList, R::kPeer, R::kGroup, R::kAsync, R::kGroupPeer}, 0,
     "gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None)\n--\n\n"
     "Copies every member's ``tensor`` into ``gather_list`` (one tensor per member, in group rank "
     "order) on ``dst`` (default: global rank 0); the others pass no list.",
     nullptr},
    {"scatter", OpKind::kScatter, 6, {"tensor", "scatter_list", "src", "group", "async_op", "group_src"},
     {R::kTensor, R::kList, R::kPeer, R::kGroup, R::kAsync, R::kGroupPeer}, 0,
     "scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None)\n--\n\n"
     "Copies ``scatter_list[i]`` on ``src`` (default: global rank 0) into group rank i's "
     "``tensor``; the others pass no list.",
     nullptr},
};

// The plain case of one fast entry, or null with no error set: the wrapper takes the call.
PyObject* fast_issue(FastEntry& f, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (g_engine_cpp == nullptr || nargs > f.nparams) return nullptr;
  PyObject* a[kMaxParams] = {};
  for (Py_ssize_t i = 0; i < nargs; ++i) a[i] = args[i];
  if (kwnames != nullptr) {
    if (f.names[0] == nullptr) {
      for (int j = 0; j < f.nparams; ++j) {
        f.names[j] = PyUnicode_InternFromString(f.params[j]);  // kept for the process's life
        if (f.names[j] == nullptr) {
          PyErr_Clear();
          return nullptr;
        }
      }
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); ++k) {
      PyObject* name = PyTuple_GET_ITEM(kwnames, k);
      int slot = -1;
      for (int j = 0; j < f.nparams && slot < 0; ++j)
        if (name == f.names[j]) slot = j;
      for (int j = 0; j < f.nparams && slot < 0; ++j)
        if (PyUnicode_CompareWithASCIIString(name, f.params[j]) == 0) slot = j;
      if (slot < 0 || a[slot] != nullptr) return nullptr;
      a[slot] = args[nargs + k];
    }
  }
  PyObject *tensor = nullptr, *list = Py_None, *op = Py_None, *group = Py_None;
  int peer = f.default_peer, async_op = 0;
  for (int j = 0; j < f.nparams; ++j) {
    PyObject* v = a[j];
    if (v == nullptr) continue;
    switch (f.roles[j]) {
      case Role::kTensor: tensor = v; break;
      case Role::kList: list = v; break;
      case Role::kOp: op = v; break;
      case Role::kGroup: group = v; break;
      case Role::kGroupPeer:
        if (v != Py_None) return nullptr;
        break;
      case Role::kPeer:
        if (v == Py_None) break;
        if (!PyLong_CheckExact(v)) return nullptr;
        {
          const long r = PyLong_AsLong(v);
          if ((r == -1 && PyErr_Occurred()) || r < INT32_MIN + 1 || r > INT32_MAX) {
            PyErr_Clear();
            return nullptr;
          }
          peer = (int)r;
        }
        break;
      case Role::kAsync:
        if ((async_op = PyObject_IsTrue(v)) < 0) {
          PyErr_Clear();
          return nullptr;
        }
        break;
    }
  }
  if (tensor == nullptr || peer == kPeerRequired) return nullptr;
  // Held for the call: another thread may shut fastcomm down (set_current(None, None)) while
  // this one waits without the GIL.
  const py::object engine = py::reinterpret_borrow<py::object>(g_engine);
  Engine* e = g_engine_cpp;
  py::object handle;  // the group's handle, held likewise
  const GroupHandle* g = nullptr;
  if (group == Py_None) {
    handle = py::reinterpret_borrow<py::object>(g_world);
    g = g_world_cpp;
  } else {
    static PyObject* const attr = PyUnicode_InternFromString("_h");  // not a new string per call
    PyObject* h = PyObject_GetAttr(group, attr);
    if (h == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    handle = py::reinterpret_steal<py::object>(h);
    g = registered<GroupHandle>(handle);
  }
  if (g == nullptr) return nullptr;
  return issue(*e, (int)f.kind, *g, tensor, Py_None, list, op, peer, 0, async_op != 0, Py_None, Py_None)
      .release()
      .ptr();
}

template <int I>
PyObject* fast_entry(PyObject*, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  FastEntry& f = g_entries[I];
  try {
    if (PyObject* r = fast_issue(f, args, PyVectorcall_NARGS(nargsf), kwnames)) return r;
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
  if (f.fallback == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "fastcomm.%s: the Python layer did not register its wrapper", f.name);
    return nullptr;
  }
  return PyObject_Vectorcall(f.fallback, args, nargsf, kwnames);
}

template <int... I>
std::array<PyMethodDef, sizeof...(I)> fast_defs(std::integer_sequence<int, I...>) {
  return {PyMethodDef{g_entries[I].name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_entry<I>)),
                      METH_FASTCALL | METH_KEYWORDS, g_entries[I].doc}...};
}

// PyCFunction objects point at their PyMethodDef for good.
std::array<PyMethodDef, std::size(g_entries)> g_fast_defs =
    fast_defs(std::make_integer_sequence<int, (int)std::size(g_entries)>{});

PyMethodDef issue_def = {
    "issue", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&issue_entry)), METH_FASTCALL,
    "issue(kind, group, tensor, output, list, op, peer, tag, async_op, inputs, splits[, timeout_ms]): every "
    "op's entry (positional only; from fastcomm/collectives.py); timeout_ms > 0: the op's own timeout"};

}  // namespace

// The engine a batch or plan recorded now is posted on. Not initialized, or shut down
// underneath (by the torch backend): the Python layer says which, in its words.
py::object current_engine(const char* api) {
  Engine* e = g_engine ? registered<Engine>(g_engine) : nullptr;
  if (e == nullptr || e->is_shut_down()) return py::module_::import("fastcomm._state").attr("_require")(api);
  return py::reinterpret_borrow<py::object>(g_engine);
}

void add_entries(py::module_& m) {
  add_functions(m, g_fast_defs);
  m.def(
      "set_current",
      [](py::handle engine, py::handle world) {
        set_ref(g_engine, engine.is_none() ? nullptr : engine.ptr());
        set_ref(g_world, world.is_none() ? nullptr : world.ptr());
        g_engine_cpp = g_engine ? registered<Engine>(g_engine) : nullptr;
        g_world_cpp = g_world ? registered<GroupHandle>(g_world) : nullptr;
        if (g_world_cpp == nullptr) g_engine_cpp = nullptr;
      },
      "The engine and world group handle fastcomm.all_reduce uses (None, None: not initialized)");
  m.def(
      "set_fast_entry",
      [](const std::string& name, py::handle fallback) {
        FastEntry* f = nullptr;
        for (FastEntry& x : g_entries)
          if (name == x.name) f = &x;
        TORCH_CHECK_VALUE(f != nullptr, "fastcomm: no native entry named ", name);
        set_ref(f->fallback, fallback.ptr());
      },
      "The Python wrapper the native entry `name` falls back to");

  // Engine.issue, the bare entry above, as a method of Engine (a descriptor checks `self`'s type).
  {
    py::object engine = m.attr("Engine");
    PyObject* d = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(engine.ptr()), &issue_def);
    if (d == nullptr) throw py::error_already_set();
    engine.attr("issue") = py::reinterpret_steal<py::object>(d);
  }
}

}  // namespace fastcomm
