// Python bindings: the `fastcomm._C` module. Every call that can block releases the GIL
// first; argument checks happen in the engine (C++), so the Python layer stays a thin
// pass-through and errors carry rank, group and argument names. Every op enters through one
// binding, `issue`, whatever its kind or device.
#include <array>
#include <climits>
#include <iterator>
#include <utility>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include "algorithms/reduce.h"
#include "backend/backend.h"
#include "bindings_work.h"
#include "engine/engine.h"
#include "transport/shm/buffers.h"

namespace py = pybind11;
using namespace fastcomm;

namespace {

// The C++ object behind `h` if it is a T (or derives from one), else null. pybind11's own
// casters look the type up in a hash map keyed by the type's name on every call, a good part
// of a blocking op's cost; the lookup is done once here.
template <typename T>
T* registered(const py::handle& h) {
  static const py::detail::type_info* const ti = py::detail::get_type_info(typeid(T), /*throw_if_missing=*/true);
  py::detail::type_caster_generic c(ti);
  return c.load(h, /*convert=*/false) ? static_cast<T*>(c.value) : nullptr;
}

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

// Ops issued inside `with fastcomm.batch()`: checked at issue time, posted together when the
// block ends.
struct Batch {
  Batch() = default;
  Batch(const Batch&) = delete;  // said outright: a vector type claims to be copyable whatever it holds
  Batch& operator=(const Batch&) = delete;
  Engine::PreparedOps ops;
  bool posted = false;
  py::object engine;  // the engine it was begun on (begin_batch), which posts it
};

// The Batch this thread is recording into (fastcomm.batch or plan), or null: every op issued
// on the thread meanwhile joins it. `t_batch` is the Python object that holds it (a strong
// reference): a pybind11 Batch (begin_batch) or a fastcomm.batch, which holds its own.
thread_local PyObject* t_batch = nullptr;
thread_local Batch* t_recording = nullptr;
// Ops in the last batch this thread posted: the next one reserves room for as many, since a
// loop records the same block again and again, and growing moves every op recorded so far.
thread_local size_t t_batch_hint = 0;

void add_to_batch(Engine& e, Batch& b, Engine::Prepared prep) {
  TORCH_CHECK(!b.posted, "fastcomm: rank ", e.rank(), ": op issued into a batch that was already posted");
  TORCH_CHECK(registered<Engine>(b.engine) == &e, "fastcomm.batch: rank ", e.rank(),
              ": the batch was begun before fastcomm was shut down and initialized again");
  TORCH_CHECK_VALUE(b.ops.empty() || b.ops[0].device.type() == prep.device.type(), "fastcomm.batch: rank ",
                    e.rank(), ": a batch runs on one device; it holds ops on ", b.ops[0].device, " and this one is on ",
                    prep.device);
  b.ops.push_back(std::move(prep));
}

// Every op's entry. inputs: all_to_all's input list; splits: all_to_all_single's (output,
// input) split sizes. Inside a batch or plan being recorded on this thread the op is added to
// it instead of issued.
py::object issue(Engine& e, int kind, const GroupHandle& g, const py::handle& tensor, const py::handle& output,
                 const py::handle& list, const py::handle& op, int peer, int tag, bool async_op,
                 const py::handle& inputs, const py::handle& splits) {
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
    if (nargs != 11)
      throw py::type_error("Engine.issue takes 11 positional arguments, got " + std::to_string(nargs));
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
                         int_arg(args[6], "peer"), int_arg(args[7], "tag"), async_op != 0, args[9], args[10]);
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

void set_ref(PyObject*& slot, PyObject* v) {
  Py_XINCREF(v);
  Py_XDECREF(slot);
  slot = v;
}

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

// Issues a batch's ops together: their Work (async_op), else None once they are done.
py::object post_batch(Engine& e, Batch& b, bool async_op) {
  TORCH_CHECK(!b.posted, "fastcomm: rank ", e.rank(), ": batch posted twice");
  b.posted = true;
  t_batch_hint = b.ops.size();
  c10::intrusive_ptr<Work> w;
  {
    // A blocking batch is driven by the caller alone: no background thread is woken.
    py::gil_scoped_release nogil;
    w = e.run(b.ops, async_op, /*rethrow=*/true);
  }
  b.ops.clear();  // with the GIL held (see issue())
  return async_op ? wrap_work(std::move(w)) : py::none();
}

// The engine a batch or plan recorded now is posted on. Not initialized, or shut down
// underneath (by the torch backend): the Python layer says which, in its words.
py::object current_engine(const char* api) {
  Engine* e = g_engine ? registered<Engine>(g_engine) : nullptr;
  if (e == nullptr || e->is_shut_down()) return py::module_::import("fastcomm._state").attr("_require")(api);
  return py::reinterpret_borrow<py::object>(g_engine);
}

void check_not_recording(const std::string& api) {
  TORCH_CHECK(t_batch == nullptr, "fastcomm.", api, ": ",
              api == "batch" ? "batches do not nest" : "a plan cannot be recorded inside a batch or another plan");
}

void begin_recording(PyObject* owner, Batch& b) {
  set_ref(t_batch, owner);
  t_recording = &b;
  b.ops.reserve(std::min<size_t>(t_batch_hint, 4096));
}

void end_recording() {
  t_recording = nullptr;
  set_ref(t_batch, nullptr);
}

// The recording of a plan or of all_reduce_many (begin_batch, end_batch) as bare functions
// for the same reason as issue: pybind11's dispatch was a good part of their own cost.
// begin_batch(api): api is "batch" or "plan", for messages.
PyObject* begin_batch_entry(PyObject*, PyObject* api_obj) {
  try {
    const std::string api = py::cast<std::string>(api_obj);
    check_not_recording(api);
    py::object engine = current_engine(api.c_str());
    auto* b = new Batch();
    b->engine = std::move(engine);
    py::object batch = py::cast(b, py::return_value_policy::take_ownership);
    begin_recording(batch.ptr(), *b);
    return batch.release().ptr();
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

// end_batch(batch, post, async_op=True)
PyObject* end_batch_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs < 2 || nargs > 3)
      throw py::type_error("end_batch takes 2 or 3 positional arguments, got " + std::to_string(nargs));
    Batch* b = registered<Batch>(args[0]);
    if (b == nullptr) throw py::type_error("end_batch: argument 'batch' must be a Batch");
    const int post = PyObject_IsTrue(args[1]);
    int async_op = 1;
    if (post < 0 || (nargs == 3 && (async_op = PyObject_IsTrue(args[2])) < 0)) throw py::error_already_set();
    end_recording();
    if (!post) Py_RETURN_NONE;
    return post_batch(*registered<Engine>(b->engine), *b, async_op != 0).release().ptr();
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

// fastcomm.batch, a bare CPython type: entering, leaving and waiting run no Python frame, and
// the Batch lives inside the object (no pybind11 instance per use). A program that mixes
// batches of a few ops with blocking calls pays this on every batch.
struct BatchObject {
  PyObject_HEAD
  Batch batch;
  PyObject* work;  // the fastcomm.Work of the posted batch; null before
};

BatchObject* as_batch(PyObject* self) { return reinterpret_cast<BatchObject*>(self); }

PyObject* batch_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "fastcomm.batch() takes no arguments");
    return nullptr;
  }
  PyObject* o = type->tp_alloc(type, 0);
  if (o == nullptr) return nullptr;
  new (&as_batch(o)->batch) Batch();
  as_batch(o)->work = nullptr;
  return o;
}

