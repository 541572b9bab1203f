#include "engine/cuda_ops.h"

#include <ATen/core/jit_type.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <sstream>

namespace fastcomm {

using Clock = std::chrono::steady_clock;
using RedOpType = c10d::ReduceOp::RedOpType;

namespace {

bool dtype_of(c10::ScalarType t, cuda::DType& out) {
  switch (t) {
    case c10::kHalf: out = cuda::DType::F16; return true;
    case c10::kBFloat16: out = cuda::DType::BF16; return true;
    case c10::kFloat: out = cuda::DType::F32; return true;
    case c10::kDouble: out = cuda::DType::F64; return true;
    case c10::kChar: out = cuda::DType::I8; return true;
    case c10::kByte: out = cuda::DType::U8; return true;
    case c10::kShort: out = cuda::DType::I16; return true;
    case c10::kInt: out = cuda::DType::I32; return true;
    case c10::kLong: out = cuda::DType::I64; return true;
    default: return false;
  }
}

std::exception_ptr comm_error_ptr(const std::string& msg) {
  try {
    throw_comm_error(msg);
  } catch (...) {
    return std::current_exception();
  }
}

int slot_of(int j, int me) { return j < me ? j : j - 1; }

// Whether a same-host peer's process has exited. kill(pid, 0) alone is not enough: a dead
// process that its parent has not reaped yet (a zombie: a launcher or test harness busy
// waiting on another child) still answers it, so its state is read from procfs too.
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;  // no procfs: trust kill()
  const auto rp = line.rfind(')');
  if (rp == std::string::npos || rp + 2 >= line.size()) return false;
  const char state = line[rp + 2];
  return state == 'Z' || state == 'X';
}

void record_on(const at::Tensor& t, const c10::cuda::CUDAStream& s) {
  if (t.defined() && t.numel() > 0) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), s);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Work

CudaWork::CudaWork(std::shared_ptr<CudaOps> owner, int rank, c10d::OpType type,
                   std::vector<at::Tensor> outputs, bool capturing)
    : c10d::Work(rank, type), owner_(std::move(owner)), outputs_(std::move(outputs)), capturing_(capturing) {}

CudaWork::~CudaWork() {
  if (end_ != nullptr) owner_->give_event(end_);
}

bool CudaWork::finished() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return completed_;
}

void CudaWork::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (completed_) return;
    completed_ = true;
    exception_ = error;
  }
  cv_.notify_all();
}

bool CudaWork::poll_event() {
  const cudaError_t r = cudaEventQuery(end_);
  if (r == cudaErrorNotReady) return false;
  FASTCOMM_GPU_CHECK(r);
  return true;
}

bool CudaWork::isCompleted() {
  if (finished()) return true;
  if (capturing_) return false;  // a captured op runs when the graph is replayed, not now
  if (auto b = owner_->broken()) {
    finish(b);
    return true;
  }
  if (poll_event()) {
    finish(nullptr);
    return true;
  }
  return false;
}

bool CudaWork::isSuccess() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr CudaWork::exception() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return exception_;
}

bool CudaWork::wait(std::chrono::milliseconds timeout) {
  if (auto e = exception()) std::rethrow_exception(e);
  owner_->raise_if_broken();
  c10::cuda::CUDAGuard dg((c10::DeviceIndex)owner_->device());
  FASTCOMM_GPU_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream().stream(), end_, 0));
  if (timeout != kNoTimeout) host_wait(timeout);
  return true;
}

void CudaWork::synchronize() { host_wait(owner_->timeout()); }

