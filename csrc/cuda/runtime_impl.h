#pragma once
// The CUDA runtime's class (cuda/runtime.h), over two files, each one job:
//   runtime.cpp  streams, events, memory, same-host blocks; the dtype and op maps
//   comms.cpp    communicators: init (a pair's in NCCL's blocking mode, on a thread of its own),
//                state, abort, destroy; groups and collectives; NCCL work still being enqueued
//                by NCCL's thread (non-blocking communicators) and the calls deferred behind it
// Internal to csrc/cuda.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda/reduce.h"
#include "cuda/runtime.h"

namespace fastcomm {
namespace device {
namespace cudart {

using Clock = std::chrono::steady_clock;
using RedOp = c10d::ReduceOp::RedOpType;

inline cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }
inline cudaEvent_t ce(Event e) { return static_cast<cudaEvent_t>(e); }

ncclDataType_t nccl_dtype(c10::ScalarType t);
ncclRedOp_t nccl_op(RedOp op, c10::ScalarType t);
cuda::DType fold_dtype(c10::ScalarType t);
cuda::RedOp fold_op(RedOp op, c10::ScalarType t);

// A communicator's kernels (a pair's, or a group's of 3+) take at most this many CTAs (SMs), so
// that the device engine's bound on kernels in flight (FASTCOMM_DEVICE_MAX_KERNELS, default 8)
// fits an H100's 132 SMs.
constexpr int kCommMaxCTAs = 16;

struct Pending;

struct CommBox : std::enable_shared_from_this<CommBox> {
  std::mutex mu;                     // orders polls (ncclCommGetAsyncError) with abort and destroy
  ncclComm_t comm = nullptr;         // under mu; null once aborted or destroyed (or still opening)
  bool aborted = false;              // under mu
  // Under mu: inside ncclCommAbort/Finalize/Destroy, which first join NCCL's enqueue thread: until
  // it returns, a launch NCCL was still enqueueing may not be on its stream yet (quiet()).
  bool ending = false;
  int nranks = 0;                    // fixed at init: a non-blocking communicator in progress takes no query
  std::shared_ptr<Pending> pending;  // under the runtime's mu_
  // A blocking-mode pair communicator (launches enqueue on the calling thread, no NCCL thread):
  // made, and connected to its peer, by `opener`. Until it is done the box has no comm.
  bool blocking = false;
  std::thread opener;
  bool opened = false;      // under mu: the opener is done (comm set, or open_error)
  std::string open_error;   // under mu
  bool abandoned = false;   // under mu: aborted or destroyed while opening: the opener aborts it
  cudaStream_t warm_stream = nullptr;  // the opener's first contact runs there
};

// NCCL work that NCCL's own thread is still enqueueing (a group, or a single call, that returned
// ncclInProgress), and the record()s and keep()s on its streams deferred until it is enqueued.
struct Pending {
  std::vector<std::shared_ptr<CommBox>> comms;
  std::vector<cudaStream_t> streams;
  struct Divide {  // the end of an AVG that NCCL summed (CudaRuntime::divide_sum)
    void* out = nullptr;
    int64_t count = 0;
    cuda::DType dtype = cuda::DType::F32;
    int32_t n = 1;
  };
  struct Op {
    cudaStream_t stream;
    cudaEvent_t event;  // a record; null: a divide if divide.count > 0, else a keep of `keep`
    at::Tensor keep;
    Divide divide;
  };
  std::vector<Op> ops;  // in call order
  bool settled = false;
};

// This thread's open NCCL group (NCCL keeps its group state per thread too).
struct GroupState {
  int depth = 0;
  bool failed = false;  // a call inside failed and the NCCL group was closed under the caller
  std::vector<std::shared_ptr<CommBox>> comms;
  std::vector<cudaStream_t> streams;
};
extern thread_local GroupState tl_group;

template <typename T>
void add_unique(std::vector<T>& v, const T& x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}

class CudaRuntime final : public Runtime {
 public:
  CudaRuntime(int device, std::chrono::milliseconds limit, bool blocking_pairs);
  ~CudaRuntime() override;

  const char* name() const override { return "nccl"; }
  int device() const override { return device_; }

