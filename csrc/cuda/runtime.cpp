#include "cuda/runtime.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda/ipc.h"
#include "cuda/reduce.h"
#include "engine/device.h"

namespace fastcomm {
namespace cuda {

void fail(ncclResult_t r, ncclComm_t comm, const char* expr, const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  throw_comm_error(std::string("fastcomm: NCCL error in ") + expr + " (" + file + ":" + std::to_string(line) +
                   "): " + ncclGetErrorString(r) + (last && *last ? std::string("; ") + last : std::string()));
}

void fail(cudaError_t r, ncclComm_t, const char* expr, const char* file, int line) {
  (void)cudaGetLastError();  // clear a non-sticky error so that the next call is not blamed for it
  throw_comm_error(std::string("fastcomm: CUDA error in ") + expr + " (" + file + ":" + std::to_string(line) +
                   "): " + cudaGetErrorName(r) + ": " + cudaGetErrorString(r));
}

}  // namespace cuda

namespace device {
namespace {

using Clock = std::chrono::steady_clock;
using RedOp = c10d::ReduceOp::RedOpType;

cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t ce(Event e) { return static_cast<cudaEvent_t>(e); }

const char* op_name(RedOp op) {
  switch (op) {
    case RedOp::SUM: return "SUM";
    case RedOp::AVG: return "AVG";
    case RedOp::PRODUCT: return "PRODUCT";
    case RedOp::MIN: return "MIN";
    case RedOp::MAX: return "MAX";
    default: return "a bitwise or premultiplied op";
  }
}

ncclDataType_t nccl_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kHalf: return ncclFloat16;
    case c10::kBFloat16: return ncclBfloat16;
    case c10::kFloat: return ncclFloat32;
    case c10::kDouble: return ncclFloat64;
    case c10::kChar: return ncclInt8;
    case c10::kByte: return ncclUint8;
    case c10::kInt: return ncclInt32;
    case c10::kLong: return ncclInt64;
    default: TORCH_CHECK_TYPE(false, "fastcomm: NCCL reductions do not support dtype ", t);
  }
}

ncclRedOp_t nccl_op(RedOp op, c10::ScalarType t) {
  switch (op) {
    case RedOp::SUM: return ncclSum;
    case RedOp::PRODUCT: return ncclProd;
    case RedOp::AVG:  // summed, then divided (divide_sum)
      TORCH_CHECK_VALUE(c10::isFloatingType(t), "fastcomm: AVG is not supported for integer dtype ", t);
      return ncclSum;
    default:
      TORCH_CHECK_VALUE(false, "fastcomm: NCCL reductions take SUM, AVG or PRODUCT, not ", op_name(op),
                        " (MIN and MAX run as a fold)");
  }
}

cuda::DType fold_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kHalf: return cuda::DType::F16;
    case c10::kBFloat16: return cuda::DType::BF16;
    case c10::kFloat: return cuda::DType::F32;
    case c10::kDouble: return cuda::DType::F64;
    case c10::kChar: return cuda::DType::I8;
    case c10::kByte: return cuda::DType::U8;
    case c10::kShort: return cuda::DType::I16;
    case c10::kInt: return cuda::DType::I32;
    case c10::kLong: return cuda::DType::I64;
    default: TORCH_CHECK_TYPE(false, "fastcomm: the CUDA fold does not support dtype ", t);
  }
}

cuda::RedOp fold_op(RedOp op, c10::ScalarType t) {
  switch (op) {
    case RedOp::SUM: return cuda::RedOp::Sum;
    case RedOp::PRODUCT: return cuda::RedOp::Product;
    case RedOp::MIN: return cuda::RedOp::Min;
    case RedOp::MAX: return cuda::RedOp::Max;
    case RedOp::AVG:
      TORCH_CHECK_VALUE(c10::isFloatingType(t), "fastcomm: AVG is not supported for integer dtype ", t);
      return cuda::RedOp::Avg;
    default: TORCH_CHECK_VALUE(false, "fastcomm: the CUDA fold does not support ", op_name(op));
  }
}

struct Pending;