void CudaWork::host_wait(std::chrono::milliseconds timeout) {
  TORCH_CHECK(!capturing_, "fastcomm: rank ", owner_->rank(),
              ": cannot host-wait for an op captured in a CUDA graph; it runs when the graph is replayed");
  const auto start = Clock::now();
  for (int spins = 0;; ++spins) {
    if (isCompleted()) {
      if (auto e = exception()) std::rethrow_exception(e);
      return;
    }
    if (Clock::now() - start > timeout) {
      throw_comm_error("fastcomm: rank " + std::to_string(owner_->rank()) + ": CUDA op not finished after " +
                       std::to_string(timeout.count()) + " ms (host wait timed out)");
    }
    if (spins < 200) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> CudaWork::getFuture() {
  std::lock_guard<std::mutex> lk(mutex_);
  if (!future_) {
    // A CUDA-aware future, completed in stream order as ProcessGroupNCCL does: consumers'
    // streams wait for an event recorded on the internal stream after this op.
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()),
        std::vector<c10::Device>{c10::Device(c10::kCUDA, (c10::DeviceIndex)owner_->device())});
    if (exception_) {
      future_->setError(exception_);
    } else {
      c10::cuda::CUDAStreamGuard g(owner_->stream());
      future_->markCompleted(c10::IValue(outputs_));
    }
  }
  return future_;
}

// ---------------------------------------------------------------------------------------------
// CudaOps

CudaOps::CudaOps(const EngineOptions& opts, c10d::Store& store, int device)
    : rank_(opts.rank),
      world_(opts.world_size),
      device_(device),
      timeout_(opts.timeout_ms),
      host_of_(opts.host_of),
      pids_(opts.pids),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, (c10::DeviceIndex)device)) {
  c10::cuda::CUDAGuard dg((c10::DeviceIndex)device);
  comm_ = std::make_unique<nccl::WorldComm>(store, rank_, world_, device, timeout_);
  FASTCOMM_GPU_CHECK(cudaEventCreateWithFlags(&start_, cudaEventDisableTiming));
  watchdog_ = std::thread([this] { watchdog_main(); });
}

CudaOps::~CudaOps() {
  shutdown();
  // Teardown: nothing is left to report an error to, so these two are not checked.
  if (start_ != nullptr) (void)cudaEventDestroy(start_);
  for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
}

std::shared_ptr<CudaOps> CudaOps::get(Engine& e, int device) {
  TORCH_CHECK(!e.is_shut_down(), "fastcomm: rank ", e.rank(), ": fastcomm was shut down; call fastcomm.init() again first");
  std::lock_guard<std::mutex> lk(e.extension_mutex());
  auto& ext = e.cuda_extension();
  if (!ext) {
    TORCH_CHECK(e.store(), "fastcomm: rank ", e.rank(), ": no store for the NCCL rendezvous (engine made outside fastcomm.init)");
    ext = std::make_shared<CudaOps>(e.options(), *e.store(), device);
  }
  return std::static_pointer_cast<CudaOps>(ext);
}

void CudaOps::shutdown() {
  std::deque<c10::intrusive_ptr<CudaWork>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    stop_ = true;
    if (!broken_) broken_ = comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ": fastcomm was shut down");
    left.swap(pending_);
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  bool unfinished = false;
  for (auto& w : left) {
    bool done = w->finished();
    try {
      done = done || w->poll_event();
    } catch (const std::exception&) {
    }
    if (!done) unfinished = true;
    w->finish(done ? nullptr : broken_);
  }
  // Ops still in flight may wait on a peer forever: abort (thread-safe, and it also releases
  // an issuer blocked inside NCCL) before taking the issue lock to tear down.
  if (unfinished && comm_) comm_->abort();
  std::lock_guard<std::mutex> plk(post_mu_);
  comm_.reset();
}

std::exception_ptr CudaOps::broken() const {
  std::lock_guard<std::mutex> lk(mu_);
  return broken_;
}

void CudaOps::raise_if_broken() {
  if (auto e = broken()) std::rethrow_exception(e);
}

cudaEvent_t CudaOps::take_event() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  cudaEvent_t e;
  FASTCOMM_GPU_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void CudaOps::give_event(cudaEvent_t e) {
  std::lock_guard<std::mutex> lk(mu_);
  free_events_.push_back(e);
}

// ---------------------------------------------------------------------------------------------
// Validation: everything is checked locally before anything reaches NCCL. (What the CPU path
// also catches across members -- mismatched dtype/numel/op -- is not checked here: that would
// cost a round trip per op. As with ProcessGroupNCCL, members must agree.)

