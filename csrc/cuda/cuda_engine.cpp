#include "cuda/cuda_engine.h"

#include <ATen/core/jit_type.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <sstream>

#include "common/errors.h"
#include "common/process.h"
#include "cuda/reduce.h"

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

void record_on(const at::Tensor& t, const c10::cuda::CUDAStream& s) {
  if (t.defined() && t.numel() > 0) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), s);
}

// One op in the form the NCCL lowering below takes.
struct CudaOp {
  enum Kind : uint8_t { AllReduce, Broadcast, AllGather, ReduceScatter, Send, Recv };
  Kind kind;
  c10d::OpType type;
  std::vector<int> ranks;  // global ranks of the group; group rank i is ranks[i]
  int me = 0;              // this process's group rank
  at::Tensor in;           // all_reduce / broadcast / send / recv: the tensor; else the input
  at::Tensor out;          // all_gather_into_tensor, reduce_scatter*: the output
  std::vector<at::Tensor> outs, ins;  // list forms (all_gather, reduce_scatter)
  cuda::RedOp redop = cuda::RedOp::Sum;
  int peer = -1;       // broadcast: root group rank; send/recv: peer global rank
  at::Tensor scratch;  // allocated at issue, on the internal stream
};

cuda::RedOp cuda_redop(RedOpType op) {
  using R = c10d::ReduceOp;
  switch (op) {
    case R::AVG: return cuda::RedOp::Avg;
    case R::PRODUCT: return cuda::RedOp::Product;
    case R::MIN: return cuda::RedOp::Min;
    case R::MAX: return cuda::RedOp::Max;
    default: return cuda::RedOp::Sum;  // lower() refuses the rest
  }
}

// The CUDA path folds the dtypes dtype_of() knows with the five arithmetic ops; a request the
// host path takes beyond those (bool, BAND/BOR/BXOR) is refused here.
void check_cuda_fold(const OpRequest& r, const DeviceOp& d, int rank) {
  using R = c10d::ReduceOp;
  const c10::ScalarType st = (r.output.defined() ? r.output : r.tensor).scalar_type();
  cuda::DType dt;
  TORCH_CHECK_TYPE(dtype_of(st, dt), "fastcomm.", op_kind_name(r.kind), ": rank ", rank, ", group ", d.label,
                   ": dtype ", st, " is not supported for CUDA tensors");
  TORCH_CHECK_VALUE(r.redop == R::SUM || r.redop == R::AVG || r.redop == R::PRODUCT || r.redop == R::MIN ||
                        r.redop == R::MAX,
                    "fastcomm.", op_kind_name(r.kind), ": rank ", rank, ", group ", d.label, ": argument 'op' ",
                    redop_name(r.redop), " is not supported for CUDA tensors");
}

// The request (checked by check_request) in the lowering's form.
CudaOp lower(DeviceOp& d, int rank, int device) {
  OpRequest& r = d.req;
  const c10::Device dev = request_device(r);
  TORCH_CHECK_VALUE(dev.index() == device, "fastcomm.", op_kind_name(r.kind), ": rank ", rank, ", group ", d.label,
                    ": the op's tensors are on ", dev, " but this process's NCCL communicator is on cuda:", device,
                    " (one device per process)");
  if (r.kind == OpKind::kAllReduce || r.kind == OpKind::kReduceScatter || r.kind == OpKind::kReduceScatterTensor)
    check_cuda_fold(r, d, rank);
  CudaOp op;
  op.type = op_kind_type(r.kind);
  op.ranks = d.ranks;
  op.me = d.rank;
  op.redop = cuda_redop(r.redop);
  switch (r.kind) {
    case OpKind::kAllReduce:
      op.kind = CudaOp::AllReduce;
      op.in = r.tensor;
      break;
    case OpKind::kBroadcast:
      op.kind = CudaOp::Broadcast;
      op.in = r.tensor;
      op.peer = (int)(std::find(d.ranks.begin(), d.ranks.end(), r.peer) - d.ranks.begin());
      break;
    case OpKind::kAllGather:
      op.kind = CudaOp::AllGather;
      op.in = r.tensor;
      op.outs = r.list;
      break;
    case OpKind::kAllGatherIntoTensor:
      op.kind = CudaOp::AllGather;
      op.in = r.tensor;
      op.out = r.output;
      break;
    case OpKind::kReduceScatter:
      op.kind = CudaOp::ReduceScatter;
      op.out = r.output;
      op.ins = r.list;
      break;
    case OpKind::kReduceScatterTensor:
      op.kind = CudaOp::ReduceScatter;
      op.out = r.output;
      op.in = r.tensor;
      break;
    case OpKind::kSend:
    case OpKind::kRecv:
      op.kind = r.kind == OpKind::kSend ? CudaOp::Send : CudaOp::Recv;
      op.in = r.tensor;
      op.peer = r.peer;
      break;
    default:
      TORCH_CHECK_VALUE(false, "fastcomm.", op_kind_name(r.kind), ": rank ", rank, ", group ", d.label,
                        ": not supported for CUDA tensors");
  }
  return op;
}

}  // namespace

[[maybe_unused]] const bool kCudaRegistered = register_device_engine(
    c10::kCUDA, [](const EngineOptions& opts, c10d::Store& store, int index) -> std::shared_ptr<DeviceEngine> {
      return std::make_shared<CudaEngine>(opts, store, index);
    });

// ---------------------------------------------------------------------------------------------
// CudaEngine

CudaEngine::CudaEngine(const EngineOptions& opts, c10d::Store& store, int device)
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

CudaEngine::~CudaEngine() {
  shutdown();
  // Teardown: nothing is left to report an error to, so these two are not checked.
  if (start_ != nullptr) (void)cudaEventDestroy(start_);
  for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
}

void CudaEngine::shutdown() {
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
    bool done = w->done();
    try {
      done = done || w->poll_event();
    } catch (const std::exception&) {
    }
    if (!done) unfinished = true;
    w->settle(done ? nullptr : broken_, true);
  }
  // Ops still in flight may wait on a peer forever: abort (thread-safe, and it also releases
  // an issuer blocked inside NCCL) before taking the issue lock to tear down.
  if (unfinished && comm_) comm_->abort();
  std::lock_guard<std::mutex> plk(post_mu_);
  comm_.reset();
}

std::exception_ptr CudaEngine::broken() const {
  std::lock_guard<std::mutex> lk(mu_);
  return broken_;
}

void CudaEngine::raise_if_broken() {
  if (auto e = broken()) std::rethrow_exception(e);
}

cudaEvent_t CudaEngine::take_event() {
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

void CudaEngine::give_event(cudaEvent_t e) {
  std::lock_guard<std::mutex> lk(mu_);
  free_events_.push_back(e);
}

// ---------------------------------------------------------------------------------------------
// Issue

c10::intrusive_ptr<Work> CudaEngine::post(std::vector<DeviceOp> dops, bool async_op) {
  std::vector<CudaOp> ops;
  ops.reserve(dops.size());
  for (auto& d : dops) ops.push_back(lower(d, rank_, device_));
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

void CudaEngine::fail_all(const std::string& why) {
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
  for (auto& w : left) w->settle(e, true);
}

void CudaEngine::watchdog_main() {
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
      while (done < works.size() && (works[done]->done() || works[done]->poll_event())) {
        works[done]->settle(nullptr, true);
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
    // Retire the finished ops. `works` still holds a reference to each, so no Work dies here:
    // its destructor returns its event under mu_, which this thread holds now.
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
