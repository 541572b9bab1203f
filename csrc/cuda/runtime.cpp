#include "cuda/runtime_impl.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <optional>

#include "cuda/ipc.h"
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

void warn(cudaError_t r, const char* expr, const char* file, int line) {
  if (r == cudaSuccess) return;
  (void)cudaGetLastError();
  if (r == cudaErrorCudartUnloading || r == cudaErrorContextIsDestroyed) return;
  TORCH_WARN("fastcomm: CUDA error in ", expr, " (", file, ":", line, "), ignored while releasing: ",
             cudaGetErrorName(r), ": ", cudaGetErrorString(r));
}

}  // namespace cuda

namespace device {
namespace cudart {
namespace {

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

}  // namespace

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

thread_local GroupState tl_group;

CudaRuntime::CudaRuntime(int device, std::chrono::milliseconds limit, bool blocking_pairs)
    : device_(device), limit_(limit), blocking_pairs_(blocking_pairs) {
  TORCH_CHECK_VALUE(device >= 0 && device < c10::cuda::device_count(), "fastcomm: no CUDA device ", device,
                    " (this process sees ", (int)c10::cuda::device_count(), ")");
}

// Streams are never destroyed, only recycled: the caching allocator records an event on
// every stream a tensor was kept on (keep) when that tensor is freed, however much later, and
// one on a destroyed stream fails in the allocator's free path. A stream of our own per
// caller (not torch's shared pool), so one peer's stuck work never holds up another's.
Stream CudaRuntime::new_stream() {
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

void CudaRuntime::destroy_stream(Stream s) {
  settle_stream(cs(s), "destroy_stream");
  std::lock_guard<std::mutex> lk(mu_);
  free_streams_.push_back(cs(s));
}

Stream CudaRuntime::current_stream() { return c10::cuda::getCurrentCUDAStream(dev()).stream(); }

bool CudaRuntime::capturing(Stream s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  FASTCOMM_GPU_CHECK(cudaStreamIsCapturing(cs(s), &st));
  return st != cudaStreamCaptureStatusNone;
}

void CudaRuntime::relax_capture_mode() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  FASTCOMM_GPU_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
}

int CudaRuntime::exchange_capture_mode(int mode) {
  static_assert(Runtime::kCaptureRelaxed == (int)cudaStreamCaptureModeRelaxed, "the relaxed mode's value");
  auto m = static_cast<cudaStreamCaptureMode>(mode);
  FASTCOMM_GPU_CHECK(cudaThreadExchangeStreamCaptureMode(&m));
  return static_cast<int>(m);
}

// CUDA graphs: captured in the thread-local mode, so the engine thread's event queries
// (relaxed) and other threads' work never touch the capture.
void CudaRuntime::begin_capture(Stream s) {
  settle_stream(cs(s), "begin_capture");
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cudaStreamBeginCapture(cs(s), cudaStreamCaptureModeThreadLocal));
}

void* CudaRuntime::end_capture(Stream s) {
  settle_stream(cs(s), "end_capture");
  c10::cuda::CUDAGuard g(dev());
  cudaGraph_t graph = nullptr;
  FASTCOMM_GPU_CHECK(cudaStreamEndCapture(cs(s), &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t r = cudaGraphInstantiate(&exec, graph, 0);
  FASTCOMM_GPU_WARN(cudaGraphDestroy(graph));  // the instance keeps what it needs
  cuda::check(r, nullptr, "cudaGraphInstantiate(&exec, graph, 0)", __FILE__, __LINE__);
  return exec;
}

void CudaRuntime::graph_launch(void* graph, Stream s) {
  settle_stream(cs(s), "graph_launch");
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), cs(s)));
}