void CudaOps::check_common(const GroupHandle& g, const char* api, const at::Tensor& t, const char* arg) const {
  TORCH_CHECK_VALUE(g.state != nullptr, "fastcomm.", api, ": rank ", rank_, " is not a member of group ",
                    g.label(), " (argument 'group')");
  TORCH_CHECK_VALUE(t.defined(), "fastcomm.", api, ": rank ", rank_, ", group ", g.label(), ": argument '", arg,
                    "' is undefined");
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided && t.is_cuda(), "fastcomm.", api, ": rank ", rank_, ", group ",
                    g.label(), ": argument '", arg, "' must be a dense CUDA tensor like the op's other tensors, got ",
                    t.device(), " ", t.layout());
  TORCH_CHECK_VALUE(t.device().index() == device_, "fastcomm.", api, ": rank ", rank_, ", group ", g.label(),
                    ": argument '", arg, "' is on ", t.device(), " but this process's NCCL communicator is on cuda:",
                    device_, " (one device per process)");
  TORCH_CHECK_VALUE(t.is_contiguous(), "fastcomm.", api, ": rank ", rank_, ", group ", g.label(), ": argument '",
                    arg, "' must be contiguous");
  cuda::DType d;
  TORCH_CHECK_TYPE(dtype_of(t.scalar_type(), d), "fastcomm.", api, ": rank ", rank_, ", group ", g.label(),
                   ": argument '", arg, "' has unsupported dtype ", t.scalar_type());
}

namespace {
cuda::RedOp check_redop(int rank, const GroupHandle& g, const char* api, RedOpType op, c10::ScalarType dt) {
  using R = c10d::ReduceOp;
  cuda::RedOp out;
  switch (op) {
    case R::SUM: out = cuda::RedOp::Sum; break;
    case R::AVG: out = cuda::RedOp::Avg; break;
    case R::PRODUCT: out = cuda::RedOp::Product; break;
    case R::MIN: out = cuda::RedOp::Min; break;
    case R::MAX: out = cuda::RedOp::Max; break;
    default:
      TORCH_CHECK_VALUE(false, "fastcomm.", api, ": rank ", rank, ", group ", g.label(), ": argument 'op' ", (int)op,
                        " is not supported (SUM, AVG, PRODUCT, MIN, MAX are)");
  }
  TORCH_CHECK_VALUE(op != R::AVG || c10::isFloatingType(dt), "fastcomm.", api, ": rank ", rank, ", group ", g.label(),
                    ": argument 'op' AVG needs a floating dtype, got ", dt);
  return out;
}

void check_like(int rank, const GroupHandle& g, const char* api, const at::Tensor& t, const std::string& arg,
                const at::Tensor& ref, int64_t numel) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), "fastcomm.", api, ": rank ", rank, ", group ", g.label(),
                   ": argument '", arg, "' has dtype ", t.scalar_type(), ", expected ", ref.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == numel, "fastcomm.", api, ": rank ", rank, ", group ", g.label(), ": argument '", arg,
                    "' has ", t.numel(), " elements, expected ", numel);
}

CudaOp base(CudaOp::Kind k, c10d::OpType type, const GroupHandle& g) {
  CudaOp op;
  op.kind = k;
  op.type = type;
  op.ranks = g.ranks;
  op.me = g.rank;
  return op;
}
}  // namespace

CudaOp CudaOps::prepare_all_reduce(const GroupHandle& g, const at::Tensor& t, RedOpType rop) {
  check_common(g, "all_reduce", t, "tensor");
  CudaOp op = base(CudaOp::AllReduce, c10d::OpType::ALLREDUCE, g);
  op.redop = check_redop(rank_, g, "all_reduce", rop, t.scalar_type());
  op.in = t;
  return op;
}

CudaOp CudaOps::prepare_broadcast(const GroupHandle& g, const at::Tensor& t, int src) {
  check_common(g, "broadcast", t, "tensor");
  auto it = std::find(g.ranks.begin(), g.ranks.end(), src);
  TORCH_CHECK_VALUE(it != g.ranks.end(), "fastcomm.broadcast: rank ", rank_, ", group ", g.label(),
                    ": argument 'src' is rank ", src, ", which is not in the group");
  CudaOp op = base(CudaOp::Broadcast, c10d::OpType::BROADCAST, g);
  op.in = t;
  op.peer = (int)(it - g.ranks.begin());
  return op;
}

