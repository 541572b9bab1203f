#include "bindings_work.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace py = pybind11;

namespace fastcomm {

namespace {

struct WorkObject {
  PyObject_HEAD
  Work* w;          // one reference, from intrusive_ptr::release()
  PyObject* group;  // irecv's group handle: maps the sender's group rank to a global one; or null
  PyObject* bound;  // torch's binding of the same Work, made on first use; or null
};

PyTypeObject* g_type = nullptr;

WorkObject* as_work(PyObject* self) { return reinterpret_cast<WorkObject*>(self); }

// `f` returns a new reference; its C++ errors become the Python exceptions torch's
// translators make of them (DistBackendError, ...).
template <typename F>
PyObject* guarded(F&& f) {
  try {
    return f();
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

PyObject* bound_of(PyObject* self) {  // borrowed
  WorkObject* o = as_work(self);
  if (o->bound == nullptr) {
    c10::intrusive_ptr<c10d::Work> w = c10::intrusive_ptr<Work>::reclaim_copy(o->w);
    o->bound = py::cast(std::move(w)).release().ptr();
  }
  return o->bound;
}

PyObject* call_bound(PyObject* self, const char* method) {
  return guarded([&] {
    PyObject* r = PyObject_CallMethod(bound_of(self), method, nullptr);
    if (r == nullptr) throw py::error_already_set();
    return r;
  });
}

// wait(timeout=None): timeout a timedelta or seconds.
PyObject* work_wait(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return guarded([&]() -> PyObject* {
    PyObject* timeout = Py_None;
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw > 1) throw py::type_error("Work.wait takes at most 1 argument (timeout)");
    if (nargs == 1) timeout = args[0];
    if (nkw == 1) {
      if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "timeout") != 0)
        throw py::type_error("Work.wait got an unexpected keyword argument");
      timeout = args[0];
    }
    std::chrono::milliseconds ms = ::kNoTimeout;  // (torch declares it outside c10d)
    if (timeout != Py_None) {
      py::handle t(timeout);
      const double secs = py::hasattr(t, "total_seconds") ? t.attr("total_seconds")().cast<double>()
                                                          : py::float_(py::reinterpret_borrow<py::object>(t)).cast<double>();
      // torch reads a zero timeout as "no timeout"; a zero wait here means "do not block".
      const int64_t us = std::isfinite(secs) ? std::llround(secs * 1e6) : INT64_MAX / 2;
      ms = std::chrono::milliseconds(std::max<int64_t>(1, us / 1000));
    }
    Work& w = *as_work(self)->w;
    // A CPU op already done needs no driving: its outcome is read with the GIL kept (giving it
    // up and taking it back is a good part of a finished batch's wait).
    if (!w.on_device() && w.done()) {
      w.rethrow_if_failed();
      Py_RETURN_TRUE;
    }
    bool r;
    {
      py::gil_scoped_release nogil;
      r = w.wait(ms);
    }
    return PyBool_FromLong(r);
  });
}

PyObject* work_is_completed(PyObject* self, PyObject*) {
  return guarded([&] { return PyBool_FromLong(as_work(self)->w->isCompleted()); });
}

PyObject* work_is_success(PyObject* self, PyObject*) {
  return guarded([&] {
    Work& w = *as_work(self)->w;
    return PyBool_FromLong(w.isCompleted() && w.exception() == nullptr);
  });
}

// The error as the exception object a raising call would give (torch's translators make it).
PyObject* work_exception(PyObject* self, PyObject*) {
  return guarded([&]() -> PyObject* {
    std::exception_ptr e = as_work(self)->w->exception();
    if (e == nullptr) Py_RETURN_NONE;
    try {
      std::rethrow_exception(e);
    } catch (...) {
      py::detail::try_translate_exceptions();
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != nullptr) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
  });
}

PyObject* work_result(PyObject* self, PyObject*) {
  return guarded([&] { return py::cast(as_work(self)->w->result()).release().ptr(); });
}

PyObject* work_get_future(PyObject* self, PyObject*) { return call_bound(self, "get_future"); }

PyObject* work_synchronize(PyObject* self, PyObject*) {
  return guarded([&] {
    Work& w = *as_work(self)->w;
    {
      py::gil_scoped_release nogil;
      w.synchronize();
    }
    Py_RETURN_NONE;
  });
}

PyObject* work_block_current_stream(PyObject* self, PyObject*) {
  return guarded([&] {
    Work& w = *as_work(self)->w;
    {
      py::gil_scoped_release nogil;
      w.blockCurrentStream();
    }
    Py_RETURN_NONE;
  });
}

PyObject* work_source_rank(PyObject* self, PyObject*) {
  return guarded([&]() -> PyObject* {
    const int r = as_work(self)->w->sourceRank();
    PyObject* group = as_work(self)->group;
    if (group == nullptr) return PyLong_FromLong(r);
    py::object ranks = py::reinterpret_borrow<py::object>(group).attr("ranks");
    return py::object(ranks[py::int_(r)]).release().ptr();
  });
}

PyObject* work_repr(PyObject* self) {
  return guarded([&] {
    return PyUnicode_FromString(as_work(self)->w->isCompleted() ? "fastcomm.Work(completed)"
                                                                  : "fastcomm.Work(pending)");
  });
}

void work_dealloc(PyObject* self) {
  WorkObject* o = as_work(self);
  Py_XDECREF(o->group);
  Py_XDECREF(o->bound);
  if (o->w != nullptr) c10::intrusive_ptr<Work>::reclaim(o->w);  // dropped here, with the GIL
  PyTypeObject* tp = Py_TYPE(self);
  tp->tp_free(self);
  Py_DECREF(tp);
}

PyObject* make(c10::intrusive_ptr<Work> w, PyObject* group) {
  PyObject* o = g_type->tp_alloc(g_type, 0);
  if (o == nullptr) throw py::error_already_set();
  as_work(o)->w = w.release();
  Py_XINCREF(group);
  as_work(o)->group = group;
  as_work(o)->bound = nullptr;
  return o;
}

// Work(work, group=None): `work` a fastcomm.Work or torch's binding of a fastcomm op's Work;
// `group` the group handle whose ranks source_rank() maps through.
PyObject* work_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
  return guarded([&]() -> PyObject* {
    static const char* names[] = {"work", "group", nullptr};
    PyObject* work = nullptr;
    PyObject* group = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:Work", const_cast<char**>(names), &work, &group))
      return nullptr;
    c10::intrusive_ptr<Work> w;
    if (Py_TYPE(work) == g_type) {
      w = c10::intrusive_ptr<Work>::reclaim_copy(as_work(work)->w);
    } else {
      c10::intrusive_ptr<c10d::Work> base;
      try {
        base = py::cast<c10::intrusive_ptr<c10d::Work>>(py::handle(work));
      } catch (const py::cast_error&) {
      }
      w = c10::dynamic_intrusive_pointer_cast<Work>(base);
      if (!w)
        throw py::type_error("fastcomm.Work wraps the Work of a fastcomm op, got " +
                             std::string(py::str(py::type::of(py::handle(work)))));
    }
    return make(std::move(w), group == Py_None ? nullptr : group);
  });
}