  // ---- streams, events, memory (runtime.cpp)
  Stream new_stream() override;
  void destroy_stream(Stream s) override;
  Stream current_stream() override;
  bool capturing(Stream s) override;
  void relax_capture_mode() override;
  int exchange_capture_mode(int mode) override;
  void begin_capture(Stream s) override;
  void* end_capture(Stream s) override;
  void graph_launch(void* graph, Stream s) override;
  void graph_destroy(void* graph) override;
  void host_call(Stream s, void (*fn)(void*), void* arg) override;
  void on_idle_stream(const std::function<void()>& f) override;
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
  bool ipc_supported() override;
  bool ipc_graphs() override;
  void capture_keep(Stream s, std::shared_ptr<void> ref) override;
  void* ipc_create(size_t bytes, int nflags, IpcHandle* h, IpcBlock* b, bool host) override;
  bool ipc_readable(const IpcHandle& h) override;
  void* ipc_open(const IpcHandle& h, IpcBlock* b, const IpcClaim& claim) override;
  void ipc_close(void* token) override;
  void ipc_close_data(void* token) override;
  void flag_write(uint32_t* flag, uint32_t value, Stream s) override;
  void flag_wait(Stream s, const uint32_t* flag, uint32_t value) override;
  void copy_flag(void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value, Stream s) override;
  void fold_flag(const FoldJob& job, uint32_t* flag, uint32_t value, Stream s) override;
  void flag_set(uint32_t* flag, uint32_t value) override;

  // ---- communicators (comms.cpp)
  UniqueId new_id() override;
  Comm comm_init(const UniqueId& id, int nranks, int rank) override;
  State comm_state(Comm c, std::string* why) override;
  void comm_abort(Comm c) override;
  void comm_destroy(Comm c) override;
  void group_start() override;
  void group_end() override;
  void send(const void* buf, size_t bytes, int peer, Comm c, Stream s) override;
  void recv(void* buf, size_t bytes, int peer, Comm c, Stream s) override;
  void all_reduce(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op, Comm c,
                  Stream s) override;
  void broadcast(void* buf, size_t bytes, int root, Comm c, Stream s) override;
  void all_gather(const void* in, void* out, size_t bytes, Comm c, Stream s) override;
  void reduce_scatter(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op, Comm c,
                      Stream s) override;

 private:
  c10::DeviceIndex dev() const { return (c10::DeviceIndex)device_; }
  void record_stream(const at::Tensor& t, cudaStream_t s);

  // comms.cpp
  Comm open_pair(const ncclUniqueId& uid, int rank);
  // Ends an opener: joined if it is done, else left to end the communicator itself when NCCL
  // returns (its init may wait for a peer that never comes; nothing here waits for it).
  void release_opener(CommBox& box);
  void divide_sum(const std::shared_ptr<CommBox>& box, void* out, int64_t count, c10::ScalarType dtype,
                  cudaStream_t s);
  std::shared_ptr<CommBox> box_of(Comm c);
  std::shared_ptr<CommBox> enter(Comm c, cudaStream_t s, const char* what);
  template <typename F>
  void issued(const std::shared_ptr<CommBox>& box, cudaStream_t s, F&& call);
  void abandon_group();
  void add_pending(std::vector<std::shared_ptr<CommBox>> comms, std::vector<cudaStream_t> streams);
  bool quiet(CommBox& b);
  bool try_settle(const std::shared_ptr<Pending>& p);
  void finish_locked(Pending& p);
  bool wait_settled(const std::shared_ptr<Pending>& p, Clock::time_point deadline);
  void settle_blocking(const std::shared_ptr<Pending>& p, const char* what);
  void settle_stream(cudaStream_t s, const char* what);
  void settle_event(cudaEvent_t e, const char* what);
  void drop_deferred_record_locked(cudaEvent_t e);
  bool finalize(ncclComm_t comm, Clock::time_point deadline);

  const int device_;
  const std::chrono::milliseconds limit_;
  const bool blocking_pairs_;

  std::mutex mu_;  // guards everything below, and every CommBox::pending
  std::unordered_map<CommBox*, std::shared_ptr<CommBox>> comms_;
  std::unordered_map<cudaStream_t, std::shared_ptr<Pending>> stream_pending_;
  std::unordered_map<cudaEvent_t, std::shared_ptr<Pending>> event_pending_;
  std::vector<cudaStream_t> free_streams_;
  std::once_flag idle_once_;
  cudaStream_t idle_ = nullptr;  // on_idle_stream's: never takes work
  at::Tensor warm_;  // two bytes the pair openers' first contacts send from and receive into
};

}  // namespace cudart
}  // namespace device
}  // namespace fastcomm
