#pragma once
// fastcomm.Work, the handle the native API returns for async ops and batches: a bare CPython
// type around the engine's Work. The hot calls (making one, wait(), is_completed()) touch no
// pybind11 caster and no Python frame; the rest (get_future(), result(), exception(), ...) go
// through torch's own c10d Work binding, made on first use.
#include <torch/csrc/utils/pybind.h>

#include "engine/work.h"

namespace fastcomm {

// Creates the type and adds it to `m` as "Work".
void add_work_type(pybind11::module_& m);
// A new fastcomm.Work holding `w` (a new reference; raises on failure).
pybind11::object wrap_work(c10::intrusive_ptr<Work> w);
// Work.wait(timeout=None) of `work`, a fastcomm.Work, called without looking the method up.
PyObject* wait_work(PyObject* work, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames);

}  // namespace fastcomm