CudaOp CudaOps::prepare_all_gather(const GroupHandle& g, const std::vector<at::Tensor>& outs, const at::Tensor& in) {
  check_common(g, "all_gather", in, "tensor");
  TORCH_CHECK_VALUE(outs.size() == g.ranks.size(), "fastcomm.all_gather: rank ", rank_, ", group ", g.label(),
                    ": argument 'tensor_list' has ", outs.size(), " tensors, expected one per member (",
                    g.ranks.size(), ")");
  for (size_t i = 0; i < outs.size(); ++i) {
    const std::string arg = "tensor_list[" + std::to_string(i) + "]";
    check_common(g, "all_gather", outs[i], arg.c_str());
    check_like(rank_, g, "all_gather", outs[i], arg, in, in.numel());
  }
  CudaOp op = base(CudaOp::AllGather, c10d::OpType::ALLGATHER, g);
  op.in = in;
  op.outs = outs;
  return op;
}

CudaOp CudaOps::prepare_all_gather_into_tensor(const GroupHandle& g, const at::Tensor& out, const at::Tensor& in) {
  check_common(g, "all_gather_into_tensor", in, "input_tensor");
  check_common(g, "all_gather_into_tensor", out, "output_tensor");
  check_like(rank_, g, "all_gather_into_tensor", out, "output_tensor", in, in.numel() * (int64_t)g.ranks.size());
  CudaOp op = base(CudaOp::AllGather, c10d::OpType::_ALLGATHER_BASE, g);
  op.in = in;
  op.out = out;
  return op;
}

CudaOp CudaOps::prepare_reduce_scatter(const GroupHandle& g, const at::Tensor& out, const std::vector<at::Tensor>& ins,
                                       RedOpType rop) {
  check_common(g, "reduce_scatter", out, "output");
  TORCH_CHECK_VALUE(ins.size() == g.ranks.size(), "fastcomm.reduce_scatter: rank ", rank_, ", group ", g.label(),
                    ": argument 'input_list' has ", ins.size(), " tensors, expected one per member (",
                    g.ranks.size(), ")");
  for (size_t i = 0; i < ins.size(); ++i) {
    const std::string arg = "input_list[" + std::to_string(i) + "]";
    check_common(g, "reduce_scatter", ins[i], arg.c_str());
    check_like(rank_, g, "reduce_scatter", ins[i], arg, out, out.numel());
  }
  CudaOp op = base(CudaOp::ReduceScatter, c10d::OpType::REDUCE_SCATTER, g);
  op.redop = check_redop(rank_, g, "reduce_scatter", rop, out.scalar_type());
  op.out = out;
  op.ins = ins;
  return op;
}

CudaOp CudaOps::prepare_reduce_scatter_tensor(const GroupHandle& g, const at::Tensor& out, const at::Tensor& in,
                                              RedOpType rop) {
  check_common(g, "reduce_scatter_tensor", out, "output");
  check_common(g, "reduce_scatter_tensor", in, "input");
  check_like(rank_, g, "reduce_scatter_tensor", in, "input", out, out.numel() * (int64_t)g.ranks.size());
  CudaOp op = base(CudaOp::ReduceScatter, c10d::OpType::_REDUCE_SCATTER_BASE, g);
  op.redop = check_redop(rank_, g, "reduce_scatter_tensor", rop, out.scalar_type());
  op.out = out;
  op.in = in;
  return op;
}

CudaOp CudaOps::prepare_p2p(const GroupHandle& g, const at::Tensor& t, int peer, bool sending) {
  const char* api = sending ? "send" : "recv";
  check_common(g, api, t, "tensor");
  TORCH_CHECK_VALUE(std::find(g.ranks.begin(), g.ranks.end(), peer) != g.ranks.end() && peer != rank_, "fastcomm.",
                    api, ": rank ", rank_, ", group ", g.label(), ": argument '", sending ? "dst" : "src",
                    "' is rank ", peer, ", which is not another member of the group");
  CudaOp op = base(sending ? CudaOp::Send : CudaOp::Recv, sending ? c10d::OpType::SEND : c10d::OpType::RECV, g);
  op.in = t;
  op.peer = peer;
  return op;
}

