// The CPU fake of the device runtime (device/runtime.h): the CUDA stream/event calls and the NCCL
// calls the device engine uses, with their semantics, on the host, so CI runs the device engine's
// whole logic without a GPU.
//
// - "Device" memory is host memory (CPU tensors).
// - A stream is a worker thread running its tasks in FIFO order. current_stream() is the caller's
//   stream (torch's current CUDA stream): a worker too, so the host runs ahead of it as it runs
//   ahead of a GPU, and an event recorded behind queued work is not complete.
// - An event's record is a marker task; query/synchronize/wait look at the marker of the latest
//   record at the time of the call (a wait enqueued earlier keeps waiting for its own marker).
// - A communicator is a set of abstract-namespace Unix sockets, one per pair of ranks, made by a
//   progress thread per communicator (bootstrap: the lower rank connects to the higher one's
//   listener, named after the id and the rank, and says hello; the communicator is ready once it
//   is connected to every other rank, that is once every rank has called comm_init). The same
//   thread drains incoming frames into in-memory queues, so a sender's write never waits for the
//   peer's stream.
// - Sends and receives with each peer are numbered in issue order (at the call, on the host) and
//   matched by number. A receive, run on its stream, takes its message, copies it out and acks it;
//   the send's task completes only when that ack arrives, so a receive that is never posted leaves
//   the sender's stream stuck, as in NCCL. Collectives are made of the same sends and receives.
// - A failure seen later (a size mismatch; a peer gone, once an operation needs it, as NCCL over
//   sockets sees it) sets comm_state to kFailed; the work waiting on the communicator stays
//   stuck, as NCCL's kernels do, until comm_abort (or comm_destroy), after which it completes
//   without moving data and the streams behind it drain. A peer's communicator destroyed or
//   aborted counts as its connection lost.
// - Every call is thread-safe; group state is per calling thread. Nothing is process-global, so
//   several Runtimes in one process can be the ranks of a communicator (the unit tests do that).
// - Destroying the Runtime aborts its live communicators (their peers see the connection lost),
//   then drains and joins its streams; a communicator's sockets close when the last queued work
//   holding it has run.
// - NCCL's dtype set: its reductions refuse int16 (the fold takes it).
// - A non-blocking NCCL launch starts a thread, as ncclGroupEnd does (counted: debug
//   "launch_threads"); until it ends (kEnqueueMicros, debug "enqueue_us") the communicators it
//   used say kPending and refuse calls, as ncclInProgress does. With `blocking_pairs`, two-rank
//   communicators are in NCCL's blocking mode: their launches enqueue on the calling thread.
// - CUDA graphs (fake_graph.h): begin_capture(s) (or debug("begin_capture", mode) on the
//   caller's stream) makes the work enqueued on s kept as graph nodes instead of run; a stream
//   that waits on an event recorded in the capture joins it; end_capture refuses a capture
//   with a joined stream whose last work is not waited on again by the capture (CUDA's
//   "unjoined"), and one that was invalidated. graph_launch runs the nodes on the launching
//   stream, stream by stream in order, records and waits ordering them, a communicator's sends
//   and receives numbered anew at each replay, as NCCL's kernels match anew. Refused as CUDA
//   refuses them: a query or synchronize of an event whose latest record was captured; a
//   captured stream's wait on an event recorded outside the capture; an allocation (scratch)
//   for a captured stream or by the capturing thread; and, in the global mode from a thread not
//   in the relaxed mode (in the thread-local mode from the capturing thread), any event query,
//   synchronize or allocation, which also invalidates the capture; and a graph launched into a
//   capture (so only work recorded anew goes into a larger graph). A host_call is a task of its
//   stream (a host node under capture). debug("lane_stagger", ms) staggers the start of a
//   launch's forked streams, so a test picks which branch reaches the device first.
// - Abort races a transfer that already has its data: a receive whose message has arrived still
//   writes it after comm_abort. Scratch memory is poisoned when freed, and a stream that writes
//   into freed scratch is counted (debug("late_writes")): memory must outlive every stream that
//   may still write it.
// - Residency: with debug("resident_limit", n), at most n communicator kernels run at once; one
//   past them waits, moving nothing, until a resident one ends (fake_streams.h, Residency), so
//   kernels that cannot all be resident deadlock as they can on a GPU; a graph's kernels too.
// - Same-host blocks (fake_ipc.h) are /dev/shm segments both processes map; a flag wait blocks
//   its stream on the shared word, so only the flags order one process's work after another's.
#include "device/fake_runtime_impl.h"

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>

