#pragma once
// The CPU fake of the device runtime (device/runtime.h's make_fake_runtime), one class over a
// few files, each one job (fake_runtime.cpp has the whole list of what it keeps):
//   fake_runtime.cpp  streams, events, copies and folds, scratch memory, graphs, same-host blocks
//   fake_nccl.cpp     the NCCL calls: ids, communicators' init, state, abort and destroy, groups,
//                     sends, receives and collectives, and their launch (NCCL's non-blocking one)
//   fake_hooks.cpp    the test hooks (debug)
// over the fake's parts: fake_streams.h, fake_graph.h, fake_comm.h, fake_ipc.h. Internal to them.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device/fake_comm.h"
#include "device/fake_graph.h"
#include "device/fake_ipc.h"
#include "device/fake_streams.h"
#include "device/runtime.h"

namespace fastcomm {
namespace device {
namespace fake {

// Folds (fake_runtime.cpp): the checks the fold and NCCL's reductions share, and the fold itself
// (every rank that folds the same contributions gets bit-identical results).
void check_reduction(const char* call, c10::ScalarType dtype, RedOp op);
void fold_parts(void* dst, std::vector<const void*> parts, int64_t numel, c10::ScalarType dtype, RedOp op);

// How long a launch keeps its communicators busy (ncclInProgress) by default.
constexpr int64_t kEnqueueMicros = 20;

class FakeRuntime final : public Runtime {
  struct Group {
    int depth = 0;
    std::vector<std::pair<std::shared_ptr<StreamCore>, std::vector<Op>>> work;  // by stream, in first-use order
  };

 public:
  explicit FakeRuntime(bool blocking_pairs)
      : caller_(std::make_shared<StreamCore>(false)), blocking_pairs_(blocking_pairs) {}
  ~FakeRuntime() override;

  const char* name() const override { return "fake"; }
  int device() const override { return 0; }

  Stream new_stream() override;
  void destroy_stream(Stream s) override;
  Stream current_stream() override { return caller_.get(); }
  bool capturing(Stream s) override;
  void begin_capture(Stream s) override { start_capture(stream_of(s, "begin_capture"), false); }
  void* end_capture(Stream s) override;
  void graph_launch(void* graph, Stream s) override;
  void host_call(Stream s, void (*fn)(void*), void* arg) override;
  void on_idle_stream(const std::function<void()>& f) override {
    ++idle_calls_;  // debug "idle_stream_calls"
    f();
  }
  void graph_destroy(void* graph) override;
  void relax_capture_mode() override { tl_relaxed = true; }
  int exchange_capture_mode(int mode) override {
    const int prev = tl_relaxed ? kCaptureRelaxed : 0;
    tl_relaxed = mode == kCaptureRelaxed;
    return prev;
  }

  // Test hooks: "spin" queues `arg` ms of busy work on the caller's stream (a long kernel),
  // "hold" one that runs until "release"; "abort_hold" makes comm_abort block until "abort_release";
  // "begin_capture" captures the caller's stream (arg 0: the global mode, 1: thread-local) and
  // "end_capture" ends it (1: the graph is valid, 0: it was invalidated; with arg 1 the graph is
  // kept and its id returned, for "graph_launch" on the caller's stream and "graph_destroy", as
  // torch.cuda.graph's CUDAGraph would be); "late_writes" counts
  // writes into freed scratch; "enqueue_us" sets how long a launch keeps its communicators busy.
  int64_t debug(const std::string& what, int64_t arg) override;

  Event new_event() override;
  void destroy_event(Event e) override;
  void record(Event e, Stream s) override;
  void wait(Stream s, Event e) override;
  State query(Event e) override;
  void synchronize(Event e) override;
  void copy(void* dst, const void* src, size_t bytes, Stream s) override;
  void fold(const FoldJob* jobs, int count, Stream s) override;
  at::Tensor scratch(int64_t numel, const at::Tensor& like, Stream s) override;
  void keep(const at::Tensor& t, Stream s) override;

