#pragma once
// How an op gets from Python to the engine: Engine.issue, and the fast entries of the hot
// collectives (fastcomm.all_reduce, ...) over the engine and world group set by set_current.
#include <torch/csrc/utils/pybind.h>

namespace fastcomm {

// The engine a batch or plan recorded now is posted on. Not initialized, or shut down
// underneath (by the torch backend): the Python layer says which, in its words.
py::object current_engine(const char* api);

// Engine.issue (on `m`'s Engine, which must exist), the fast entries, set_current and
// set_fast_entry.
void add_entries(py::module_& m);

}  // namespace fastcomm
