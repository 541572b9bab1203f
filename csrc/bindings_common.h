#pragma once
// Helpers every bindings_*.cpp file uses.
#include <torch/csrc/utils/pybind.h>

namespace fastcomm {

// The C++ object behind `h` if it is a T (or derives from one), else null. pybind11's own
// casters look the type up in a hash map keyed by the type's name on every call, a good part
// of a blocking op's cost; the lookup is done once here.
template <typename T>
T* registered(const py::handle& h) {
  static const py::detail::type_info* const ti = py::detail::get_type_info(typeid(T), /*throw_if_missing=*/true);
  py::detail::type_caster_generic c(ti);
  return c.load(h, /*convert=*/false) ? static_cast<T*>(c.value) : nullptr;
}

inline void set_ref(PyObject*& slot, PyObject* v) {
  Py_XINCREF(v);
  Py_XDECREF(slot);
  slot = v;
}

// Adds each of `defs` (PyMethodDef) to `m` as a module function.
template <typename Defs>
void add_functions(py::module_& m, Defs& defs) {
  for (PyMethodDef& d : defs)
    m.add_object(d.ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(&d, nullptr, m.attr("__name__").ptr())));
}

}  // namespace fastcomm