// ---------------------------------------------------------------------------------------------
// Issue

c10::intrusive_ptr<CudaWork> CudaOps::post(std::vector<CudaOp> ops, bool async_op) {
  std::lock_guard<std::mutex> plk(post_mu_);
  raise_if_broken();
  c10::cuda::CUDAGuard dg((c10::DeviceIndex)device_);
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream().stream();
  const cudaStream_t s = stream_.stream();
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  FASTCOMM_GPU_CHECK(cudaStreamIsCapturing(caller, &cap));
  const bool capturing = cap == cudaStreamCaptureStatusActive;
  // The internal stream starts where the caller's stream is now: the inputs are ready.
  FASTCOMM_GPU_CHECK(cudaEventRecord(start_, caller));
  FASTCOMM_GPU_CHECK(cudaStreamWaitEvent(s, start_, 0));

  std::vector<at::Tensor> outputs;
  std::vector<cuda::ReduceJob> jobs;
  std::vector<int> peers;
  ncclComm_t comm = comm_->get();
  {
    // Scratch is allocated on the internal stream, so the allocator reuses it only after the
    // op (and, inside a graph capture, from the graph's private pool).
    c10::cuda::CUDAStreamGuard sg(stream_);
    for (CudaOp& op : ops) {
      const int n = (int)op.ranks.size();
      switch (op.kind) {
        case CudaOp::AllReduce:
          if (n > 1 && op.in.numel() > 0) op.scratch = at::empty({(int64_t)(n - 1) * op.in.numel()}, op.in.options());
          break;
        case CudaOp::ReduceScatter:
          if (n > 1 && op.out.numel() > 0)
            op.scratch = at::empty({(int64_t)(n - 1) * op.out.numel()}, op.out.options());
          break;
        case CudaOp::AllGather: {
          // This member's own block never travels: a device copy (skipped when in place).
          const size_t bytes = op.in.nbytes();
          void* dst = op.out.defined() ? (uint8_t*)op.out.data_ptr() + (size_t)op.me * bytes : op.outs[op.me].data_ptr();
          if (bytes > 0 && dst != op.in.data_ptr())
            FASTCOMM_GPU_CHECK(cudaMemcpyAsync(dst, op.in.data_ptr(), bytes, cudaMemcpyDeviceToDevice, s));
          break;
        }
        default:
          break;
      }
    }

    FASTCOMM_GPU_CHECK_COMM(ncclGroupStart(), comm);
    try {
      for (CudaOp& op : ops) {
        const int n = (int)op.ranks.size();
        cuda::DType dt;
        switch (op.kind) {
          case CudaOp::AllReduce: {
            outputs.push_back(op.in);
            const size_t bytes = op.in.nbytes();
            if (n == 1 || bytes == 0) break;
            uint8_t* scratch = (uint8_t*)op.scratch.data_ptr();
            for (int j = 0; j < n; ++j) {
              if (j == op.me) continue;
              FASTCOMM_GPU_CHECK_COMM(ncclSend(op.in.data_ptr(), bytes, ncclUint8, op.ranks[j], comm, s), comm);
              FASTCOMM_GPU_CHECK_COMM(
                  ncclRecv(scratch + (size_t)slot_of(j, op.me) * bytes, bytes, ncclUint8, op.ranks[j], comm, s), comm);
            }
            dtype_of(op.in.scalar_type(), dt);
            jobs.push_back({op.in.data_ptr(), op.in.data_ptr(), scratch, op.in.numel(), n, op.me, dt, op.redop});
            break;
          }
          case CudaOp::Broadcast: {
            outputs.push_back(op.in);
            const size_t bytes = op.in.nbytes();
            if (bytes == 0) break;
            if (op.me == op.peer) {
              for (int j = 0; j < n; ++j)
                if (j != op.me)
                  FASTCOMM_GPU_CHECK_COMM(ncclSend(op.in.data_ptr(), bytes, ncclUint8, op.ranks[j], comm, s), comm);
            } else {
              FASTCOMM_GPU_CHECK_COMM(ncclRecv(op.in.data_ptr(), bytes, ncclUint8, op.ranks[op.peer], comm, s), comm);
            }
            break;
          }
          case CudaOp::AllGather: {
            if (op.out.defined()) outputs.push_back(op.out);
            else outputs.insert(outputs.end(), op.outs.begin(), op.outs.end());
            const size_t bytes = op.in.nbytes();
            if (bytes == 0) break;
            for (int j = 0; j < n; ++j) {
              if (j == op.me) continue;
              void* dst = op.out.defined() ? (uint8_t*)op.out.data_ptr() + (size_t)j * bytes : op.outs[j].data_ptr();
              FASTCOMM_GPU_CHECK_COMM(ncclSend(op.in.data_ptr(), bytes, ncclUint8, op.ranks[j], comm, s), comm);
              FASTCOMM_GPU_CHECK_COMM(ncclRecv(dst, bytes, ncclUint8, op.ranks[j], comm, s), comm);
            }
            break;
          }
          case CudaOp::ReduceScatter: {
            outputs.push_back(op.out);
            const size_t bytes = op.out.nbytes();
            if (bytes == 0) break;
            auto block = [&](int j) -> void* {
              return op.in.defined() ? (uint8_t*)op.in.data_ptr() + (size_t)j * bytes : op.ins[j].data_ptr();
            };
            dtype_of(op.out.scalar_type(), dt);
            if (n == 1) {
              // A group of one: the reduction is a copy.
              FASTCOMM_GPU_CHECK(cudaMemcpyAsync(op.out.data_ptr(), block(0), bytes, cudaMemcpyDeviceToDevice, s));
              break;
            }
            uint8_t* scratch = (uint8_t*)op.scratch.data_ptr();
            for (int j = 0; j < n; ++j) {
              if (j == op.me) continue;
              FASTCOMM_GPU_CHECK_COMM(ncclSend(block(j), bytes, ncclUint8, op.ranks[j], comm, s), comm);
              FASTCOMM_GPU_CHECK_COMM(
                  ncclRecv(scratch + (size_t)slot_of(j, op.me) * bytes, bytes, ncclUint8, op.ranks[j], comm, s), comm);
            }
            jobs.push_back({op.out.data_ptr(), block(op.me), scratch, op.out.numel(), n, op.me, dt, op.redop});
            break;
          }
          case CudaOp::Send:
          case CudaOp::Recv: {
            outputs.push_back(op.in);
            const size_t bytes = op.in.nbytes();
            if (bytes == 0) break;
            if (op.kind == CudaOp::Send)
              FASTCOMM_GPU_CHECK_COMM(ncclSend(op.in.data_ptr(), bytes, ncclUint8, op.peer, comm, s), comm);
            else
              FASTCOMM_GPU_CHECK_COMM(ncclRecv(op.in.data_ptr(), bytes, ncclUint8, op.peer, comm, s), comm);
            break;
          }
        }
      }
    } catch (...) {
      (void)ncclGroupEnd();  // close the group so the communicator stays usable for the next call
      throw;
    }
    FASTCOMM_GPU_CHECK_COMM(ncclGroupEnd(), comm);
    if (!jobs.empty()) FASTCOMM_GPU_CHECK(cuda::launch_fused_reduce(jobs.data(), (int)jobs.size(), s));

    if (!capturing) {
      for (const CudaOp& op : ops) {
        record_on(op.in, stream_);
        record_on(op.out, stream_);
        for (const auto& t : op.outs) record_on(t, stream_);
        for (const auto& t : op.ins) record_on(t, stream_);
      }
    }
  }
  for (const CudaOp& op : ops) {
    if (op.kind == CudaOp::Send || op.kind == CudaOp::Recv) peers.push_back(op.peer);
    else
      for (int r : op.ranks)
        if (r != rank_) peers.push_back(r);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());

  const c10d::OpType type = ops.size() == 1 ? ops[0].type : c10d::OpType::COALESCED;
  auto w = c10::make_intrusive<CudaWork>(shared_from_this(), rank_, type, std::move(outputs), capturing);
  w->end_ = take_event();
  FASTCOMM_GPU_CHECK(cudaEventRecord(w->end_, s));
  w->peers_ = std::move(peers);
  w->deadline_ = Clock::now() + timeout_;
  if (!capturing) {
    std::lock_guard<std::mutex> lk(mu_);
    pending_.push_back(w);
  }
  cv_.notify_one();
  if (!async_op) FASTCOMM_GPU_CHECK(cudaStreamWaitEvent(caller, w->end_, 0));
  return w;
}