struct CommBox : std::enable_shared_from_this<CommBox> {
  std::mutex mu;                     // orders polls (ncclCommGetAsyncError) with abort and destroy
  ncclComm_t comm = nullptr;         // under mu; null once aborted or destroyed
  bool aborted = false;              // under mu
  int nranks = 0;                    // fixed at init: a non-blocking communicator in progress takes no query
  std::shared_ptr<Pending> pending;  // under the runtime's mu_
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
thread_local GroupState tl_group;

template <typename T>
void add_unique(std::vector<T>& v, const T& x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}

class CudaRuntime final : public Runtime {
 public:
  CudaRuntime(int device, std::chrono::milliseconds limit) : device_(device), limit_(limit) {
    TORCH_CHECK_VALUE(device >= 0 && device < c10::cuda::device_count(), "fastcomm: no CUDA device ", device,
                      " (this process sees ", (int)c10::cuda::device_count(), ")");
  }

  ~CudaRuntime() override {
    // Communicators the engine left behind: abort, which never waits for a peer. Streams are
    // kept (see new_stream); nothing is left to report an error to.
    for (auto& [raw, box] : comms_) {
      if (box->comm != nullptr) {
        try {
          c10::cuda::CUDAGuard g(dev());
          FASTCOMM_GPU_CHECK(ncclCommAbort(box->comm));
        } catch (const std::exception&) {
        }
      }
    }
  }

  const char* name() const override { return "nccl"; }
  int device() const override { return device_; }

  // ---- streams, events, memory

