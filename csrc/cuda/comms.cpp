// Communicators of the CUDA runtime (cuda/runtime_impl.h): init, state, abort, destroy; groups
// and collectives; the NCCL work a non-blocking communicator's thread still enqueues.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

#include "cuda/runtime_impl.h"

namespace fastcomm {
namespace device {
namespace cudart {

CudaRuntime::~CudaRuntime() {
  // Communicators the engine left behind: abort, which never waits for a peer. Streams are
  // kept (see new_stream); nothing is left to report an error to.
  for (auto& [raw, box] : comms_) {
    release_opener(*box);
    if (box->comm != nullptr) {
      try {
        c10::cuda::CUDAGuard g(dev());
        FASTCOMM_GPU_CHECK(ncclCommAbort(box->comm));
      } catch (const std::exception&) {
      }
    }
  }
}

UniqueId CudaRuntime::new_id() {
  static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId::bytes), "ncclUniqueId is 128 bytes");
  ncclUniqueId uid;
  FASTCOMM_GPU_CHECK(ncclGetUniqueId(&uid));
  UniqueId id;
  std::memcpy(id.bytes.data(), &uid, sizeof(uid));
  return id;
}

Comm CudaRuntime::comm_init(const UniqueId& id, int nranks, int rank) {
  ncclUniqueId uid;
  std::memcpy(&uid, id.bytes.data(), sizeof(uid));
  if (nranks == 2 && blocking_pairs_) return open_pair(uid, rank);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init and every later call return at once; see the header
  config.maxCTAs = kCommMaxCTAs;  // a group's kernels hold a slot of the bound too
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

// A pair channel's communicator launches on the engine thread (NCCL's blocking mode): a
// non-blocking one has NCCL start a thread at every ncclGroupEnd. What a blocking one would make
// the engine thread wait for, its init (every rank joins) and its first contact (the connection
// to the peer, made at the first send or receive), runs here on a thread of its own, once per
// communicator: after it, a launch only enqueues. Until it is done comm_state says kPending.
Comm CudaRuntime::open_pair(const ncclUniqueId& uid, int rank) {
  auto box = std::make_shared<CommBox>();
  box->nranks = 2;
  box->blocking = true;
  box->warm_stream = cs(new_stream());
  at::Tensor warm;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!warm_.defined()) {
      c10::cuda::CUDAGuard g(dev());
      warm_ = at::empty({2}, at::TensorOptions().dtype(at::kByte).device(c10::Device(c10::kCUDA, dev())));
    }
    warm = warm_;
    comms_[box.get()] = box;
  }
  const c10::DeviceIndex d = dev();
  box->opener = std::thread([box, uid, rank, d, warm] {
    ncclComm_t comm = nullptr;
    std::string error;
    try {
      c10::cuda::CUDAGuard g(d);
      // NCCL's init syncs its streams: that must not break a capture of the user's.
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      FASTCOMM_GPU_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 1;
      config.maxCTAs = kCommMaxCTAs;
      FASTCOMM_GPU_CHECK(ncclCommInitRankConfig(&comm, 2, uid, rank, &config));
      // First contact: one byte each way (into the shared scratch byte: its value is unused).
      auto* b = static_cast<uint8_t*>(warm.data_ptr());
      FASTCOMM_GPU_CHECK(ncclGroupStart());
      const ncclResult_t rs = ncclSend(b, 1, ncclUint8, 1 - rank, comm, box->warm_stream);
      const ncclResult_t rr = ncclRecv(b + 1, 1, ncclUint8, 1 - rank, comm, box->warm_stream);
      const ncclResult_t re = ncclGroupEnd();
      FASTCOMM_GPU_CHECK_COMM(rs, comm);
      FASTCOMM_GPU_CHECK_COMM(rr, comm);
      FASTCOMM_GPU_CHECK_COMM(re, comm);
      c10::cuda::CUDACachingAllocator::recordStream(warm.storage().data_ptr(),
                                                    c10::cuda::getStreamFromExternal(box->warm_stream, d));
    } catch (const std::exception& e) {
      error = e.what();
    }
    bool drop = false;
    {
      std::lock_guard<std::mutex> lk(box->mu);
      box->opened = true;
      box->open_error = error;
      drop = box->abandoned || !error.empty();
      if (!drop) box->comm = comm;
    }
    if (drop && comm != nullptr) {
      try {
        c10::cuda::CUDAGuard g(d);
        FASTCOMM_GPU_CHECK(ncclCommAbort(comm));
      } catch (const std::exception& e) {
        TORCH_WARN("fastcomm: aborting an abandoned NCCL communicator failed: ", e.what());
      }
    }
  });
  return box.get();
}

void CudaRuntime::release_opener(CommBox& box) {
  if (!box.opener.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(box.mu);
    if (!box.opened) {
      // A thread inside NCCL's blocking init cannot be interrupted or joined without waiting
      // for the peer (it may be dead): it holds its own share of the box, aborts what NCCL
      // gives it, and ends then or with the process.
      box.abandoned = true;
      box.opener.detach();
      return;
    }
  }
  box.opener.join();
}

