#pragma once
// Whether a process of this host has exited: the one liveness check for same-host peers, used
// by every path that waits on one (shared-memory rings, the CUDA watchdog).
#include <cstdint>

namespace fastcomm {

// A pid <= 0 is unknown: reported alive.
bool process_gone(int64_t pid);

}  // namespace fastcomm