#include "algorithms/reduce.h"
#include "common/errors.h"

namespace fastcomm {
namespace device {
namespace fake {

// ------------------------------------------------------------------------------------------
// Folds

void check_reduction(const char* call, c10::ScalarType dtype, RedOp op) {
  if (!dtype_supported(dtype)) call_error(call, std::string("unsupported dtype ") + c10::toString(dtype));
  if (op != RedOp::SUM && op != RedOp::AVG && op != RedOp::PRODUCT && op != RedOp::MIN && op != RedOp::MAX)
    call_error(call, "unsupported reduce op " + std::to_string(static_cast<int>(op)));
  if (op == RedOp::AVG && !c10::isFloatingType(dtype))
    call_error(call, std::string("AVG needs a floating dtype, got ") + c10::toString(dtype));
}

namespace {

bool overlaps(const void* a, const void* b, size_t n) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return n != 0 && pa < pb + n && pb < pa + n;
}

}  // namespace

// dst = parts[0] (op) parts[1] (op) ... (op) parts[n-1], folded left to right (so every rank that
// folds the same contributions gets bit-identical results); AVG divides by n at the end. MIN and
// MAX propagate NaN (the shared kernels of algorithms/reduce.cpp do, as torch does). Any part may
// alias dst.
void fold_parts(void* dst, std::vector<const void*> parts, int64_t numel, c10::ScalarType dtype, RedOp op) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (bytes == 0 || parts.empty()) return;
  const int n = static_cast<int>(parts.size());
  // A later part that aliases dst would be overwritten by the first copy: take it aside.
  std::vector<std::unique_ptr<uint8_t[]>> aside;
  for (int i = 1; i < n; ++i) {
    if (overlaps(parts[i], dst, bytes)) {
      aside.emplace_back(new uint8_t[bytes]);
      std::memcpy(aside.back().get(), parts[i], bytes);
      parts[i] = aside.back().get();
    }
  }
  if (parts[0] != dst) std::memmove(dst, parts[0], bytes);
  const RedOp k = op == RedOp::AVG ? RedOp::SUM : op;
  for (int i = 1; i < n; ++i) reduce_into(dst, parts[i], static_cast<size_t>(numel), dtype, k);
  if (op == RedOp::AVG) divide_by(dst, static_cast<size_t>(numel), dtype, n);
}

namespace {

void fold_job(const FoldJob& j) {
  const size_t bytes = static_cast<size_t>(j.numel) * c10::elementSize(j.dtype);
  std::vector<const void*> parts(j.n);
  const auto* scratch = static_cast<const uint8_t*>(j.scratch);
  for (int i = 0, k = 0; i < j.n; ++i) parts[i] = i == j.me ? j.own : scratch + static_cast<size_t>(k++) * bytes;
  fold_parts(j.dst, std::move(parts), j.numel, j.dtype, j.op);
}

}  // namespace

// ------------------------------------------------------------------------------------------
// The runtime

FakeRuntime::~FakeRuntime() {
  std::vector<std::shared_ptr<CommImpl>> comms;
  std::vector<std::shared_ptr<StreamCore>> streams;
  std::unordered_map<void*, std::unique_ptr<EventImpl>> events;
  std::unordered_map<std::thread::id, Group> groups;  // never ended: dropped, not launched
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& kv : comms_) comms.push_back(kv.second);
    for (auto& kv : streams_) streams.push_back(kv.second);
    comms_.clear();
    streams_.clear();
    events.swap(events_);
    groups.swap(groups_);
  }
  // Live communicators are aborted (their peers see the connection lost), so the work stuck
  // on them completes and the streams drain.
  for (auto& c : comms) c->abort();
  for (auto& c : comms) c->shutdown();
  for (auto& s : streams) s->stop();
  for (auto& m : holds_) m->set();
  if (abort_hold_) abort_hold_->set();
  caller_->stop();
  graphs_.clear();  // after the streams that may still replay them
  user_graphs_.clear();
}

