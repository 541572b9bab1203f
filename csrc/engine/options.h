#pragma once
// Everything an engine is configured by: what the rendezvous found, and every FASTCOMM_*
// environment variable, each parsed once here (Settings::from_env) and passed down from the
// engine; nothing below reads the environment. docs/settings.md lists them.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fastcomm {

struct Settings {
  std::string host_id;             // FASTCOMM_HOST_ID: ranks with equal ids share memory
  size_t ring_bytes = 1 << 20;     // FASTCOMM_SHM_RING_BYTES: each peer's ring, per direction
  int shm_stream_stores = -1;      // FASTCOMM_SHM_STREAM_STORES: 1 always, 0 never, -1 when a
                                   // plain copy into a ring runs slow (transport/shm/transport.h)
  size_t shm_direct_bytes = 256 * 1024;  // FASTCOMM_SHM_DIRECT_BYTES: an all_reduce of at
                                         // least this many bytes on one host reads members'
                                         // fastcomm.empty tensors in place (0: never)
  int64_t spin_ns = -1;            // FASTCOMM_SPIN_NS: a waiter polls this long (-1: picked
  int64_t yield_ns = -1;           // FASTCOMM_YIELD_NS: ... then yields this long, then sleeps
  bool exit_idle = true;           // FASTCOMM_EXIT_IDLE: at interpreter exit a rank with same-host
                                   // peers runs its teardown under SCHED_IDLE (0: as it was)
  bool hierarchical = true;        // FASTCOMM_HIERARCHICAL=0: groups spanning hosts run flat
  size_t rsag_threshold = 256 * 1024;  // FASTCOMM_RSAG_THRESHOLD: bytes from which groups of 3+
                                       // reduce-scatter + all-gather
  size_t gloo_bulk_bytes = 0;      // FASTCOMM_GLOO_BULK_BYTES: 0 adaptive, SIZE_MAX never
  bool baseline_kernels = false;   // FASTCOMM_REDUCE_KERNELS=baseline: no AVX2 loops
  bool fake_device = false;        // FASTCOMM_FAKE_DEVICE=1: the device path's ops on CPU
                                   // tensors run on the fake device runtime (tests)
  bool device_single_stream = false;  // FASTCOMM_DEVICE_SCHEME=single-stream: the device
                                      // engine's former scheme, one stream, no agreed order
                                      // (tests show the fake deadlocks on it as NCCL does)
  int64_t device_idle_ms = 30000;  // FASTCOMM_DEVICE_IDLE_MS: a pair channel's communicator idle
                                   // this long is released (the next op makes a new one)
  int64_t device_max_comms = 32;   // FASTCOMM_DEVICE_MAX_COMMS: past this many channel
                                   // communicators, idle ones are released, least recently used first
  int64_t device_max_kernels = 8;  // FASTCOMM_DEVICE_MAX_KERNELS: NCCL channels (streams with a
                                   // communicator kernel launched, not harvested) in flight per
                                   // device at once; 0: unbounded (docs/design.md, "Kernels in flight")
  bool device_pair_blocking = true;  // FASTCOMM_DEVICE_PAIR_BLOCKING: pair channels' NCCL
                                     // communicators in NCCL's blocking mode (a launch enqueues
                                     // on the engine thread; 0: NCCL starts a thread per launch)
  int device_ipc = -1;             // FASTCOMM_DEVICE_IPC: same-host pair channels over CUDA IPC
                                   // (1), over NCCL (0), or auto (-1: IPC on a GPU, NCCL on the fake)
  size_t device_ipc_ring_bytes = size_t(2) << 20;  // FASTCOMM_DEVICE_IPC_RING_BYTES: an IPC
                                                   // channel's staging ring, per direction
  size_t device_ipc_fuse_bytes = size_t(16) << 10;  // FASTCOMM_DEVICE_IPC_FUSE_BYTES: IPC chunks up
                                                    // to this size go as one kernel with their
                                                    // flag (0: a copy or fold, then a flag write)
  int64_t device_ipc_group_max = 8;  // FASTCOMM_DEVICE_IPC_GROUP_MAX: groups of 3 up to this many
                                     // members, all on one host with IPC links between them, run
                                     // their large ops over the links; larger ones stay on NCCL

  // Reads and validates every variable; a malformed value is a ValueError naming it.
  static Settings from_env();
};

struct EngineOptions {
  int rank = 0;
  int world_size = 1;
  std::string token;            // random per job, from the store
  std::vector<int> host_of;     // host index per global rank
  std::vector<int64_t> pids;    // pid per global rank
  int64_t timeout_ms = 300000;  // an op not finished by then fails
  Settings settings;
};

}  // namespace fastcomm
