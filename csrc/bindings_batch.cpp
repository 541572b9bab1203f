#include "bindings_batch.h"

#include <algorithm>
#include <string>

#include "bindings_common.h"
#include "bindings_entries.h"
#include "bindings_work.h"

namespace py = pybind11;

namespace fastcomm {

thread_local constinit Batch* t_recording = nullptr;

void add_to_batch(Engine& e, Batch& b, Engine::Prepared prep) {
  TORCH_CHECK(!b.posted, "fastcomm: rank ", e.rank(), ": op issued into a batch that was already posted");
  TORCH_CHECK(registered<Engine>(b.engine) == &e, "fastcomm.batch: rank ", e.rank(),
              ": the batch was begun before fastcomm was shut down and initialized again");
  TORCH_CHECK_VALUE(b.ops.empty() || b.ops[0].device.type() == prep.device.type(), "fastcomm.batch: rank ",
                    e.rank(), ": a batch runs on one device; it holds ops on ", b.ops[0].device, " and this one is on ",
                    prep.device);
  b.ops.push_back(std::move(prep));
}

namespace {

// The Python object that holds the Batch being recorded on this thread (a strong reference): a
// pybind11 Batch (begin_batch) or a fastcomm.batch, which holds its own.
thread_local PyObject* t_batch = nullptr;
// Ops in the last batch this thread posted: the next one reserves room for as many, since a
// loop records the same block again and again, and growing moves every op recorded so far.
thread_local size_t t_batch_hint = 0;

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
  bool discarded;  // its with-block raised: nothing was posted
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
  as_batch(o)->discarded = false;
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
    b->discarded = false;
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
      b->discarded = true;
    }
    Py_RETURN_FALSE;
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

Py_ssize_t batch_len(PyObject* self) { return (Py_ssize_t)as_batch(self)->batch.ops.size(); }

constexpr char kWait[] = "wait", kIsCompleted[] = "is_completed", kIsSuccess[] = "is_success",
               kException[] = "exception", kGetFuture[] = "get_future", kResult[] = "result",
               kSynchronize[] = "synchronize", kBlockCurrentStream[] = "block_current_stream";

// The batch's Work methods, called on its Work once posted.
template <const char* kName>
PyObject* batch_forward(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* work = as_batch(self)->work;
  if (work == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    as_batch(self)->discarded
                        ? "fastcomm.batch: the batch's with-block raised, so its ops were discarded (nothing was sent)"
                        : "fastcomm.batch: the batch has not been issued yet (leave the with-block first)");
    return nullptr;
  }
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if constexpr (kName == kWait) return wait_work(work, args, nargs, kwnames);
  static PyObject* const name = PyUnicode_InternFromString(kName);
  const Py_ssize_t n = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  if (n > 4) {
    PyErr_Format(PyExc_TypeError, "fastcomm.batch.%s: too many arguments", kName);
    return nullptr;
  }
  PyObject* stack[5] = {work};
  for (Py_ssize_t i = 0; i < n; ++i) stack[i + 1] = args[i];
  return PyObject_VectorcallMethod(name, stack, (size_t)(nargs + 1), kwnames);
}

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
    forwarded<kResult>("The batch's output tensors, in issue order (Work.result)"),
    forwarded<kSynchronize>("Waits for every op of the batch on the host, device work included (Work.synchronize)"),
    forwarded<kBlockCurrentStream>("The current stream waits for every op of the batch (Work.block_current_stream)"),
    {nullptr, nullptr, 0, nullptr},
};

PyMethodDef batch_defs[] = {
    {"begin_batch", reinterpret_cast<PyCFunction>(&begin_batch_entry), METH_O,
     "begin_batch(api): a new Batch that every op this thread issues joins (api: 'batch' or 'plan', for "
     "messages) until end_batch"},
    {"end_batch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&end_batch_entry)), METH_FASTCALL,
     "end_batch(batch, post, async_op=True): ops issue again; post: issue the batch's ops together, and "
     "return their Work (async_op) or None once they are done (not post: a plan's recording, or a "
     "discarded batch)"},
};

}  // namespace

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

void add_batch_functions(py::module_& m) {
  add_functions(m, batch_defs);
  m.def(
      "recording", [] { return t_batch != nullptr; },
      "Whether this thread is recording a batch or plan (begin_batch without end_batch)");
}

}  // namespace fastcomm