Stream FakeRuntime::new_stream() {
  // "fail_new_streams": a runtime that cannot make another stream (a sticky CUDA error does that).
  for (int64_t n = failing_streams_.load(); n > 0;)
    if (failing_streams_.compare_exchange_weak(n, n - 1)) throw std::runtime_error("fake: no stream made (a test's fault)");
  auto s = std::make_shared<StreamCore>(false);
  std::lock_guard<std::mutex> lk(mu_);
  streams_[s.get()] = s;
  return s.get();
}

void FakeRuntime::destroy_stream(Stream s) {
  std::shared_ptr<StreamCore> core;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = streams_.find(s);
    if (it == streams_.end())
      call_error("destroy_stream", s == caller_.get() ? "the caller's stream is not owned" : "unknown stream");
    core = std::move(it->second);
    streams_.erase(it);
  }
  core->stop();  // runs what is left (work on aborted communicators completes)
}

bool FakeRuntime::capturing(Stream s) {
  Capture& c = capture();
  std::lock_guard<std::mutex> lk(c.mu);
  return c.lane_of(s) >= 0;
}

void FakeRuntime::capture_keep(Stream s, std::shared_ptr<void> ref) {
  auto st = stream_of(s, "capture_keep");
  if (!capturing(s)) call_error("capture_keep", "the stream is not being captured");
  capture_hold(st.get(), std::move(ref));
}

void* FakeRuntime::end_capture(Stream s) {
  auto g = finish_capture(stream_of(s, "end_capture"));
  FakeGraph* p = g.get();
  std::lock_guard<std::mutex> lk(mu_);
  graphs_[p] = std::move(g);
  return p;
}

void FakeRuntime::graph_launch(void* graph, Stream s) {
  std::shared_ptr<FakeGraph> g;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = graphs_.find(graph);
    if (it == graphs_.end()) call_error("graph_launch", "unknown graph");
    g = it->second;
  }
  auto st = stream_of(s, "graph_launch");
  refuse_launch_under_capture(st.get());
  run_on(*st, [g] { g->run(); });
}

void FakeRuntime::host_call(Stream s, void (*fn)(void*), void* arg) {
  run_on(*stream_of(s, "host_call"), [fn, arg] { fn(arg); });
}

void FakeRuntime::graph_destroy(void* graph) {
  std::shared_ptr<FakeGraph> g;  // a launch still queued keeps it
  std::lock_guard<std::mutex> lk(mu_);
  auto it = graphs_.find(graph);
  if (it == graphs_.end()) call_error("graph_destroy", "unknown graph");
  g = std::move(it->second);
  graphs_.erase(it);
}

Event FakeRuntime::new_event() {
  auto e = std::make_unique<EventImpl>();
  EventImpl* p = e.get();
  std::lock_guard<std::mutex> lk(mu_);
  events_[p] = std::move(e);
  return p;
}

void FakeRuntime::destroy_event(Event e) {
  std::unique_ptr<EventImpl> gone;  // pending markers live on in their stream tasks
  std::lock_guard<std::mutex> lk(mu_);
  auto it = events_.find(e);
  if (it == events_.end()) call_error("destroy_event", "unknown event");
  gone = std::move(it->second);
  events_.erase(it);
}

