#pragma once
// The fake runtime's same-host blocks (Runtime::ipc_create and the flags, device/runtime.h):
// a block is a /dev/shm segment two processes map, its "device memory" and its flags in one;
// a flag wait blocks its stream's thread on a futex over the shared word, so an order between
// the work of two processes holds only where the engine asked for it. Included by
// fake_runtime.cpp only.
#include <cstddef>
#include <cstdint>

#include "device/runtime.h"

namespace fastcomm {
namespace device {
namespace fake {

void* ipc_create(size_t bytes, int nflags, Runtime::IpcHandle* h, Runtime::IpcBlock* b);
void* ipc_open(const Runtime::IpcHandle& h, Runtime::IpcBlock* b);
void ipc_close(void* token);
// A store (release) that wakes the flag's waiters in any process.
void flag_store(uint32_t* flag, uint32_t value);
// Blocks until (int32_t)(*flag - value) >= 0.
void flag_block(const uint32_t* flag, uint32_t value);
// Segments this process made or opened and has not closed yet (debug "ipc_blocks").
int64_t ipc_blocks();

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