void batch_dealloc(PyObject* self) {
  as_batch(self)->batch.~Batch();  // (never the recording one: t_batch holds that)
  Py_XDECREF(as_batch(self)->work);
  PyTypeObject* tp = Py_TYPE(self);
  tp->tp_free(self);
  Py_DECREF(tp);
}

PyObject* batch_enter(PyObject* self, PyObject*) {
  try {
    BatchObject* b = as_batch(self);
    check_not_recording("batch");
    py::object engine = current_engine("batch");
    begin_recording(self, b->batch);
    // A batch object used again records anew.
    b->batch.ops.clear();
    b->batch.posted = false;
    b->batch.engine = std::move(engine);
    Py_CLEAR(b->work);
    Py_INCREF(self);
    return self;
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

// __exit__(exc_type, exc, tb): an exception inside the block discards the batch (nothing was
// sent); otherwise its ops are posted together.
PyObject* batch_exit(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    BatchObject* b = as_batch(self);
    TORCH_CHECK(t_recording == &b->batch, "fastcomm.batch: __exit__ of a batch that is not being recorded");
    end_recording();
    if (nargs == 0 || args[0] == Py_None) {
      Engine* e = registered<Engine>(b->batch.engine);
      TORCH_INTERNAL_ASSERT(e != nullptr, "fastcomm.batch: recorded without an engine");
      b->work = post_batch(*e, b->batch, /*async_op=*/true).release().ptr();
    } else {
      b->batch.ops.clear();
    }
    Py_RETURN_FALSE;
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

Py_ssize_t batch_len(PyObject* self) { return (Py_ssize_t)as_batch(self)->batch.ops.size(); }

// The batch's Work methods, called on its Work once posted.
template <const char* kName>
PyObject* batch_forward(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* work = as_batch(self)->work;
  if (work == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "fastcomm.batch: the batch has not been issued yet (leave the with-block first)");
    return nullptr;
  }
  static PyObject* const name = PyUnicode_InternFromString(kName);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t n = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  if (n > 4) {
    PyErr_Format(PyExc_TypeError, "fastcomm.batch.%s: too many arguments", kName);
    return nullptr;
  }
  PyObject* stack[5] = {work};
  for (Py_ssize_t i = 0; i < n; ++i) stack[i + 1] = args[i];
  return PyObject_VectorcallMethod(name, stack, (size_t)(nargs + 1), kwnames);
}

constexpr char kWait[] = "wait", kIsCompleted[] = "is_completed", kIsSuccess[] = "is_success",
               kException[] = "exception", kGetFuture[] = "get_future";

template <const char* kName>
PyMethodDef forwarded(const char* doc) {
  return {kName, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&batch_forward<kName>)),
          METH_FASTCALL | METH_KEYWORDS, doc};
}