void CudaRuntime::capture_keep(Stream s, std::shared_ptr<void> ref) {
  c10::cuda::CUDAGuard g(dev());
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
#if CUDART_VERSION >= 13000
  FASTCOMM_GPU_CHECK(cudaStreamGetCaptureInfo(cs(s), &st, nullptr, &graph, nullptr, nullptr, nullptr));
#else
  FASTCOMM_GPU_CHECK(cudaStreamGetCaptureInfo_v2(cs(s), &st, nullptr, &graph, nullptr, nullptr));
#endif
  TORCH_CHECK(st == cudaStreamCaptureStatusActive && graph != nullptr, "fastcomm: capture_keep: the stream's capture is ",
              st == cudaStreamCaptureStatusInvalidated ? "invalidated" : "not active");
  auto* held = new std::shared_ptr<void>(std::move(ref));
  cudaUserObject_t obj = nullptr;
  const cudaError_t r = cudaUserObjectCreate(
      &obj, held, [](void* p) { delete static_cast<std::shared_ptr<void>*>(p); }, 1, cudaUserObjectNoDestructorSync);
  if (r != cudaSuccess) {
    delete held;
    cuda::check(r, nullptr, "cudaUserObjectCreate", __FILE__, __LINE__);
  }
  const cudaError_t moved = cudaGraphRetainUserObject(graph, obj, 1, cudaGraphUserObjectMove);  // the graph owns it now
  if (moved != cudaSuccess) {
    FASTCOMM_GPU_WARN(cudaUserObjectRelease(obj, 1));  // drops `held`
    cuda::check(moved, nullptr, "cudaGraphRetainUserObject", __FILE__, __LINE__);
  }
}

void CudaRuntime::graph_destroy(void* graph) {
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)));
}

void CudaRuntime::host_call(Stream s, void (*fn)(void*), void* arg) {
  settle_stream(cs(s), "host_call");
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cudaLaunchHostFunc(cs(s), fn, arg));
}

void CudaRuntime::on_idle_stream(const std::function<void()>& f) {
  // On the publisher's thread, which has nothing to raise to: without a stream of our own (a
  // failed CUDA call), the Future is completed as before, on the thread's current stream.
  std::optional<c10::cuda::CUDAStreamGuard> g;
  try {
    std::call_once(idle_once_, [this] { idle_ = cs(new_stream()); });
    g.emplace(c10::cuda::getStreamFromExternal(idle_, dev()));
  } catch (const std::exception&) {
  }
  f();
}

Event CudaRuntime::new_event() {
  c10::cuda::CUDAGuard g(dev());
  cudaEvent_t e = nullptr;
  FASTCOMM_GPU_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void CudaRuntime::destroy_event(Event e) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    drop_deferred_record_locked(ce(e));
  }
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cudaEventDestroy(ce(e)));
}

void CudaRuntime::record(Event e, Stream s) {
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

void CudaRuntime::wait(Stream s, Event e) {
  settle_event(ce(e), "wait");
  settle_stream(cs(s), "wait");
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cudaStreamWaitEvent(cs(s), ce(e), 0));
}

State CudaRuntime::query(Event e) {
  std::shared_ptr<Pending> p;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = event_pending_.find(ce(e));
    if (it != event_pending_.end()) p = it->second;
  }
  if (p && !try_settle(p)) return State::kPending;
  // On this runtime's device: a thread with none set (a plan graph's watcher) would otherwise
  // make a context on device 0 at its first CUDA call.
  c10::cuda::CUDAGuard g(dev());
  const cudaError_t r = cudaEventQuery(ce(e));
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return State::kPending;
  }
  cuda::check(r, nullptr, "cudaEventQuery(e)", __FILE__, __LINE__);
  return State::kReady;
}

void CudaRuntime::synchronize(Event e) {
  settle_event(ce(e), "synchronize");
  c10::cuda::CUDAGuard g(dev());  // as in query()
  FASTCOMM_GPU_CHECK(cudaEventSynchronize(ce(e)));
}

void CudaRuntime::copy(void* dst, const void* src, size_t bytes, Stream s) {
  settle_stream(cs(s), "copy");
  if (bytes == 0) return;
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cs(s)));
}

namespace {
cuda::ReduceJob reduce_job(const FoldJob& j) {
  TORCH_INTERNAL_ASSERT(j.n >= 1 && j.me >= 0 && j.me < j.n && j.numel >= 0, "fastcomm: bad fold job");
  return cuda::ReduceJob{j.dst, j.own, j.scratch, j.numel, j.n, j.me, fold_dtype(j.dtype), fold_op(j.op, j.dtype)};
}
}  // namespace

