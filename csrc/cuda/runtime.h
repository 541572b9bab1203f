#pragma once
// The real device::Runtime (device/runtime.h) over CUDA and NCCL, for one device, and the one
// checking macro through which every CUDA and NCCL call of csrc/cuda goes.
//
// Pair channels' communicators (two ranks, with `blocking_pairs`) are in NCCL's blocking mode:
// a launch enqueues on the calling thread and starts no thread. What would block, the init and
// the first contact with the peer, runs once per communicator on a thread of the runtime's
// (cuda/comms.cpp, open_pair); comm_state() says kPending until it is done, and an abort meanwhile
// is left to that thread. Other communicators are non-blocking (config.blocking = 0): NCCL then
// enqueues a group's kernels from a thread it starts at every ncclGroupEnd, which returns
// ncclInProgress, and the communicator takes no new call until ncclCommGetAsyncError says it is
// done. Meanwhile comm_state() says kPending. The runtime keeps
// device/runtime.h's stream order over that gap: a record() or keep() on a stream whose NCCL
// work is still being enqueued is deferred until it is, query() polls without blocking, and
// every other call touching that stream, its communicators or such an event waits for the
// enqueue (which needs the peer only at first contact), at most `block_limit`.
// Streams are recycled, never destroyed (see new_stream); comm_destroy finalizes, and aborts a
// non-blocking communicator that does not finalize within 10 s (a blocking one's finalize
// returns only once NCCL is done: the engine ends those only when they look idle).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <memory>

#include "common/errors.h"
#include "device/runtime.h"

namespace fastcomm {
namespace cuda {

// On failure: the project's transport error (DistBackendError) with the call, file:line and
// NCCL's or CUDA's own message (for NCCL with the communicator's ncclGetLastError).
[[noreturn]] void fail(ncclResult_t r, ncclComm_t comm, const char* expr, const char* file, int line);
[[noreturn]] void fail(cudaError_t r, ncclComm_t comm, const char* expr, const char* file, int line);
// ncclInProgress is success: communicators are non-blocking.
inline bool ok(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }
inline bool ok(cudaError_t r) { return r == cudaSuccess; }
template <typename R>
inline R check(R r, ncclComm_t comm, const char* expr, const char* file, int line) {
  if (!ok(r)) fail(r, comm, expr, file, line);
  return r;
}

// Releasing memory, or cleaning up on a path that is already failing: a failure is reported
// (a warning naming the call) but never raised, and not at all once the process is tearing
// CUDA down, where every call fails alike.
void warn(cudaError_t r, const char* expr, const char* file, int line);

}  // namespace cuda
}  // namespace fastcomm

// `FASTCOMM_GPU_CHECK(call)` raises on failure and otherwise yields the call's result (so an
// ncclInProgress can be told from an ncclSuccess); FASTCOMM_GPU_CHECK_COMM adds the
// communicator's ncclGetLastError detail.
#define FASTCOMM_GPU_CHECK_COMM(call, comm) ::fastcomm::cuda::check((call), (comm), #call, __FILE__, __LINE__)
#define FASTCOMM_GPU_CHECK(call) FASTCOMM_GPU_CHECK_COMM(call, nullptr)
#define FASTCOMM_GPU_WARN(call) ::fastcomm::cuda::warn((call), #call, __FILE__, __LINE__)

namespace fastcomm {
namespace device {

// The runtime for CUDA device `device`. A call that must wait for NCCL to finish enqueueing
// earlier work (see above) raises CommError after `block_limit`.
std::unique_ptr<Runtime> make_cuda_runtime(int device,
                                           std::chrono::milliseconds block_limit = std::chrono::minutes(5),
                                           bool blocking_pairs = true);

}  // namespace device
}  // namespace fastcomm
