#pragma once
// The fake runtime's same-host blocks (Runtime::ipc_create and the flags, device/runtime.h):
// a block is a /dev/shm segment two processes map, its "device memory" and its flags in one;
// a flag wait blocks its stream's thread on a futex over the shared word, so an order between
// the work of two processes holds only where the engine asked for it. Included by
// fake_runtime_impl.h only.
#include <cstddef>
#include <cstdint>

#include "device/runtime.h"

namespace fastcomm {
namespace device {
namespace fake {

// `host`: a ring in (simulated) host memory, which every fake device reads.
void* ipc_create(size_t bytes, int nflags, Runtime::IpcHandle* h, Runtime::IpcBlock* b, bool host);
// A device block of another fake device is readable only with peer access (set_peer_access);
// ipc_open refuses what is not, as cudaIpcOpenMemHandle does.
bool ipc_readable(const Runtime::IpcHandle& h);
// A device block's data counts as mapped by the opener from after `claim.take` until its close;
// its owner freeing it meanwhile is counted (debug "ipc_freed_while_mapped"), as CUDA leaves that
// undefined. With set_open_hold(true), ipc_open waits, the data mapped, until it is released.
void* ipc_open(const Runtime::IpcHandle& h, Runtime::IpcBlock* b, const Runtime::IpcClaim& claim);
void set_open_hold(bool on);
// An opened block's data unmapped (its flags stay mapped until ipc_close).
void ipc_close_data(void* token);
int64_t freed_while_mapped();
// Test hooks (debug "fake_device", "peer_access"): the fake device this process drives (all
// are device 0 unless set), and whether distinct fake devices have peer access (default yes).
void set_device(int device);
void set_peer_access(bool on);
void ipc_close(void* token);
// A store (release) that wakes the flag's waiters in any process.
void flag_store(uint32_t* flag, uint32_t value);
// Blocks until (int32_t)(*flag - value) >= 0.
void flag_block(const uint32_t* flag, uint32_t value);
// Enqueue-time bookkeeping of stream flag writes and waits: a wait enqueued for a value that
// no write enqueued so far (by either process) stores is counted (debug "ipc_early_waits"): a
// GPU stream would hold its hardware queue on it, and the work of other streams behind it.
void note_write(const uint32_t* flag, uint32_t value);
void note_wait(const uint32_t* flag, uint32_t value);
// Segments this process made or opened and has not closed yet (debug "ipc_blocks").
int64_t ipc_blocks();
int64_t early_waits();

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