PyMethodDef work_methods[] = {
    {"wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&work_wait)), METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout=None): blocks until the op is done (driving progress on this thread, without the GIL) and "
     "returns True; raises its error, or a timeout error if `timeout` (timedelta or seconds) passes first"},
    {"is_completed", &work_is_completed, METH_NOARGS, "Whether the op has finished, successfully or not"},
    {"is_success", &work_is_success, METH_NOARGS, "Whether the op has finished without an error"},
    {"exception", &work_exception, METH_NOARGS, "The op's error as an exception object, or None (also while running)"},
    {"get_future", &work_get_future, METH_NOARGS, "A torch.futures.Future completed with the op's outputs"},
    {"result", &work_result, METH_NOARGS, "The op's output tensors"},
    {"synchronize", &work_synchronize, METH_NOARGS,
     "CUDA ops: blocks the host until the op has finished on the device (wait() only makes the current stream "
     "wait). CPU ops: nothing to do."},
    {"block_current_stream", &work_block_current_stream, METH_NOARGS,
     "CUDA ops: the current stream waits for the op (the host waits only until its members agreed on it); an "
     "error is left for wait() and exception(). CPU ops: as torch's (a CUDA kernel on the current stream waits)."},
    {"source_rank", &work_source_rank, METH_NOARGS,
     "An irecv's sender, as a global rank, once the receive completed (for one from any source, the member whose "
     "message it took). Raises for other Works, and before then."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void add_work_type(py::module_& m) {
  static PyType_Slot slots[] = {
      {Py_tp_doc, const_cast<char*>(
                      "Handle of an async op or batch, as torch.distributed returns for async_op=True: wait(timeout=None), "
                      "is_completed(), is_success(), exception(), get_future(), result(), synchronize(), block_current_stream(), "
                      "source_rank().")},
      {Py_tp_new, reinterpret_cast<void*>(&work_new)},
      {Py_tp_dealloc, reinterpret_cast<void*>(&work_dealloc)},
      {Py_tp_repr, reinterpret_cast<void*>(&work_repr)},
      {Py_tp_methods, work_methods},
      {0, nullptr},
  };
  static PyType_Spec spec = {"fastcomm.Work", sizeof(WorkObject), 0, Py_TPFLAGS_DEFAULT, slots};
  PyObject* t = PyType_FromSpec(&spec);
  if (t == nullptr) throw py::error_already_set();
  g_type = reinterpret_cast<PyTypeObject*>(t);  // kept for the process's life
  m.add_object("Work", py::reinterpret_borrow<py::object>(t));
}

py::object wrap_work(c10::intrusive_ptr<Work> w) { return py::reinterpret_steal<py::object>(make(std::move(w), nullptr)); }

PyObject* wait_work(PyObject* work, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (Py_TYPE(work) != g_type) {
    PyErr_SetString(PyExc_TypeError, "fastcomm: wait_work takes a fastcomm.Work");
    return nullptr;
  }
  return work_wait(work, args, nargs, kwnames);
}

}  // namespace fastcomm
