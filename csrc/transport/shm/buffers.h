#pragma once
// Tensors in memory that the other processes of this host can map (fastcomm.empty). Each
// buffer is an anonymous shared-memory file (memfd) of this process; a same-host peer takes a
// duplicate of its descriptor with pidfd_getfd and maps it, so nothing is ever named in
// /dev/shm and the memory goes when the last process that maps it lets go. Ops over such
// tensors let members read each other's data in place (algorithms/direct.h) instead of copying
// it through the rings.
//
// Thread-safety: the registry is process-wide and locked; buffers may be made and freed on any
// thread, before init and after shutdown.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <cstdint>

#include "transport/transport.h"

namespace fastcomm {

// A tensor of `sizes` and `dtype`, contiguous, in a new shared buffer (contents undefined).
at::Tensor shared_empty(c10::IntArrayRef sizes, c10::ScalarType dtype);

// Where [p, p + n) lies in one of this process's shared buffers: fills `out` and returns true.
bool find_shared_span(const void* p, size_t n, SharedSpan* out);

}  // namespace fastcomm