// ---------------------------------------------------------------------------------------------
// Watchdog

void CudaOps::fail_all(const std::string& why) {
  auto e = comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ": NCCL path failed: " + why +
                          ". The world NCCL communicator was aborted: pending CUDA ops fail and later CUDA ops "
                          "raise until fastcomm.shutdown() and init() again");
  comm_->abort();
  std::deque<c10::intrusive_ptr<CudaWork>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!broken_) broken_ = e;
    left.swap(pending_);
  }
  for (auto& w : left) w->finish(e);
}

void CudaOps::watchdog_main() {
  // This thread only queries events and NCCL state. Relaxed capture mode keeps those queries
  // from invalidating a CUDA graph capture running on the user's thread.
  try {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    FASTCOMM_GPU_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    FASTCOMM_GPU_CHECK(cudaSetDevice(device_));
  } catch (const std::exception& e) {
    TORCH_WARN("fastcomm: rank ", rank_, ": NCCL watchdog setup: ", e.what());
  }
  auto last_async = Clock::now(), last_alive = Clock::now();
  std::vector<c10::intrusive_ptr<CudaWork>> works;
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    if (pending_.empty()) {
      cv_.wait(lk, [&] { return stop_ || !pending_.empty(); });
      continue;
    }
    works.assign(pending_.begin(), pending_.end());
    lk.unlock();
    std::string fault;
    size_t done = 0;
    try {
      // One stream: ops finish in issue order, so the first unfinished one is the only one to
      // look at.
      while (done < works.size() && (works[done]->finished() || works[done]->poll_event())) {
        works[done]->finish(nullptr);
        ++done;
      }
      const auto now = Clock::now();
      if (done < works.size()) {
        if (now > works[done]->deadline_) {
          fault = "a CUDA op did not finish within the timeout given to init (" + std::to_string(timeout_.count()) +
                  " ms)";
        }
        if (fault.empty() && now - last_async > std::chrono::milliseconds(5)) {
          last_async = now;
          const ncclResult_t r = comm_->async_error();
          if (r != ncclSuccess) {
            const char* last = ncclGetLastError(comm_->get());
            fault = std::string("NCCL asynchronous error: ") + ncclGetErrorString(r) +
                    (last && *last ? std::string(" (") + last + ")" : std::string());
          }
        }
        if (fault.empty() && now - last_alive > std::chrono::milliseconds(50)) {
          last_alive = now;
          for (size_t i = done; i < works.size() && fault.empty(); ++i) {
            for (int p : works[i]->peers_) {
              if (host_of_[p] == host_of_[rank_] && process_gone(pids_[p])) {
                fault = "peer rank " + std::to_string(p) + " (pid " + std::to_string(pids_[p]) + ") exited";
                break;
              }
            }
          }
        }
      }
    } catch (const std::exception& e) {
      fault = e.what();
    }
    lk.lock();
    // Retire the finished ops. `works` still holds a reference to each, so no Work is
    // destroyed here: a Work whose caller already dropped it (every blocking op) dies with its
    // last reference, and its destructor returns its event under mu_, which this thread holds
    // now. (Popping the last reference here deadlocked the watchdog on mu_, and with it the
    // next CUDA op and shutdown.) Only ops seen above are popped, in order.
    for (size_t i = 0; i < done && !pending_.empty() && pending_.front() == works[i]; ++i) pending_.pop_front();
    lk.unlock();
    works.clear();  // may run Work destructors: without mu_
    if (!fault.empty()) {
      fail_all(fault);
      lk.lock();
      continue;
    }
    lk.lock();
    cv_.wait_for(lk, std::chrono::microseconds(500), [&] { return stop_; });
  }
}

}  // namespace fastcomm
