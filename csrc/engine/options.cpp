#include "engine/options.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace fastcomm {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int64_t env_int(const char* name, int64_t fallback, int64_t min) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(end && *end == '\0' && x >= min, "fastcomm: ", name, " must be an integer >= ", min,
                    ", got '", v, "'");
  return x;
}

// A switch: "0" or "1" only, so that a typo ("true", "off") is refused rather than read as one
// of them.
bool env_flag(const char* name, bool fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  TORCH_CHECK_VALUE(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0, "fastcomm: ", name,
                    " must be 0 or 1, got '", v, "'");
  return v[0] == '1';
}

}  // namespace

Settings Settings::from_env() {
  Settings s;
  if (const char* v = env("FASTCOMM_HOST_ID")) s.host_id = v;
  s.ring_bytes = (size_t)env_int("FASTCOMM_SHM_RING_BYTES", (int64_t)s.ring_bytes, 1);
  if (const char* v = env("FASTCOMM_SHM_STREAM_STORES")) {
    TORCH_CHECK_VALUE(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0 || std::strcmp(v, "auto") == 0,
                      "fastcomm: FASTCOMM_SHM_STREAM_STORES must be '0', '1' or 'auto', got '", v, "'");
    s.shm_stream_stores = std::strcmp(v, "auto") == 0 ? -1 : std::strcmp(v, "1") == 0 ? 1 : 0;
  }
  const int64_t direct = env_int("FASTCOMM_SHM_DIRECT_BYTES", (int64_t)s.shm_direct_bytes, 0);
  s.shm_direct_bytes = direct == 0 ? SIZE_MAX : (size_t)direct;
  s.spin_ns = env_int("FASTCOMM_SPIN_NS", -1, -1);
  s.yield_ns = env_int("FASTCOMM_YIELD_NS", -1, -1);
  s.exit_idle = env_flag("FASTCOMM_EXIT_IDLE", s.exit_idle);
  s.hierarchical = env_flag("FASTCOMM_HIERARCHICAL", s.hierarchical);
  s.rsag_threshold = (size_t)env_int("FASTCOMM_RSAG_THRESHOLD", (int64_t)s.rsag_threshold, 0);
  const int64_t bulk = env_int("FASTCOMM_GLOO_BULK_BYTES", -1, 0);
  s.gloo_bulk_bytes = bulk < 0 ? 0 : bulk == 0 ? SIZE_MAX : (size_t)bulk;
  if (const char* v = env("FASTCOMM_REDUCE_KERNELS")) {
    TORCH_CHECK_VALUE(std::strcmp(v, "baseline") == 0 || std::strcmp(v, "auto") == 0,
                      "fastcomm: FASTCOMM_REDUCE_KERNELS must be 'baseline' or 'auto', got '", v, "'");
    s.baseline_kernels = std::strcmp(v, "baseline") == 0;
  }
  s.fake_device = env_flag("FASTCOMM_FAKE_DEVICE", s.fake_device);
  s.device_idle_ms = env_int("FASTCOMM_DEVICE_IDLE_MS", s.device_idle_ms, 1);
  s.device_max_comms = env_int("FASTCOMM_DEVICE_MAX_COMMS", s.device_max_comms, 1);
  s.device_max_kernels = env_int("FASTCOMM_DEVICE_MAX_KERNELS", s.device_max_kernels, 0);
  s.device_pair_blocking = env_flag("FASTCOMM_DEVICE_PAIR_BLOCKING", s.device_pair_blocking);
  if (const char* v = env("FASTCOMM_DEVICE_IPC")) {
    TORCH_CHECK_VALUE(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0 || std::strcmp(v, "auto") == 0,
                      "fastcomm: FASTCOMM_DEVICE_IPC must be 0, 1 or auto, got '", v, "'");
    s.device_ipc = std::strcmp(v, "auto") == 0 ? -1 : std::atoi(v);
  }
  s.device_ipc_ring_bytes = (size_t)env_int("FASTCOMM_DEVICE_IPC_RING_BYTES", (int64_t)s.device_ipc_ring_bytes, 4096);
  s.device_ipc_fuse_bytes = (size_t)env_int("FASTCOMM_DEVICE_IPC_FUSE_BYTES", (int64_t)s.device_ipc_fuse_bytes, 0);
  // One block moves a fused chunk: past a few tens of KiB that costs more than it saves.
  TORCH_CHECK_VALUE(s.device_ipc_fuse_bytes <= 65536, "fastcomm: FASTCOMM_DEVICE_IPC_FUSE_BYTES must be at most 65536, got ",
                    s.device_ipc_fuse_bytes);
  s.device_ipc_group_max = env_int("FASTCOMM_DEVICE_IPC_GROUP_MAX", s.device_ipc_group_max, 0);
  if (const char* v = env("FASTCOMM_DEVICE_SCHEME")) {
    TORCH_CHECK_VALUE(std::strcmp(v, "channels") == 0 || std::strcmp(v, "single-stream") == 0,
                      "fastcomm: FASTCOMM_DEVICE_SCHEME must be 'channels' or 'single-stream', got '", v, "'");
    s.device_single_stream = std::strcmp(v, "single-stream") == 0;
  }
  return s;
}

}  // namespace fastcomm