State CudaRuntime::comm_state(Comm c, std::string* why) {
  auto box = box_of(c);
  if (box->blocking) {
    // No NCCL thread and nothing deferred: the opener, then NCCL's asynchronous errors.
    std::lock_guard<std::mutex> lk(box->mu);
    if (!box->opened && !box->aborted) return State::kPending;
    if (!box->open_error.empty()) {
      if (why) *why = box->open_error;
      return State::kFailed;
    }
  }
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

namespace {
// Clears CommBox::ending when the call that ends the communicator returns or throws.
struct EndingScope {
  CommBox& b;
  ~EndingScope() {
    std::lock_guard<std::mutex> lk(b.mu);
    b.ending = false;
  }
};
}  // namespace

void CudaRuntime::comm_abort(Comm c) {
  auto box = box_of(c);
  ncclComm_t comm;
  {
    std::lock_guard<std::mutex> lk(box->mu);
    if (box->blocking && !box->opened) {
      // Still opening: NCCL has given no communicator to abort yet; the opener aborts it.
      box->abandoned = true;
      box->aborted = true;
      return;
    }
    if (box->comm == nullptr) return;
    comm = box->comm;
    box->comm = nullptr;  // pollers never touch the freed comm; quiet() once it has ended
    box->aborted = true;
    box->ending = true;
  }
  {
    // Sets NCCL's abort flags (its kernels on our streams exit, so the streams drain), joins
    // its enqueue thread and frees the communicator.
    EndingScope ended{*box};
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

void CudaRuntime::comm_destroy(Comm c) {
  auto box = box_of(c);
  release_opener(*box);
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
    if (comm != nullptr) box->ending = true;  // (never cleared here: an abort may be under way)
  }
  if (comm != nullptr) {
    EndingScope ended{*box};
    c10::cuda::CUDAGuard g(dev());
    if (clean) clean = finalize(comm, deadline);
    if (clean) {
      FASTCOMM_GPU_CHECK_COMM(ncclCommDestroy(comm), comm);  // local: finalize did the rest
    } else {
      FASTCOMM_GPU_CHECK(ncclCommAbort(comm));
    }
  }
  if (p) try_settle(p);
  bool opened;
  {
    std::lock_guard<std::mutex> lk(box->mu);
    opened = box->opened;
  }
  std::lock_guard<std::mutex> lk(mu_);
  comms_.erase(box.get());
  // The first contact's stream drained with the communicator (an opener still running keeps it).
  if (box->blocking && opened) free_streams_.push_back(box->warm_stream);
}

void CudaRuntime::group_start() {
  if (tl_group.failed) tl_group = GroupState{};  // the caller dropped a group that failed
  FASTCOMM_GPU_CHECK(ncclGroupStart());
  if (tl_group.depth++ == 0) {
    tl_group.comms.clear();
    tl_group.streams.clear();
  }
}

void CudaRuntime::group_end() {
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

void CudaRuntime::send(const void* buf, size_t bytes, int peer, Comm c, Stream s) {
  auto box = enter(c, cs(s), "send");
  issued(box, cs(s), [&] {
    return FASTCOMM_GPU_CHECK_COMM(ncclSend(buf, bytes, ncclUint8, peer, box->comm, cs(s)), box->comm);
  });
}

void CudaRuntime::recv(void* buf, size_t bytes, int peer, Comm c, Stream s) {
  auto box = enter(c, cs(s), "recv");
  issued(box, cs(s), [&] {
    return FASTCOMM_GPU_CHECK_COMM(ncclRecv(buf, bytes, ncclUint8, peer, box->comm, cs(s)), box->comm);
  });
}

void CudaRuntime::all_reduce(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op, Comm c,
                Stream s) {
  const ncclDataType_t dt = nccl_dtype(dtype);
  const ncclRedOp_t ro = nccl_op(op, dtype);
  auto box = enter(c, cs(s), "all_reduce");
  issued(box, cs(s), [&] {
    return FASTCOMM_GPU_CHECK_COMM(ncclAllReduce(in, out, (size_t)count, dt, ro, box->comm, cs(s)), box->comm);
  });
  if (op == RedOp::AVG) divide_sum(box, out, count, dtype, cs(s));
}

void CudaRuntime::broadcast(void* buf, size_t bytes, int root, Comm c, Stream s) {
  auto box = enter(c, cs(s), "broadcast");
  issued(box, cs(s), [&] {
    return FASTCOMM_GPU_CHECK_COMM(ncclBroadcast(buf, buf, bytes, ncclUint8, root, box->comm, cs(s)), box->comm);
  });
}

void CudaRuntime::all_gather(const void* in, void* out, size_t bytes, Comm c, Stream s) {
  auto box = enter(c, cs(s), "all_gather");
  issued(box, cs(s), [&] {
    return FASTCOMM_GPU_CHECK_COMM(ncclAllGather(in, out, bytes, ncclUint8, box->comm, cs(s)), box->comm);
  });
}

void CudaRuntime::reduce_scatter(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op, Comm c,
                    Stream s) {
  const ncclDataType_t dt = nccl_dtype(dtype);
  const ncclRedOp_t ro = nccl_op(op, dtype);
  auto box = enter(c, cs(s), "reduce_scatter");
  issued(box, cs(s), [&] {
    return FASTCOMM_GPU_CHECK_COMM(ncclReduceScatter(in, out, (size_t)count, dt, ro, box->comm, cs(s)),
                                   box->comm);
  });
  if (op == RedOp::AVG) divide_sum(box, out, count, dtype, cs(s));
}


// AVG is a sum divided once at the end, as the fold does: ncclAvg multiplies every input by
// 1/n before summing, which rounds differently (an exact 0 can come out nonzero). The kernel
// must follow NCCL's on the stream: while NCCL is still enqueueing its call (a first contact
// waits for the peers), the launch is deferred like a record, never waited for here.
void CudaRuntime::divide_sum(const std::shared_ptr<CommBox>& box, void* out, int64_t count, c10::ScalarType dtype,
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

std::shared_ptr<CommBox> CudaRuntime::box_of(Comm c) {
  TORCH_INTERNAL_ASSERT(c != nullptr, "fastcomm: null communicator");
  return static_cast<CommBox*>(c)->shared_from_this();
}

// A communicator about to take a call: whatever NCCL is still enqueueing on it or on `s`
// must be done first (NCCL refuses a call on a communicator in progress, and the stream
// order of `s` needs that work ahead of the new one).
std::shared_ptr<CommBox> CudaRuntime::enter(Comm c, cudaStream_t s, const char* what) {
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
void CudaRuntime::issued(const std::shared_ptr<CommBox>& box, cudaStream_t s, F&& call) {
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

void CudaRuntime::abandon_group() {
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

void CudaRuntime::add_pending(std::vector<std::shared_ptr<CommBox>> comms, std::vector<cudaStream_t> streams) {
  auto p = std::make_shared<Pending>();
  p->comms = std::move(comms);
  p->streams = std::move(streams);
  std::lock_guard<std::mutex> lk(mu_);
  for (cudaStream_t s : p->streams) stream_pending_[s] = p;
  for (auto& b : p->comms) b->pending = p;
}

// Whether NCCL has no job in flight on the communicator (done, failed or aborted).
bool CudaRuntime::quiet(CommBox& b) {
  std::lock_guard<std::mutex> lk(b.mu);
  if (b.comm == nullptr) return !b.ending;
  ncclResult_t st = ncclSuccess;
  FASTCOMM_GPU_CHECK_COMM(ncclCommGetAsyncError(b.comm, &st), b.comm);  // also joins NCCL's finished job
  return st != ncclInProgress;
}

// Non-blocking: whether the pending work is on its streams now (then its deferred calls ran).
bool CudaRuntime::try_settle(const std::shared_ptr<Pending>& p) {
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

void CudaRuntime::finish_locked(Pending& p) {
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

bool CudaRuntime::wait_settled(const std::shared_ptr<Pending>& p, Clock::time_point deadline) {
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

void CudaRuntime::settle_blocking(const std::shared_ptr<Pending>& p, const char* what) {
  if (wait_settled(p, Clock::now() + limit_)) return;
  throw_comm_error(std::string("fastcomm: ") + what + ": NCCL did not finish enqueueing earlier work within " +
                   std::to_string(limit_.count()) +
                   " ms (its first contact with a peer waits for the peer to issue the matching work)");
}

void CudaRuntime::settle_stream(cudaStream_t s, const char* what) {
  std::shared_ptr<Pending> p;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = stream_pending_.find(s);
    if (it == stream_pending_.end()) return;
    p = it->second;
  }
  settle_blocking(p, what);
}

void CudaRuntime::settle_event(cudaEvent_t e, const char* what) {
  std::shared_ptr<Pending> p;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = event_pending_.find(e);
    if (it == event_pending_.end()) return;
    p = it->second;
  }
  settle_blocking(p, what);
}

void CudaRuntime::drop_deferred_record_locked(cudaEvent_t e) {
  auto it = event_pending_.find(e);
  if (it == event_pending_.end()) return;
  auto& ops = it->second->ops;
  ops.erase(std::remove_if(ops.begin(), ops.end(), [e](const Pending::Op& op) { return op.event == e; }),
            ops.end());
  event_pending_.erase(it);
}

// ncclCommFinalize (non-blocking: flushes, then NCCL's thread frees what is shared) polled
// until done; false if it failed or the deadline passed.
bool CudaRuntime::finalize(ncclComm_t comm, Clock::time_point deadline) {
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

}  // namespace cudart
}  // namespace device
}  // namespace fastcomm