PyMethodDef batch_methods[] = {
    {"__enter__", &batch_enter, METH_NOARGS, nullptr},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&batch_exit)), METH_FASTCALL, nullptr},
    forwarded<kWait>("wait(timeout=None): waits for every op of the batch (Work.wait)"),
    forwarded<kIsCompleted>("Whether every op of the batch has finished"),
    forwarded<kIsSuccess>("Whether every op of the batch has finished without an error"),
    forwarded<kException>("The batch's first error as an exception object, or None"),
    forwarded<kGetFuture>("A torch.futures.Future completed with the batch's outputs"),
    {nullptr, nullptr, 0, nullptr},
};

void add_batch_type(py::module_& m) {
  static PyType_Slot slots[] = {
      {Py_tp_doc, const_cast<char*>(
                      "``with fastcomm.batch() as b:`` -- every op issued in the block (any groups, overlapping or not) "
                      "is validated at once and issued together when the block ends, as one fused step: one write and "
                      "one wake-up per peer. Inside the block ops return None; ``b`` stands for the Work of the whole "
                      "batch (wait, is_completed, is_success, exception, get_future). An exception inside the block "
                      "discards the batch: nothing was sent. ``len(b)``: the ops recorded and not yet issued.")},
      {Py_tp_new, reinterpret_cast<void*>(&batch_new)},
      {Py_tp_dealloc, reinterpret_cast<void*>(&batch_dealloc)},
      {Py_tp_methods, batch_methods},
      {Py_sq_length, reinterpret_cast<void*>(&batch_len)},
      {0, nullptr},
  };
  static PyType_Spec spec = {"fastcomm.batch", sizeof(BatchObject), 0, Py_TPFLAGS_DEFAULT, slots};
  PyObject* t = PyType_FromSpec(&spec);
  if (t == nullptr) throw py::error_already_set();
  m.add_object("batch", py::reinterpret_steal<py::object>(t));
}

