#pragma once
// The one narrow interface between the device engine (device/engine.h) and a GPU: the CUDA
// stream and event calls and the NCCL calls it uses, nothing else. Two implementations repeat
// it: the real one over CUDA and NCCL (cuda/runtime.cpp, CUDA builds only) and a CPU one that
// keeps their semantics (device/fake_runtime.cpp, every build), on which CI runs the device
// engine's whole logic without a GPU.
//
// Semantics every implementation keeps (those of CUDA and NCCL):
// - A stream runs its work in the order it was enqueued; work on different streams is
//   unordered unless a wait() orders it. wait(s, e) orders s after the work the latest
//   record(e, .) before the call covered (a never-recorded event is complete).
// - A communicator of n ranks is made from a UniqueId one rank made and gave the others, and
//   is non-blocking: comm_init returns at once, comm_state says kPending until it is usable.
//   It connects to a peer at the first work that involves that peer (first contact), inside
//   the stream's execution, not at init.
// - Between group_start() and group_end() calls on any communicators are one group: their
//   sends and receives progress together (a send and a receive to the same peer do not wait on
//   each other). A communicator matches its sends and receives with each peer in issue order.
//   A send completes only once its matching receive runs: a peer that never posts it leaves
//   the sender's stream stuck.
// - Errors found later (a peer gone, a connection refused) are asynchronous: comm_state
//   reports kFailed with the reason. comm_abort ends the communicator's work, which then
//   completes without moving data (so streams behind it drain); it may be called from any
//   thread while none is inside another call on that communicator.
// Failures of the calls themselves raise CommError (common/errors.h) naming the call.
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace fastcomm {
namespace device {

using Stream = void*;  // cudaStream_t, or the fake's stream
using Event = void*;   // cudaEvent_t, or the fake's event
using Comm = void*;    // ncclComm_t, or the fake's communicator

struct UniqueId {
  std::array<uint8_t, 128> bytes{};  // ncclUniqueId's size
};

enum class State { kReady, kPending, kFailed };

// One reduction the fold kernel runs: dst[i] = fold over group ranks 0..n-1 of their
// contribution, `own` at position `me` and the others' in `scratch` ((n - 1) * numel, in
// group-rank order). Folded in group-rank order, so every member gets bit-identical results.
// MIN and MAX propagate NaN, as torch does.
struct FoldJob {
  void* dst;
  const void* own;
  const void* scratch;
  int64_t numel;
  int32_t n;
  int32_t me;
  c10::ScalarType dtype;
  c10d::ReduceOp::RedOpType op;  // SUM, AVG, PRODUCT, MIN, MAX
};

class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual const char* name() const = 0;  // "nccl" or "fake"
  virtual int device() const = 0;        // the device index this runtime drives

  // ---- streams, events, memory (all on this runtime's device)
  virtual Stream new_stream() = 0;
  virtual void destroy_stream(Stream s) = 0;
  // The calling thread's current stream (torch's current CUDA stream); not owned.
  virtual Stream current_stream() = 0;
  // Whether `s` is being captured into a CUDA graph (work enqueued then runs at replay).
  virtual bool capturing(Stream s) = 0;
  // Puts the calling thread in the relaxed capture mode (cudaThreadExchangeStreamCaptureMode):
  // its event queries and syncs never invalidate a graph that another thread captures in the
  // global mode. The device engine's thread calls it once.
  virtual void relax_capture_mode() = 0;
  // Sets the calling thread's capture mode (kCaptureRelaxed, or one this returned before) and
  // returns the one it had: push-pop for a caller's thread (RelaxedCapture).
  static constexpr int kCaptureRelaxed = 2;  // cudaStreamCaptureModeRelaxed
  virtual int exchange_capture_mode(int mode) = 0;
  virtual Event new_event() = 0;
  virtual void destroy_event(Event e) = 0;
  virtual void record(Event e, Stream s) = 0;
  virtual void wait(Stream s, Event e) = 0;
  // kReady once the work the latest record covered has run; kPending before. Never kFailed.
  virtual State query(Event e) = 0;
  // Host-blocks until the event is ready (synchronize).
  virtual void synchronize(Event e) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes, Stream s) = 0;
  // Enqueues the folds of `count` jobs on `s`.
  virtual void fold(const FoldJob* jobs, int count, Stream s) = 0;
  // A tensor of `numel` elements like `like`, whose memory the allocator reuses only after
  // the work enqueued on `s` until now (torch's caching allocator on a side stream).
  virtual at::Tensor scratch(int64_t numel, const at::Tensor& like, Stream s) = 0;
  // Keeps `t`'s memory from reuse until the work enqueued on `s` until now has run
  // (recordStream).
  virtual void keep(const at::Tensor& t, Stream s) = 0;

  // ---- communicators (NCCL)
  virtual UniqueId new_id() = 0;
  virtual Comm comm_init(const UniqueId& id, int nranks, int rank) = 0;
  // The communicator's init progress and asynchronous errors; `why` gets the reason of kFailed.
  virtual State comm_state(Comm c, std::string* why) = 0;
  virtual void comm_abort(Comm c) = 0;
  // Frees a communicator whose work has all run, or that was aborted.
  virtual void comm_destroy(Comm c) = 0;
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  virtual void send(const void* buf, size_t bytes, int peer, Comm c, Stream s) = 0;
  virtual void recv(void* buf, size_t bytes, int peer, Comm c, Stream s) = 0;
  // Collectives over all of a communicator's ranks, `count` elements of `dtype` per rank
  // (SUM, AVG, PRODUCT only; MIN and MAX go through fold, which propagates NaN).
  virtual void all_reduce(const void* in, void* out, int64_t count, c10::ScalarType dtype,
                          c10d::ReduceOp::RedOpType op, Comm c, Stream s) = 0;
  virtual void broadcast(void* buf, size_t bytes, int root, Comm c, Stream s) = 0;
  // `out` holds nranks blocks of `bytes`, rank i's at i * bytes.
  virtual void all_gather(const void* in, void* out, size_t bytes, Comm c, Stream s) = 0;
  // `in` holds nranks blocks of `count` elements; rank i gets the reduction of block i.
  virtual void reduce_scatter(const void* in, void* out, int64_t count, c10::ScalarType dtype,
                              c10d::ReduceOp::RedOpType op, Comm c, Stream s) = 0;

  // ---- same-host memory and flags (the IPC channel, device/ipc_link.h)
  // A block two processes of one host share: `data`, device memory (the fake's: a /dev/shm
  // segment), and `flags`, 32-bit words in host memory both processes map and the device can
  // wait on and write (zeroed at creation). Stream memory operations on these flags, not
  // interprocess events, order one process's work after another's: a peer that dies leaves no
  // wait that this side cannot release (flag_set).
  struct IpcHandle {
    std::array<uint8_t, 112> bytes{};
  };
  struct IpcBlock {
    void* data = nullptr;
    uint32_t* flags = nullptr;
  };
  // Whether this runtime can make and open blocks (false: channels stay on NCCL).
  virtual bool ipc_supported() { return false; }
  // A new block of `bytes` and `nflags` flags; `h` gets what a process of this host opens it
  // with. Returns the block's owner token for ipc_close. `host`: its data in host memory both
  // processes map, pinned and registered with the device, for a peer whose device cannot read
  // this one's memory (no peer access): both devices copy to and from it.
  virtual void* ipc_create(size_t bytes, int nflags, IpcHandle* h, IpcBlock* b, bool host);
  // Whether this process's device can read the block `h` names: a host block always; a device
  // block where it is on this device or one this device has peer access to.
  virtual bool ipc_readable(const IpcHandle& h);
  // What an opener settles with the block's owner between mapping the flags and mapping the data
  // (IpcLink's claim): `take` says whether to go on; `give_back` undoes a take whose data could
  // then not be mapped. Either may be empty.
  struct IpcClaim {
    std::function<bool(uint32_t* flags)> take;
    std::function<void(uint32_t* flags)> give_back;
  };
  // Maps another process's block (its name goes at once: nothing is left behind after a crash);
  // raises where it is not readable here, or where `claim.take` refused it.
  virtual void* ipc_open(const IpcHandle& h, IpcBlock* b, const IpcClaim& claim);
  // Unmaps an opened block, frees a created one. Nothing may run on it any more, and a created
  // block's openers must have closed theirs (or be gone).
  virtual void ipc_close(void* token);
  // Unmaps an opened block's data only, its flags staying mapped: the owner frees the data once
  // a flag says so, which must come after the unmap (freeing before the opener's close is
  // undefined on CUDA). The fake keeps one mapping for both and only notes the data unmapped.
  virtual void ipc_close_data(void*) {}
  // On `s`, after the work before it (whose writes it makes visible first): *flag = value.
  virtual void flag_write(uint32_t* flag, uint32_t value, Stream s);
  // `s` waits until (int32_t)(*flag - value) >= 0 (cyclic, as CU_STREAM_WAIT_VALUE_GEQ).
  virtual void flag_wait(Stream s, const uint32_t* flag, uint32_t value);
  // copy() then flag_write(), and fold() of one job then flag_write(), as ONE entry on `s` where
  // the runtime can (a kernel that stores the flag once its data is visible): a stream holds
  // only so many entries before the host blocks, and an IPC link's small op is mostly these.
  // The default makes two entries.
  virtual void copy_flag(void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value, Stream s);
  virtual void fold_flag(const FoldJob& job, uint32_t* flag, uint32_t value, Stream s);
  // From the host, now: *flag = value (releases the waits it satisfies).
  virtual void flag_set(uint32_t* flag, uint32_t value);
  // Whether flag_wait and flag_write can be captured into a CUDA graph and run at its launches
  // (tried once; false: plans' graphs keep to communicators). Not under a capture.
  virtual bool ipc_graphs() { return false; }

  // ---- CUDA graphs (device/graph.h)
  // Begins capturing `s` in the thread-local mode: work enqueued on it, and on streams that
  // wait on events recorded in the capture, is recorded into a graph instead of run.
  virtual void begin_capture(Stream s);
  // Ends the capture begun on `s` and instantiates its graph (every stream that joined must be
  // joined back into `s`); the graph is this runtime's until graph_destroy.
  virtual void* end_capture(Stream s);
  // Enqueues one run of the graph on `s`, ordered after the work before it and before the work
  // after it; launches of one graph run in launch order. Communicators match anew at each run.
  // Not on a stream under capture (CUDA refuses a graph launch there and invalidates the capture).
  virtual void graph_launch(void* graph, Stream s);
  // Frees the graph (a launch still enqueued completes first).
  virtual void graph_destroy(void* graph);
  // Makes the graph being captured on `s` (a user's) hold `ref` until that graph and every
  // instance of it are destroyed (a CUDA user object). `ref` may then be dropped on a thread of
  // the runtime's own: its destructor must make no runtime call.
  virtual void capture_keep(Stream s, std::shared_ptr<void> ref);
  // Enqueues `fn(arg)` on `s` (cudaLaunchHostFunc): it runs on a host thread once the work
  // before it has, and the work after it waits for it; under capture it becomes a host node that
  // runs at every replay. `fn` must make no runtime call and return soon.
  virtual void host_call(Stream s, void (*fn)(void*), void* arg);

  // Runs `f` with the calling thread on this runtime's device and a stream of the runtime's own
  // that never takes work, current: a device Future completed in `f` records its events there
  // (its op has run by then) and runs its callbacks on the right device.
  virtual void on_idle_stream(const std::function<void()>& f) { f(); }

  // Test hooks (the fake's; see fake_hooks.cpp): raises for a hook this runtime lacks.
  virtual int64_t debug(const std::string& what, int64_t arg);
};