  // Same-host blocks (fake_ipc.h): /dev/shm segments; a flag wait holds its stream's thread.
  bool ipc_supported() override;
  bool ipc_graphs() override { return ipc_graphs_.load(); }
  void capture_keep(Stream s, std::shared_ptr<void> ref) override;
  void* ipc_create(size_t bytes, int nflags, IpcHandle* h, IpcBlock* b, bool host) override;
  bool ipc_readable(const IpcHandle& h) override { return fake::ipc_readable(h); }
  // CUDA's own register, allocate, open and free device memory and host pages: calls a capture
  // in the global mode refuses from threads not in the relaxed mode, and is invalidated by.
  void* ipc_open(const IpcHandle& h, IpcBlock* b, const IpcClaim& claim) override {
    fake::unsafe_call("ipc_open (cudaHostRegister, cudaIpcOpenMemHandle)");
    return fake::ipc_open(h, b, claim);
  }
  void ipc_close(void* token) override {
    fake::unsafe_call("ipc_close (cudaFree or cudaIpcCloseMemHandle, cudaHostUnregister)");
    fake::ipc_close(token);
  }
  void ipc_close_data(void* token) override {
    fake::unsafe_call("ipc_close_data (cudaIpcCloseMemHandle)");
    fake::ipc_close_data(token);
  }
  void flag_write(uint32_t* flag, uint32_t value, Stream s) override;
  void flag_wait(Stream s, const uint32_t* flag, uint32_t value) override;
  void copy_flag(void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value, Stream s) override;
  void fold_flag(const FoldJob& job, uint32_t* flag, uint32_t value, Stream s) override;
  void flag_set(uint32_t* flag, uint32_t value) override { flag_store(flag, value); }

  UniqueId new_id() override;
  Comm comm_init(const UniqueId& id, int nranks, int rank) override;
  State comm_state(Comm c, std::string* why) override { return comm_of(c, "comm_state")->state(why); }
  void comm_abort(Comm c) override;
  void comm_destroy(Comm c) override;
  void group_start() override;
  void group_end() override;
  void send(const void* buf, size_t bytes, int peer, Comm c, Stream s) override;
  void recv(void* buf, size_t bytes, int peer, Comm c, Stream s) override;
  void all_reduce(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp redop, Comm c,
                  Stream s) override;
  void broadcast(void* buf, size_t bytes, int root, Comm c, Stream s) override;
  void all_gather(const void* in, void* out, size_t bytes, Comm c, Stream s) override;
  void reduce_scatter(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp redop, Comm c,
                      Stream s) override;

 private:
  std::shared_ptr<StreamCore> stream_of(Stream s, const char* call);
  EventImpl* event_of(Event e, const char* call);
  std::shared_ptr<CommImpl> comm_of(Comm c, const char* call);

  // A communicator a new operation may be issued on.
  std::shared_ptr<CommImpl> usable(Comm c, const char* call);
  static void check_peer(const char* call, const CommImpl& c, int peer, const char* what);

  // One send to and one receive (kept for the fold) from every other rank, in rank order.
  template <typename Src>
  static void exchange_all(CommImpl& c, Op& op, Src src, size_t bytes);

  // Issue-order numbers of the op's sends and receives with each peer: at the call, or, for a
  // captured op, at each replay.
  static void number(Op& op);

  // A fresh copy of a captured op, for one replay.
  static Op replica(const Op& t);

  // Into the calling thread's open group, or as a task of its own.
  void submit(Op op, const std::shared_ptr<StreamCore>& st);
  void launch(StreamCore& st, std::vector<Op> ops);

  std::mutex mu_;
  const std::shared_ptr<StreamCore> caller_;
  std::atomic<int64_t> enqueue_us_{kEnqueueMicros};
  std::atomic<int64_t> launch_threads_{0};  // threads non-blocking launches started (debug "launch_threads")
  std::atomic<int64_t> captured_launches_{0};  // communicator launches kept by captures (debug "captured_launches")
  // Copies, folds and stream flag operations enqueued (debug "work_entries"): what fills a CUDA
  // stream's bounded command buffer, where event records and waits are not counted.
  std::atomic<int64_t> work_entries_{0};
  std::atomic<int64_t> idle_calls_{0};
  // debug "sticky_error": from now on every call on a stream or an event throws, as after a
  // sticky CUDA error (an illegal address): the context cannot be used any more.
  std::atomic<bool> sticky_{false};
  void sticky_check(const char* call) const;
  std::atomic<int64_t> failing_streams_{0};  // debug "fail_new_streams": new_stream() calls that throw
  const bool blocking_pairs_;
  bool launches_inline(const CommImpl& c) const { return blocking_pairs_ && c.nranks() == 2; }
  const std::shared_ptr<Residency> residency_ = std::make_shared<Residency>();
  std::vector<std::shared_ptr<Marker>> holds_;  // "hold" kernels not released yet
  std::shared_ptr<Marker> abort_hold_;          // set: comm_abort blocks on it
  std::unordered_map<void*, std::shared_ptr<StreamCore>> streams_;
  std::unordered_map<void*, std::unique_ptr<EventImpl>> events_;
  std::unordered_map<void*, std::shared_ptr<CommImpl>> comms_;
  std::unordered_map<std::thread::id, Group> groups_;  // open groups, per calling thread
  std::unordered_map<void*, std::shared_ptr<FakeGraph>> graphs_;
  std::atomic<bool> ipc_graphs_{true};  // debug("ipc_graphs", 0): as a runtime that cannot capture flag ops
  std::vector<std::shared_ptr<FakeGraph>> user_graphs_;  // kept by debug("end_capture", 1)
};

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