void CudaRuntime::fold(const FoldJob* jobs, int count, Stream s) {
  if (count <= 0) return;
  std::vector<cuda::ReduceJob> rj((size_t)count);
  for (int i = 0; i < count; ++i) rj[(size_t)i] = reduce_job(jobs[i]);
  settle_stream(cs(s), "fold");
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cuda::launch_fused_reduce(rj.data(), count, cs(s)));
}

at::Tensor CudaRuntime::scratch(int64_t numel, const at::Tensor& like, Stream s) {
  // The allocation belongs to stream s: the allocator hands its memory out again, to s, only
  // for work enqueued after what uses it.
  c10::cuda::CUDAStreamGuard g(c10::cuda::getStreamFromExternal(cs(s), dev()));
  return at::empty({numel}, like.options().device(c10::Device(c10::kCUDA, dev())));
}

void CudaRuntime::keep(const at::Tensor& t, Stream s) {
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

bool CudaRuntime::ipc_supported() { return cuda::ipc_supported(device_); }
bool CudaRuntime::ipc_graphs() { return cuda::ipc_graphs(device_); }
void* CudaRuntime::ipc_create(size_t bytes, int nflags, IpcHandle* h, IpcBlock* b, bool host) {
  return cuda::ipc_create(device_, bytes, nflags, h, b, host);
}
bool CudaRuntime::ipc_readable(const IpcHandle& h) { return cuda::ipc_readable(device_, h); }
void* CudaRuntime::ipc_open(const IpcHandle& h, IpcBlock* b, const IpcClaim& claim) {
  return cuda::ipc_open(device_, h, b, claim);
}
void CudaRuntime::ipc_close(void* token) { cuda::ipc_close(device_, token); }
void CudaRuntime::ipc_close_data(void* token) { cuda::ipc_close_data(device_, token); }
void CudaRuntime::flag_write(uint32_t* flag, uint32_t value, Stream s) {
  settle_stream(cs(s), "flag_write");
  c10::cuda::CUDAGuard g(dev());
  cuda::flag_write(flag, value, cs(s));
}
void CudaRuntime::flag_wait(Stream s, const uint32_t* flag, uint32_t value) {
  settle_stream(cs(s), "flag_wait");
  c10::cuda::CUDAGuard g(dev());
  cuda::flag_wait(cs(s), flag, value);
}
void CudaRuntime::copy_flag(void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value, Stream s) {
  settle_stream(cs(s), "copy_flag");
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cuda::launch_copy_flag(dst, src, bytes, flag, value, cs(s)));
}
void CudaRuntime::fold_flag(const FoldJob& j, uint32_t* flag, uint32_t value, Stream s) {
  const cuda::ReduceJob rj = reduce_job(j);
  settle_stream(cs(s), "fold_flag");
  c10::cuda::CUDAGuard g(dev());
  FASTCOMM_GPU_CHECK(cuda::launch_fold_flag(rj, flag, value, cs(s)));
}
void CudaRuntime::flag_set(uint32_t* flag, uint32_t value) { __atomic_store_n(flag, value, __ATOMIC_RELEASE); }

void CudaRuntime::record_stream(const at::Tensor& t, cudaStream_t s) {
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), c10::cuda::getStreamFromExternal(s, dev()));
}

}  // namespace cudart

std::unique_ptr<Runtime> make_cuda_runtime(int device, std::chrono::milliseconds block_limit, bool blocking_pairs) {
  return std::make_unique<cudart::CudaRuntime>(device, block_limit, blocking_pairs);
}

}  // namespace device

namespace {

[[maybe_unused]] const bool kRegistered =
    register_device_engine(c10::kCUDA, [](const EngineOptions& o, HostLink& h, int index) {
      return make_device_engine(o, h,
                                device::make_cuda_runtime(index, std::chrono::milliseconds(o.timeout_ms),
                                                          o.settings.device_pair_blocking));
    });

}  // namespace
}  // namespace fastcomm