void FakeRuntime::record(Event e, Stream s) {
  EventImpl* ev = event_of(e, "record");
  auto st = stream_of(s, "record");
  if (capture_record(*ev, st.get())) return;
  auto m = std::make_shared<Marker>();
  {
    std::lock_guard<std::mutex> lk(ev->mu);
    ev->latest = m;
    ev->cap = nullptr;
  }
  run_on(*st, [m] { m->set(); });
}

void FakeRuntime::wait(Stream s, Event e) {
  EventImpl* ev = event_of(e, "wait");
  auto st = stream_of(s, "wait");
  std::shared_ptr<Marker> m;
  if (capture_wait(*ev, st.get(), &m)) return;
  if (!m) return;  // never recorded: complete
  std::function<void()> f = [m] { m->wait(); };
  if (st->host || !st->push(f)) f();
}

State FakeRuntime::query(Event e) {
  EventImpl* ev = event_of(e, "query");
  refuse_captured(*ev, "query");
  unsafe_call("query");
  auto m = ev->get();
  return !m || m->ready() ? State::kReady : State::kPending;
}

void FakeRuntime::synchronize(Event e) {
  EventImpl* ev = event_of(e, "synchronize");
  refuse_captured(*ev, "synchronize");
  unsafe_call("synchronize");
  auto m = ev->get();
  if (m) m->wait();
}

namespace {
// What a copy and a fold do when their stream reaches them (copy_flag and fold_flag then store
// their flag).
void run_copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  quarantine().check(dst, bytes);
  std::memmove(dst, src, bytes);
}
void run_fold(const FoldJob& j) {
  quarantine().check(j.dst, static_cast<size_t>(j.numel) * c10::elementSize(j.dtype));
  fold_job(j);
}
}  // namespace

void FakeRuntime::copy(void* dst, const void* src, size_t bytes, Stream s) {
  auto st = stream_of(s, "copy");
  if (bytes == 0) return;
  if (!dst || !src) call_error("copy", "null pointer");
  ++work_entries_;
  run_on(*st, [=] { run_copy(dst, src, bytes); });
}

namespace {
void check_fold_job(const char* call, const FoldJob& j) {
  check_reduction(call, j.dtype, j.op);
  if (j.n < 1 || j.me < 0 || j.me >= j.n || j.numel < 0)
    call_error(call, "bad job (n " + std::to_string(j.n) + ", me " + std::to_string(j.me) + ", numel " +
                         std::to_string(j.numel) + ")");
  if (j.numel > 0 && (!j.dst || !j.own || (j.n > 1 && !j.scratch))) call_error(call, "null pointer");
}
}  // namespace

void FakeRuntime::fold(const FoldJob* jobs, int count, Stream s) {
  auto st = stream_of(s, "fold");
  if (count < 0 || (count > 0 && !jobs)) call_error("fold", "bad job list");
  std::vector<FoldJob> js(jobs, jobs + count);
  for (const auto& j : js) check_fold_job("fold", j);
  if (count > 0) ++work_entries_;
  run_on(*st, [js = std::move(js)] {
    for (const auto& j : js) run_fold(j);
  });
}

at::Tensor FakeRuntime::scratch(int64_t numel, const at::Tensor& like, Stream s) {
  auto st = stream_of(s, "scratch");
  if (numel < 0) call_error("scratch", "negative size");
  if (capturing(s))
    call_error("scratch", "an allocation for a stream under capture (memory a graph uses is allocated before "
                          "the capture; cudaErrorStreamCaptureUnsupported)");
  unsafe_call("scratch (an allocation)");
  const size_t bytes = static_cast<size_t>(numel) * like.element_size();
  void* p = nullptr;
  if (::posix_memalign(&p, 64, std::max<size_t>(bytes, 1)) != 0 || !p)
    call_error("scratch", "out of memory (" + std::to_string(bytes) + " bytes)");
  // The memory is freed only after the work enqueued on `s` before the tensor died (the
  // caching allocator's reuse rule on a side stream).
  std::weak_ptr<StreamCore> weak;
  if (!st->host) weak = st;
  auto deleter = [weak, bytes](void* ptr) {
    auto core = weak.lock();
    std::function<void()> f = [ptr, bytes] { quarantine().add(ptr, std::max<size_t>(bytes, 1)); };
    if (!core || !core->push(f)) f();
  };
  return at::from_blob(p, {numel}, deleter, like.options().device(at::kCPU));
}