  // Streams are never destroyed, only recycled: the caching allocator records an event on
  // every stream a tensor was kept on (keep) when that tensor is freed, however much later, and
  // one on a destroyed stream fails in the allocator's free path. A stream of our own per
  // caller (not torch's shared pool), so one peer's stuck work never holds up another's.
  Stream new_stream() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!free_streams_.empty()) {
        cudaStream_t s = free_streams_.back();
        free_streams_.pop_back();
        return s;
      }
    }
    c10::cuda::CUDAGuard g(dev());
    int least = 0, greatest = 0;
    FASTCOMM_GPU_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t s = nullptr;
    FASTCOMM_GPU_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    return s;
  }

  void destroy_stream(Stream s) override {
    settle_stream(cs(s), "destroy_stream");
    std::lock_guard<std::mutex> lk(mu_);
    free_streams_.push_back(cs(s));
  }

  Stream current_stream() override { return c10::cuda::getCurrentCUDAStream(dev()).stream(); }

  bool capturing(Stream s) override {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    FASTCOMM_GPU_CHECK(cudaStreamIsCapturing(cs(s), &st));
    return st != cudaStreamCaptureStatusNone;
  }

  void relax_capture_mode() override {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    FASTCOMM_GPU_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  }

  // ---- CUDA graphs: captured in the thread-local mode, so the engine thread's event queries
  // (relaxed) and other threads' work never touch the capture.
  void begin_capture(Stream s) override {
    settle_stream(cs(s), "begin_capture");
    c10::cuda::CUDAGuard g(dev());
    FASTCOMM_GPU_CHECK(cudaStreamBeginCapture(cs(s), cudaStreamCaptureModeThreadLocal));
  }

  void* end_capture(Stream s) override {
    settle_stream(cs(s), "end_capture");
    c10::cuda::CUDAGuard g(dev());
    cudaGraph_t graph = nullptr;
    FASTCOMM_GPU_CHECK(cudaStreamEndCapture(cs(s), &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t r = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);  // the instance keeps what it needs
    cuda::check(r, nullptr, "cudaGraphInstantiate(&exec, graph, 0)", __FILE__, __LINE__);
    return exec;
  }

  void graph_launch(void* graph, Stream s) override {
    settle_stream(cs(s), "graph_launch");
    c10::cuda::CUDAGuard g(dev());
    FASTCOMM_GPU_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), cs(s)));
  }

  void graph_destroy(void* graph) override {
    c10::cuda::CUDAGuard g(dev());
    FASTCOMM_GPU_CHECK(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)));
  }

  Event new_event() override {
    c10::cuda::CUDAGuard g(dev());
    cudaEvent_t e = nullptr;
    FASTCOMM_GPU_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  void destroy_event(Event e) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      drop_deferred_record_locked(ce(e));
    }
    c10::cuda::CUDAGuard g(dev());
    FASTCOMM_GPU_CHECK(cudaEventDestroy(ce(e)));
  }

  void record(Event e, Stream s) override {
    std::lock_guard<std::mutex> lk(mu_);
    drop_deferred_record_locked(ce(e));  // the latest record wins
    auto it = stream_pending_.find(cs(s));
    if (it != stream_pending_.end()) {
      it->second->ops.push_back({cs(s), ce(e), at::Tensor()});
      event_pending_[ce(e)] = it->second;
      return;
    }
    c10::cuda::CUDAGuard g(dev());
    FASTCOMM_GPU_CHECK(cudaEventRecord(ce(e), cs(s)));
  }

  void wait(Stream s, Event e) override {
    settle_event(ce(e), "wait");
    settle_stream(cs(s), "wait");
    c10::cuda::CUDAGuard g(dev());
    FASTCOMM_GPU_CHECK(cudaStreamWaitEvent(cs(s), ce(e), 0));
  }

  State query(Event e) override {
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = event_pending_.find(ce(e));
      if (it != event_pending_.end()) p = it->second;
    }
    if (p && !try_settle(p)) return State::kPending;
    const cudaError_t r = cudaEventQuery(ce(e));
    if (r == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return State::kPending;
    }
    cuda::check(r, nullptr, "cudaEventQuery(e)", __FILE__, __LINE__);
    return State::kReady;
  }

  void synchronize(Event e) override {
    settle_event(ce(e), "synchronize");
    FASTCOMM_GPU_CHECK(cudaEventSynchronize(ce(e)));
  }

  void copy(void* dst, const void* src, size_t bytes, Stream s) override {
    settle_stream(cs(s), "copy");
    if (bytes == 0) return;
    c10::cuda::CUDAGuard g(dev());
    FASTCOMM_GPU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cs(s)));
  }

  void fold(const FoldJob* jobs, int count, Stream s) override {
    if (count <= 0) return;
    std::vector<cuda::ReduceJob> rj((size_t)count);
    for (int i = 0; i < count; ++i) {
      const FoldJob& j = jobs[i];
      TORCH_INTERNAL_ASSERT(j.n >= 1 && j.me >= 0 && j.me < j.n && j.numel >= 0, "fastcomm: bad fold job");
      rj[(size_t)i] = cuda::ReduceJob{j.dst, j.own, j.scratch, j.numel, j.n, j.me, fold_dtype(j.dtype),
                                      fold_op(j.op, j.dtype)};
    }
    settle_stream(cs(s), "fold");
    c10::cuda::CUDAGuard g(dev());
    FASTCOMM_GPU_CHECK(cuda::launch_fused_reduce(rj.data(), count, cs(s)));
  }

  at::Tensor scratch(int64_t numel, const at::Tensor& like, Stream s) override {
    // The allocation belongs to stream s: the allocator hands its memory out again, to s, only
    // for work enqueued after what uses it.
    c10::cuda::CUDAStreamGuard g(c10::cuda::getStreamFromExternal(cs(s), dev()));
    return at::empty({numel}, like.options().device(c10::Device(c10::kCUDA, dev())));
  }

  void keep(const at::Tensor& t, Stream s) override {
    if (!t.defined() || !t.is_cuda() || !t.has_storage() || t.storage().data_ptr().get() == nullptr) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = stream_pending_.find(cs(s));
      if (it != stream_pending_.end()) {
        // The work that uses t is not on the stream yet: an event recorded now would not cover
        // it. Hold t until it is, then record the stream.
        it->second->ops.push_back({cs(s), nullptr, t});
        return;
      }
    }
    record_stream(t, cs(s));
  }

  // ---- same-host blocks (cuda/ipc.h)

  bool ipc_supported() override { return cuda::ipc_supported(device_); }
  void* ipc_create(size_t bytes, int nflags, IpcHandle* h, IpcBlock* b) override {
    return cuda::ipc_create(device_, bytes, nflags, h, b);
  }
  void* ipc_open(const IpcHandle& h, IpcBlock* b) override { return cuda::ipc_open(device_, h, b); }
  void ipc_close(void* token) override { cuda::ipc_close(device_, token); }
  void flag_write(uint32_t* flag, uint32_t value, Stream s) override {
    settle_stream(cs(s), "flag_write");
    c10::cuda::CUDAGuard g(dev());
    cuda::flag_write(flag, value, cs(s));
  }
  void flag_wait(Stream s, const uint32_t* flag, uint32_t value) override {
    settle_stream(cs(s), "flag_wait");
    c10::cuda::CUDAGuard g(dev());
    cuda::flag_wait(cs(s), flag, value);
  }
  void flag_set(uint32_t* flag, uint32_t value) override { __atomic_store_n(flag, value, __ATOMIC_RELEASE); }

  // ---- communicators

  UniqueId new_id() override {
    static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId::bytes), "ncclUniqueId is 128 bytes");
    ncclUniqueId uid;
    FASTCOMM_GPU_CHECK(ncclGetUniqueId(&uid));
    UniqueId id;
    std::memcpy(id.bytes.data(), &uid, sizeof(uid));
    return id;
  }

  Comm comm_init(const UniqueId& id, int nranks, int rank) override {
    ncclUniqueId uid;
    std::memcpy(&uid, id.bytes.data(), sizeof(uid));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init and every later call return at once; see the header
    ncclComm_t comm = nullptr;
    ncclResult_t r;
    {
      c10::cuda::CUDAGuard g(dev());
      try {
        r = FASTCOMM_GPU_CHECK(ncclCommInitRankConfig(&comm, nranks, uid, rank, &config));
      } catch (...) {
        // A non-blocking init that failed at once may still have made the communicator.
        if (comm != nullptr) {
          try {
            FASTCOMM_GPU_CHECK(ncclCommAbort(comm));
          } catch (const std::exception&) {
          }
        }
        throw;
      }
    }
    auto box = std::make_shared<CommBox>();
    box->comm = comm;
    box->nranks = nranks;
    std::lock_guard<std::mutex> lk(mu_);
    comms_[box.get()] = box;
    if (r == ncclInProgress) {
      // Until NCCL's init thread is done the communicator takes no call: work issued on it
      // before comm_state says kReady waits for it (at most the block limit).
      auto p = std::make_shared<Pending>();
      p->comms.push_back(box);
      box->pending = p;
    }
    return box.get();
  }

  State comm_state(Comm c, std::string* why) override {
    auto box = box_of(c);
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lk(mu_);
      p = box->pending;
    }
    const bool settled = !p || try_settle(p);
    std::lock_guard<std::mutex> lk(box->mu);
    if (box->comm == nullptr) {
      if (why) *why = "the NCCL communicator was aborted";
      return State::kFailed;
    }
    ncclResult_t st = ncclSuccess;
    FASTCOMM_GPU_CHECK_COMM(ncclCommGetAsyncError(box->comm, &st), box->comm);
    if (st == ncclSuccess) return settled ? State::kReady : State::kPending;
    if (st == ncclInProgress) return State::kPending;
    if (why) {
      const char* last = ncclGetLastError(box->comm);
      *why = std::string("NCCL: ") + ncclGetErrorString(st) + (last && *last ? std::string("; ") + last : "");
    }
    return State::kFailed;
  }

  void comm_abort(Comm c) override {
    auto box = box_of(c);
    ncclComm_t comm;
    {
      std::lock_guard<std::mutex> lk(box->mu);
      if (box->comm == nullptr) return;
      comm = box->comm;
      box->comm = nullptr;  // pollers now take it as done, and never touch the freed comm
      box->aborted = true;
    }
    {
      // Sets NCCL's abort flags (its kernels on our streams exit, so the streams drain), joins
      // its enqueue thread and frees the communicator.
      c10::cuda::CUDAGuard g(dev());
      FASTCOMM_GPU_CHECK(ncclCommAbort(comm));
    }
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lk(mu_);
      p = box->pending;
    }
    if (p) try_settle(p);  // replays its deferred records now if nothing else is in flight
  }

  void comm_destroy(Comm c) override {
    auto box = box_of(c);
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lk(mu_);
      p = box->pending;
    }
    // Never blocks for good: a communicator whose last enqueue or finalize does not finish
    // within the limit is aborted instead.
    const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(limit_, std::chrono::seconds(10));
    bool clean = !p || wait_settled(p, deadline);
    ncclComm_t comm;
    {
      std::lock_guard<std::mutex> lk(box->mu);
      comm = box->comm;
      box->comm = nullptr;
      box->aborted = true;
    }
    if (comm != nullptr) {
      c10::cuda::CUDAGuard g(dev());
      if (clean) clean = finalize(comm, deadline);
      if (clean) {
        FASTCOMM_GPU_CHECK_COMM(ncclCommDestroy(comm), comm);  // local: finalize did the rest
      } else {
        FASTCOMM_GPU_CHECK(ncclCommAbort(comm));
      }
    }
    if (p) try_settle(p);
    std::lock_guard<std::mutex> lk(mu_);
    comms_.erase(box.get());
  }

  void group_start() override {
    if (tl_group.failed) tl_group = GroupState{};  // the caller dropped a group that failed
    FASTCOMM_GPU_CHECK(ncclGroupStart());
    if (tl_group.depth++ == 0) {
      tl_group.comms.clear();
      tl_group.streams.clear();
    }
  }

  void group_end() override {
    if (tl_group.failed) {
      if (--tl_group.depth <= 0) tl_group = GroupState{};
      return;
    }
    TORCH_INTERNAL_ASSERT(tl_group.depth > 0, "fastcomm: group_end() without group_start()");
    c10::cuda::CUDAGuard g(dev());
    if (--tl_group.depth > 0) {
      FASTCOMM_GPU_CHECK(ncclGroupEnd());
      return;
    }
    auto comms = std::move(tl_group.comms);
    auto streams = std::move(tl_group.streams);
    tl_group = GroupState{};
    const ncclResult_t r = FASTCOMM_GPU_CHECK(ncclGroupEnd());
    if (r == ncclInProgress && !comms.empty()) add_pending(std::move(comms), std::move(streams));
  }

  void send(const void* buf, size_t bytes, int peer, Comm c, Stream s) override {
    auto box = enter(c, cs(s), "send");
    issued(box, cs(s), [&] {
      return FASTCOMM_GPU_CHECK_COMM(ncclSend(buf, bytes, ncclUint8, peer, box->comm, cs(s)), box->comm);
    });
  }

  void recv(void* buf, size_t bytes, int peer, Comm c, Stream s) override {
    auto box = enter(c, cs(s), "recv");
    issued(box, cs(s), [&] {
      return FASTCOMM_GPU_CHECK_COMM(ncclRecv(buf, bytes, ncclUint8, peer, box->comm, cs(s)), box->comm);
    });
  }

  void all_reduce(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op, Comm c,
                  Stream s) override {
    const ncclDataType_t dt = nccl_dtype(dtype);
    const ncclRedOp_t ro = nccl_op(op, dtype);
    auto box = enter(c, cs(s), "all_reduce");
    issued(box, cs(s), [&] {
      return FASTCOMM_GPU_CHECK_COMM(ncclAllReduce(in, out, (size_t)count, dt, ro, box->comm, cs(s)), box->comm);
    });
    if (op == RedOp::AVG) divide_sum(box, out, count, dtype, cs(s));
  }

  void broadcast(void* buf, size_t bytes, int root, Comm c, Stream s) override {
    auto box = enter(c, cs(s), "broadcast");
    issued(box, cs(s), [&] {
      return FASTCOMM_GPU_CHECK_COMM(ncclBroadcast(buf, buf, bytes, ncclUint8, root, box->comm, cs(s)), box->comm);
    });
  }

  void all_gather(const void* in, void* out, size_t bytes, Comm c, Stream s) override {
    auto box = enter(c, cs(s), "all_gather");
    issued(box, cs(s), [&] {
      return FASTCOMM_GPU_CHECK_COMM(ncclAllGather(in, out, bytes, ncclUint8, box->comm, cs(s)), box->comm);
    });
  }

  void reduce_scatter(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op, Comm c,
                      Stream s) override {
    const ncclDataType_t dt = nccl_dtype(dtype);
    const ncclRedOp_t ro = nccl_op(op, dtype);
    auto box = enter(c, cs(s), "reduce_scatter");
    issued(box, cs(s), [&] {
      return FASTCOMM_GPU_CHECK_COMM(ncclReduceScatter(in, out, (size_t)count, dt, ro, box->comm, cs(s)),
                                     box->comm);
    });
    if (op == RedOp::AVG) divide_sum(box, out, count, dtype, cs(s));
  }

 private:
  c10::DeviceIndex dev() const { return (c10::DeviceIndex)device_; }

  // AVG is a sum divided once at the end, as the fold does: ncclAvg multiplies every input by
  // 1/n before summing, which rounds differently (an exact 0 can come out nonzero). The kernel
  // must follow NCCL's on the stream: while NCCL is still enqueueing its call (a first contact
  // waits for the peers), the launch is deferred like a record, never waited for here.
  void divide_sum(const std::shared_ptr<CommBox>& box, void* out, int64_t count, c10::ScalarType dtype,
                  cudaStream_t s) {
    TORCH_INTERNAL_ASSERT(tl_group.depth == 0, "fastcomm: an AVG collective inside an NCCL group");
    if (count <= 0) return;
    const Pending::Divide d{out, count, fold_dtype(dtype), box->nranks};
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = stream_pending_.find(s);
      if (it != stream_pending_.end()) {
        it->second->ops.push_back({s, nullptr, at::Tensor(), d});
        return;
      }
    }
    c10::cuda::CUDAGuard g(dev());
    FASTCOMM_GPU_CHECK(cuda::launch_divide(d.out, d.count, d.dtype, d.n, s));
  }

  std::shared_ptr<CommBox> box_of(Comm c) {
    TORCH_INTERNAL_ASSERT(c != nullptr, "fastcomm: null communicator");
    return static_cast<CommBox*>(c)->shared_from_this();
  }

  void record_stream(const at::Tensor& t, cudaStream_t s) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), c10::cuda::getStreamFromExternal(s, dev()));
  }

  // A communicator about to take a call: whatever NCCL is still enqueueing on it or on `s`
  // must be done first (NCCL refuses a call on a communicator in progress, and the stream
  // order of `s` needs that work ahead of the new one).
  std::shared_ptr<CommBox> enter(Comm c, cudaStream_t s, const char* what) {
    auto box = box_of(c);
    try {
      std::shared_ptr<Pending> p;
      {
        std::lock_guard<std::mutex> lk(mu_);
        p = box->pending;
      }
      if (p) settle_blocking(p, what);
      settle_stream(s, what);
      std::lock_guard<std::mutex> lk(box->mu);
      if (box->comm == nullptr)
        throw_comm_error(std::string("fastcomm: ") + what + " on an NCCL communicator that was aborted");
    } catch (...) {
      abandon_group();
      throw;
    }
    if (tl_group.depth > 0) {
      add_unique(tl_group.comms, box);
      add_unique(tl_group.streams, s);
    }
    return box;
  }

  // Runs one NCCL enqueue call. Outside a group, a call that NCCL enqueues from its thread is
  // pending like a group; inside one, a failure closes the NCCL group (so this thread's next
  // NCCL call is not swallowed into it) before it propagates.
  template <typename F>
  void issued(const std::shared_ptr<CommBox>& box, cudaStream_t s, F&& call) {
    c10::cuda::CUDAGuard g(dev());
    ncclResult_t r;
    try {
      r = call();
    } catch (...) {
      abandon_group();
      throw;
    }
    if (tl_group.depth == 0 && r == ncclInProgress) add_pending({box}, {s});
  }

  void abandon_group() {
    if (tl_group.depth == 0 || tl_group.failed) return;
    for (int i = 0; i < tl_group.depth; ++i) {
      try {
        FASTCOMM_GPU_CHECK(ncclGroupEnd());  // fails: NCCL recorded the call's error
      } catch (const std::exception&) {
      }
    }
    const int depth = tl_group.depth;
    tl_group = GroupState{};
    tl_group.depth = depth;  // the caller's group_end()s still come
    tl_group.failed = true;
  }

  void add_pending(std::vector<std::shared_ptr<CommBox>> comms, std::vector<cudaStream_t> streams) {
    auto p = std::make_shared<Pending>();
    p->comms = std::move(comms);
    p->streams = std::move(streams);
    std::lock_guard<std::mutex> lk(mu_);
    for (cudaStream_t s : p->streams) stream_pending_[s] = p;
    for (auto& b : p->comms) b->pending = p;
  }

  // Whether NCCL has no job in flight on the communicator (done, failed or aborted).
  bool quiet(CommBox& b) {
    std::lock_guard<std::mutex> lk(b.mu);
    if (b.comm == nullptr) return true;
    ncclResult_t st = ncclSuccess;
    FASTCOMM_GPU_CHECK_COMM(ncclCommGetAsyncError(b.comm, &st), b.comm);  // also joins NCCL's finished job
    return st != ncclInProgress;
  }

  // Non-blocking: whether the pending work is on its streams now (then its deferred calls ran).
  bool try_settle(const std::shared_ptr<Pending>& p) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (p->settled) return true;
    }
    for (auto& b : p->comms) {
      if (!quiet(*b)) return false;
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (!p->settled) finish_locked(*p);
    return true;
  }

  void finish_locked(Pending& p) {
    p.settled = true;
    for (cudaStream_t s : p.streams) {
      auto it = stream_pending_.find(s);
      if (it != stream_pending_.end() && it->second.get() == &p) stream_pending_.erase(it);
    }
    for (auto& b : p.comms) {
      if (b->pending.get() == &p) b->pending.reset();
    }
    auto ops = std::move(p.ops);
    c10::cuda::CUDAGuard g(dev());
    for (auto& op : ops) {
      if (op.event != nullptr) {
        auto it = event_pending_.find(op.event);
        if (it == event_pending_.end() || it->second.get() != &p) continue;  // recorded again, or destroyed
        event_pending_.erase(it);
        FASTCOMM_GPU_CHECK(cudaEventRecord(op.event, op.stream));
      } else if (op.divide.count > 0) {
        const Pending::Divide& d = op.divide;
        FASTCOMM_GPU_CHECK(cuda::launch_divide(d.out, d.count, d.dtype, d.n, op.stream));
      } else {
        record_stream(op.keep, op.stream);
      }
    }
  }

  bool wait_settled(const std::shared_ptr<Pending>& p, Clock::time_point deadline) {
    for (int i = 0;; ++i) {
      if (try_settle(p)) return true;
      if (Clock::now() > deadline) return false;
      // NCCL's enqueue takes tens of microseconds; a first contact waits for the peer.
      if (i < 50) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(i < 2000 ? 20 : 500));
      }
    }
  }

  void settle_blocking(const std::shared_ptr<Pending>& p, const char* what) {
    if (wait_settled(p, Clock::now() + limit_)) return;
    throw_comm_error(std::string("fastcomm: ") + what + ": NCCL did not finish enqueueing earlier work within " +
                     std::to_string(limit_.count()) +
                     " ms (its first contact with a peer waits for the peer to issue the matching work)");
  }

  void settle_stream(cudaStream_t s, const char* what) {
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = stream_pending_.find(s);
      if (it == stream_pending_.end()) return;
      p = it->second;
    }
    settle_blocking(p, what);
  }

  void settle_event(cudaEvent_t e, const char* what) {
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = event_pending_.find(e);
      if (it == event_pending_.end()) return;
      p = it->second;
    }
    settle_blocking(p, what);
  }

  void drop_deferred_record_locked(cudaEvent_t e) {
    auto it = event_pending_.find(e);
    if (it == event_pending_.end()) return;
    auto& ops = it->second->ops;
    ops.erase(std::remove_if(ops.begin(), ops.end(), [e](const Pending::Op& op) { return op.event == e; }),
              ops.end());
    event_pending_.erase(it);
  }

  // ncclCommFinalize (non-blocking: flushes, then NCCL's thread frees what is shared) polled
  // until done; false if it failed or the deadline passed.
  bool finalize(ncclComm_t comm, Clock::time_point deadline) {
    try {
      FASTCOMM_GPU_CHECK_COMM(ncclCommFinalize(comm), comm);
      for (int i = 0;; ++i) {
        ncclResult_t st = ncclSuccess;
        FASTCOMM_GPU_CHECK_COMM(ncclCommGetAsyncError(comm, &st), comm);
        if (st == ncclSuccess) return true;
        if (st != ncclInProgress || Clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(i < 100 ? 20 : 1000));
      }
    } catch (const std::exception&) {
      return false;
    }
  }

  const int device_;
  const std::chrono::milliseconds limit_;

  std::mutex mu_;  // guards everything below, and every CommBox::pending
  std::unordered_map<CommBox*, std::shared_ptr<CommBox>> comms_;
  std::unordered_map<cudaStream_t, std::shared_ptr<Pending>> stream_pending_;
  std::unordered_map<cudaEvent_t, std::shared_ptr<Pending>> event_pending_;
  std::vector<cudaStream_t> free_streams_;
};

}  // namespace

std::unique_ptr<Runtime> make_cuda_runtime(int device, std::chrono::milliseconds block_limit) {
  return std::make_unique<CudaRuntime>(device, block_limit);
}

}  // namespace device

namespace {

[[maybe_unused]] const bool kRegistered =
    register_device_engine(c10::kCUDA, [](const EngineOptions& o, HostLink& h, int index) {
      return make_device_engine(o, h, device::make_cuda_runtime(index, std::chrono::milliseconds(o.timeout_ms)));
    });

}  // namespace
}  // namespace fastcomm