PyMethodDef batch_defs[] = {
    {"begin_batch", reinterpret_cast<PyCFunction>(&begin_batch_entry), METH_O,
     "begin_batch(api): a new Batch that every op this thread issues joins (api: 'batch' or 'plan', for "
     "messages) until end_batch"},
    {"end_batch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&end_batch_entry)), METH_FASTCALL,
     "end_batch(batch, post, async_op=True): ops issue again; post: issue the batch's ops together, and "
     "return their Work (async_op) or None once they are done (not post: a plan's recording, or a "
     "discarded batch)"},
};

PyMethodDef issue_def = {
    "issue", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&issue_entry)), METH_FASTCALL,
    "issue(kind, group, tensor, output, list, op, peer, tag, async_op, inputs, splits): every op's "
    "entry (positional only; from fastcomm/collectives.py)"};

}  // namespace


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastcomm native engine";
  m.def("reduce_kernels", &reduce_kernels,
        "The build of the reduction loops this process runs: 'avx2' or 'baseline' (picked when "
        "an engine starts; FASTCOMM_REDUCE_KERNELS=baseline forces the baseline one)");
  m.def("shared_empty", &shared_empty, py::arg("sizes"), py::arg("dtype"),
        "A contiguous CPU tensor in a new buffer that same-host ranks can map (fastcomm.empty)");
  m.attr("has_nccl") = device_engine_factory(c10::kCUDA) != nullptr;
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
      .def_readwrite("hierarchical", &Settings::hierarchical)
      .def_readwrite("rsag_threshold", &Settings::rsag_threshold)
      .def_readwrite("gloo_bulk_bytes", &Settings::gloo_bulk_bytes)
      .def_readwrite("baseline_kernels", &Settings::baseline_kernels);

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
          [](const std::shared_ptr<Plan>& p, bool naive) { return p->engine().capture(p, naive); },
          py::arg("naive") = false, py::call_guard<py::gil_scoped_release>());

  // A plan captured into a CUDA graph (fastcomm.plan.capture).
  py::class_<DeviceGraph, std::shared_ptr<DeviceGraph>>(m, "PlanGraph")
      .def("replay", &DeviceGraph::replay, py::call_guard<py::gil_scoped_release>())
      .def(
          "wait", [](DeviceGraph& g, int64_t timeout_ms) { g.wait(std::chrono::milliseconds(timeout_ms)); },
          py::arg("timeout_ms") = 0, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("replays", &DeviceGraph::replays)
      .def_property_readonly("recorded", &DeviceGraph::recorded)
      .def_property_readonly("user_runs", &DeviceGraph::user_runs);

  auto add_functions = [&m](auto& defs) {
    for (PyMethodDef& d : defs)
      m.add_object(d.ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(&d, nullptr, m.attr("__name__").ptr())));
  };
  add_functions(g_fast_defs);
  add_functions(batch_defs);
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
  m.def(
      "recording", [] { return t_batch != nullptr; },
      "Whether this thread is recording a batch or plan (begin_batch without end_batch)");

  // Engine.issue, the bare entry above, as a method of Engine (a descriptor checks `self`'s type).
  {
    py::object engine = m.attr("Engine");
    PyObject* d = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(engine.ptr()), &issue_def);
    if (d == nullptr) throw py::error_already_set();
    engine.attr("issue") = py::reinterpret_steal<py::object>(d);
  }

  add_work_type(m);
  add_batch_type(m);
  register_backend_bindings(m);  // the torch.distributed backend (csrc/backend)
}
