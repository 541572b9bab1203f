#pragma once
// Batches: the recording of ops issued inside `with fastcomm.batch()`, a plan or
// all_reduce_many (begin_batch/end_batch), and the fastcomm.batch type.
#include <torch/csrc/utils/pybind.h>

#include "engine/engine.h"

namespace fastcomm {

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
// on the thread meanwhile joins it. constinit: read by every op, and so with no TLS wrapper call.
extern thread_local constinit Batch* t_recording;

// Adds `prep` to `b` (an op issued while `b` is being recorded).
void add_to_batch(Engine& e, Batch& b, Engine::Prepared prep);

// Creates the type and adds it to `m` as "batch".
void add_batch_type(py::module_& m);
// begin_batch, end_batch and recording.
void add_batch_functions(py::module_& m);

}  // namespace fastcomm