// The calling thread in the relaxed capture mode while it lives, then in its own again: for the
// setup a caller's thread may do while a user captures (CUDA refuses allocations and host
// registration then, and invalidates the user's capture with them).
// Never throws: it also guards frees in destructors, which may run once CUDA is shutting down
// (a mode that cannot be set then is left as it is; the calls it guards report themselves).
class RelaxedCapture {
 public:
  explicit RelaxedCapture(Runtime& rt) noexcept : rt_(rt), prev_(relax(rt)) {}
  ~RelaxedCapture() {
    if (prev_ < 0) return;
    try {
      rt_.exchange_capture_mode(prev_);
    } catch (...) {
    }
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  static int relax(Runtime& rt) noexcept {
    try {
      return rt.exchange_capture_mode(Runtime::kCaptureRelaxed);
    } catch (...) {
      return -1;
    }
  }
  Runtime& rt_;
  const int prev_;
};

// The fake (device/fake_runtime.cpp): "device" memory is host memory (CPU tensors), each
// stream is a thread, communicators talk over local sockets, so ranks must share a host.
// `blocking_pairs`: two-rank communicators launch on the calling thread (NCCL's blocking mode,
// as the CUDA runtime makes them); others start a thread per launch (its non-blocking mode).
std::unique_ptr<Runtime> make_fake_runtime(bool blocking_pairs = false);

// A test hook of the fake: a capture under way in the process on a stream of no engine's (a
// user's capture of a stream of their own; `global`: CUDA's global mode) begins, or ends; the
// end returns 1, or 0 where something invalidated the capture.
int64_t fake_process_capture(bool begin, bool global);

}  // namespace device
}  // namespace fastcomm
