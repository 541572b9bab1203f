#pragma once
// Same-host blocks on CUDA (Runtime::ipc_create and the flags, device/runtime.h): the data in
// cudaMalloc memory shared with cudaIpcGetMemHandle (the caching allocator's blocks cannot be
// opened by another process), the flags in a /dev/shm page both processes map and register with
// CUDA, written and waited on by stream memory operations (cuStreamWriteValue32 and
// cuStreamWaitValue32, GEQ). A flag wait is the GPU front end's semaphore acquire, the same
// mechanism an event wait uses, not a kernel: processes that time-slice one GPU keep going, and
// the host can release a wait whose writer died by storing the flag itself.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "device/runtime.h"

namespace fastcomm {
namespace cuda {

using IpcHandle = device::Runtime::IpcHandle;
using IpcBlock = device::Runtime::IpcBlock;
using IpcClaim = device::Runtime::IpcClaim;

// Stream memory operations are available and the device reads registered host memory at the
// host's addresses.
bool ipc_supported(int device);
// Whether stream flag waits and writes can be captured into a graph and run at its launch
// (tried once per process: a capture of both on a stream of its own, launched once).
bool ipc_graphs(int device);
// `host`: the data after the flags in the /dev/shm segment (pinned and registered in both
// processes), for a peer whose device cannot read this device's memory.
void* ipc_create(int device, size_t bytes, int nflags, IpcHandle* h, IpcBlock* b, bool host);
// A host block, or a device block on `device` or on one `device` has peer access to.
bool ipc_readable(int device, const IpcHandle& h);
// With the flags mapped, `claim.take` decides whether the data is mapped too (device::Runtime).
void* ipc_open(int device, const IpcHandle& h, IpcBlock* b, const IpcClaim& claim);
void ipc_close(int device, void* token);
// An opened device block's memory handle closed, its flags still mapped (Runtime::ipc_close_data).
void ipc_close_data(int device, void* token);
void flag_write(uint32_t* flag, uint32_t value, cudaStream_t s);
void flag_wait(cudaStream_t s, const uint32_t* flag, uint32_t value);

}  // namespace cuda
}  // namespace fastcomm