void FakeRuntime::keep(const at::Tensor& t, Stream s) {
  auto st = stream_of(s, "keep");
  if (st->host) return;
  run_on(*st, [t] {});  // the reference goes once the work before it has run
}

bool FakeRuntime::ipc_supported() {
  // CUDA's probe allocates and registers host pages: calls a capture in the global mode refuses
  // from a thread not in the relaxed mode, and is invalidated by. So this one is.
  try {
    unsafe_call("ipc_supported (cudaMalloc, cudaHostRegister)");
  } catch (const std::exception& e) {
    TORCH_WARN("fastcomm: same-host device channels over IPC are off (device channels use NCCL): ", e.what());
    return false;
  }
  return true;
}

void* FakeRuntime::ipc_create(size_t bytes, int nflags, IpcHandle* h, IpcBlock* b, bool host) {
  unsafe_call("ipc_create (cudaMalloc, cudaHostRegister)");
  return fake::ipc_create(bytes, nflags, h, b, host);
}

// Under capture the early-wait check is off: a graph's waits point at the peer's run, which it
// launches when it replays its own graph (the member contract, docs/design.md "CUDA graphs").
void FakeRuntime::flag_write(uint32_t* flag, uint32_t value, Stream s) {
  if (!capturing(s)) note_write(flag, value);
  ++work_entries_;
  run_on(*stream_of(s, "flag_write"), [flag, value] { flag_store(flag, value); });
}

void FakeRuntime::flag_wait(Stream s, const uint32_t* flag, uint32_t value) {
  if (!capturing(s)) note_wait(flag, value);
  ++work_entries_;
  run_on(*stream_of(s, "flag_wait"), [flag, value] { flag_block(flag, value); });
}

void FakeRuntime::copy_flag(void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value, Stream s) {
  auto st = stream_of(s, "copy_flag");
  if (bytes > 0 && (!dst || !src)) call_error("copy_flag", "null pointer");
  if (!capturing(s)) note_write(flag, value);
  ++work_entries_;
  run_on(*st, [=] {
    run_copy(dst, src, bytes);
    flag_store(flag, value);
  });
}

void FakeRuntime::fold_flag(const FoldJob& j, uint32_t* flag, uint32_t value, Stream s) {
  auto st = stream_of(s, "fold_flag");
  check_fold_job("fold_flag", j);
  if (!capturing(s)) note_write(flag, value);
  ++work_entries_;
  run_on(*st, [j, flag, value] {
    run_fold(j);
    flag_store(flag, value);
  });
}

void FakeRuntime::sticky_check(const char* call) const {
  if (sticky_.load()) call_error(call, "a sticky device error (a test's fault: \"sticky_error\")");
}

std::shared_ptr<StreamCore> FakeRuntime::stream_of(Stream s, const char* call) {
  note_callback_call(call);
  sticky_check(call);
  if (s == caller_.get()) return caller_;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = streams_.find(s);
  if (it == streams_.end()) call_error(call, "unknown stream");
  return it->second;
}

EventImpl* FakeRuntime::event_of(Event e, const char* call) {
  note_callback_call(call);
  sticky_check(call);
  std::lock_guard<std::mutex> lk(mu_);
  auto it = events_.find(e);
  if (it == events_.end()) call_error(call, "unknown event");
  return it->second.get();
}

}  // namespace fake

int64_t Runtime::debug(const std::string& what, int64_t) {
  TORCH_CHECK_VALUE(false, "fastcomm: the ", name(), " device runtime has no test hook '", what, "'");
}

std::unique_ptr<Runtime> make_fake_runtime(bool blocking_pairs) {
  return std::make_unique<fake::FakeRuntime>(blocking_pairs);
}

}  // namespace device
}  // namespace fastcomm
