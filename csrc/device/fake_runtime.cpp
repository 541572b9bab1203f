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
//   stream (a host node under capture).
// - Abort races a transfer that already has its data: a receive whose message has arrived still
//   writes it after comm_abort. Scratch memory is poisoned when freed, and a stream that writes
//   into freed scratch is counted (debug("late_writes")): memory must outlive every stream that
//   may still write it.
// - Residency: with debug("resident_limit", n), at most n communicator kernels run at once; one
//   past them waits, moving nothing, until a resident one ends (fake_streams.h, Residency), so
//   kernels that cannot all be resident deadlock as they can on a GPU.
// - Same-host blocks (fake_ipc.h) are /dev/shm segments both processes map; a flag wait blocks
//   its stream on the shared word, so only the flags order one process's work after another's.
#include "device/runtime.h"

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "algorithms/reduce.h"
#include "common/errors.h"

#include "device/fake_comm.h"
#include "device/fake_graph.h"
#include "device/fake_ipc.h"
#include "device/fake_streams.h"

namespace fastcomm {
namespace device {
namespace {

using namespace fake;

// ------------------------------------------------------------------------------------------
// Folds

void check_reduction(const char* call, c10::ScalarType dtype, RedOp op) {
  if (!dtype_supported(dtype)) call_error(call, std::string("unsupported dtype ") + c10::toString(dtype));
  if (op != RedOp::SUM && op != RedOp::AVG && op != RedOp::PRODUCT && op != RedOp::MIN && op != RedOp::MAX)
    call_error(call, "unsupported reduce op " + std::to_string(static_cast<int>(op)));
  if (op == RedOp::AVG && !c10::isFloatingType(dtype))
    call_error(call, std::string("AVG needs a floating dtype, got ") + c10::toString(dtype));
}

// NCCL's reductions take no int16 (ncclDataType_t has none); the fold does.
void check_nccl_reduction(const char* call, c10::ScalarType dtype, RedOp op) {
  if (dtype == c10::kShort) call_error(call, "NCCL has no int16 dtype (ncclInvalidArgument)");
  check_reduction(call, dtype, op);
}

// How long a launch keeps its communicators busy (ncclInProgress) by default.
constexpr int64_t kEnqueueMicros = 20;

bool overlaps(const void* a, const void* b, size_t n) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return n != 0 && pa < pb + n && pb < pa + n;
}

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

void fold_job(const FoldJob& j) {
  const size_t bytes = static_cast<size_t>(j.numel) * c10::elementSize(j.dtype);
  std::vector<const void*> parts(j.n);
  const auto* scratch = static_cast<const uint8_t*>(j.scratch);
  for (int i = 0, k = 0; i < j.n; ++i) parts[i] = i == j.me ? j.own : scratch + static_cast<size_t>(k++) * bytes;
  fold_parts(j.dst, std::move(parts), j.numel, j.dtype, j.op);
}

// ------------------------------------------------------------------------------------------
// The runtime

class FakeRuntime final : public Runtime {
  struct Group {
    int depth = 0;
    std::vector<std::pair<std::shared_ptr<StreamCore>, std::vector<Op>>> work;  // by stream, in first-use order
  };

 public:
  explicit FakeRuntime(bool blocking_pairs)
      : caller_(std::make_shared<StreamCore>(false)), blocking_pairs_(blocking_pairs) {}

  ~FakeRuntime() override {
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

  const char* name() const override { return "fake"; }
  int device() const override { return 0; }

  Stream new_stream() override {
    auto s = std::make_shared<StreamCore>(false);
    std::lock_guard<std::mutex> lk(mu_);
    streams_[s.get()] = s;
    return s.get();
  }

  void destroy_stream(Stream s) override {
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

  Stream current_stream() override { return caller_.get(); }
  bool capturing(Stream s) override {
    Capture& c = capture();
    std::lock_guard<std::mutex> lk(c.mu);
    return c.lane_of(s) >= 0;
  }

  void begin_capture(Stream s) override { start_capture(stream_of(s, "begin_capture"), false); }

  void* end_capture(Stream s) override {
    auto g = finish_capture(stream_of(s, "end_capture"));
    FakeGraph* p = g.get();
    std::lock_guard<std::mutex> lk(mu_);
    graphs_[p] = std::move(g);
    return p;
  }

  void graph_launch(void* graph, Stream s) override {
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

  void host_call(Stream s, void (*fn)(void*), void* arg) override {
    run_on(*stream_of(s, "host_call"), [fn, arg] { fn(arg); });
  }

  void graph_destroy(void* graph) override {
    std::shared_ptr<FakeGraph> g;  // a launch still queued keeps it
    std::lock_guard<std::mutex> lk(mu_);
    auto it = graphs_.find(graph);
    if (it == graphs_.end()) call_error("graph_destroy", "unknown graph");
    g = std::move(it->second);
    graphs_.erase(it);
  }
  void relax_capture_mode() override { tl_relaxed = true; }

  // Test hooks: "spin" queues `arg` ms of busy work on the caller's stream (a long kernel),
  // "hold" one that runs until "release"; "abort_hold" makes comm_abort block until "abort_release";
  // "begin_capture" captures the caller's stream (arg 0: the global mode, 1: thread-local) and
  // "end_capture" ends it (1: the graph is valid, 0: it was invalidated; with arg 1 the graph is
  // kept and its id returned, for "graph_launch" on the caller's stream and "graph_destroy", as
  // torch.cuda.graph's CUDAGraph would be); "late_writes" counts
  // writes into freed scratch; "enqueue_us" sets how long a launch keeps its communicators busy.
  int64_t debug(const std::string& what, int64_t arg) override {
    if (what == "spin") {
      run_on(*caller_, [arg] { std::this_thread::sleep_for(std::chrono::milliseconds(arg)); });
      return 0;
    }
    if (what == "hold") {  // a kernel that runs until "release"
      auto m = std::make_shared<Marker>();
      {
        std::lock_guard<std::mutex> lk(mu_);
        holds_.push_back(m);
      }
      run_on(*caller_, [m] { m->wait(); });
      return 0;
    }
    if (what == "release") {
      std::vector<std::shared_ptr<Marker>> held;
      {
        std::lock_guard<std::mutex> lk(mu_);
        held.swap(holds_);
      }
      for (auto& m : held) m->set();
      return (int64_t)held.size();
    }
    if (what == "begin_capture") {
      start_capture(caller_, arg == 0);
      return 0;
    }
    if (what == "end_capture") {  // 0 where the capture was refused; arg 1 keeps the graph: its id
      std::shared_ptr<FakeGraph> g;
      try {
        g = finish_capture(caller_);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fastcomm fake runtime: %s\n", e.what());
        return 0;
      }
      if (arg != 1) return 1;
      std::lock_guard<std::mutex> lk(mu_);
      user_graphs_.push_back(std::move(g));
      return (int64_t)user_graphs_.size();
    }
    if (what == "graph_launch" || what == "graph_destroy") {  // a graph kept by end_capture, by id
      std::shared_ptr<FakeGraph> g;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (arg < 1 || arg > (int64_t)user_graphs_.size() || !user_graphs_[(size_t)arg - 1])
          call_error(what.c_str(), "no graph " + std::to_string(arg));
        g = user_graphs_[(size_t)arg - 1];
        if (what == "graph_destroy") user_graphs_[(size_t)arg - 1] = nullptr;  // a queued launch keeps it
      }
      if (what == "graph_launch") {
        refuse_launch_under_capture(caller_.get());
        run_on(*caller_, [g] { g->run(); });
      }
      return 0;
    }
    if (what == "late_writes") return quarantine().late_writes.load();
    if (what == "ipc_blocks") return fake::ipc_blocks();
    if (what == "fake_device" || what == "peer_access") {  // links made from now on (fake_ipc.h)
      if (what == "fake_device") fake::set_device((int)arg);
      else fake::set_peer_access(arg != 0);
      return 0;
    }
    if (what == "abort_hold") {  // comm_abort blocks until "abort_release"
      std::lock_guard<std::mutex> lk(mu_);
      abort_hold_ = std::make_shared<Marker>();
      return 0;
    }
    if (what == "abort_release") {
      std::shared_ptr<Marker> hold;
      {
        std::lock_guard<std::mutex> lk(mu_);
        hold.swap(abort_hold_);
      }
      if (hold) hold->set();
      return 0;
    }
    if (what == "resident_limit" || what == "resident" || what == "resident_waits") {
      std::lock_guard<std::mutex> lk(residency_->mu);
      if (what == "resident") return residency_->resident;
      if (what == "resident_waits") return residency_->waits;
      residency_->limit = arg;
      residency_->cv.notify_all();
      return 0;
    }
    if (what == "launch_threads") return launch_threads_.load();
    if (what == "enqueue_us") {
      enqueue_us_ = arg;
      return 0;
    }
    return Runtime::debug(what, arg);
  }

  Event new_event() override {
    auto e = std::make_unique<EventImpl>();
    EventImpl* p = e.get();
    std::lock_guard<std::mutex> lk(mu_);
    events_[p] = std::move(e);
    return p;
  }

  void destroy_event(Event e) override {
    std::unique_ptr<EventImpl> gone;  // pending markers live on in their stream tasks
    std::lock_guard<std::mutex> lk(mu_);
    auto it = events_.find(e);
    if (it == events_.end()) call_error("destroy_event", "unknown event");
    gone = std::move(it->second);
    events_.erase(it);
  }

  void record(Event e, Stream s) override {
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

  void wait(Stream s, Event e) override {
    EventImpl* ev = event_of(e, "wait");
    auto st = stream_of(s, "wait");
    std::shared_ptr<Marker> m;
    if (capture_wait(*ev, st.get(), &m)) return;
    if (!m) return;  // never recorded: complete
    std::function<void()> f = [m] { m->wait(); };
    if (st->host || !st->push(f)) f();
  }

  State query(Event e) override {
    EventImpl* ev = event_of(e, "query");
    refuse_captured(*ev, "query");
    unsafe_call("query");
    auto m = ev->get();
    return !m || m->ready() ? State::kReady : State::kPending;
  }

  void synchronize(Event e) override {
    EventImpl* ev = event_of(e, "synchronize");
    refuse_captured(*ev, "synchronize");
    unsafe_call("synchronize");
    auto m = ev->get();
    if (m) m->wait();
  }

  void copy(void* dst, const void* src, size_t bytes, Stream s) override {
    auto st = stream_of(s, "copy");
    if (bytes == 0) return;
    if (!dst || !src) call_error("copy", "null pointer");
    run_on(*st, [=] {
      quarantine().check(dst, bytes);
      std::memmove(dst, src, bytes);
    });
  }

  void fold(const FoldJob* jobs, int count, Stream s) override {
    auto st = stream_of(s, "fold");
    if (count < 0 || (count > 0 && !jobs)) call_error("fold", "bad job list");
    std::vector<FoldJob> js(jobs, jobs + count);
    for (const auto& j : js) {
      check_reduction("fold", j.dtype, j.op);
      if (j.n < 1 || j.me < 0 || j.me >= j.n || j.numel < 0)
        call_error("fold", "bad job (n " + std::to_string(j.n) + ", me " + std::to_string(j.me) + ", numel " +
                               std::to_string(j.numel) + ")");
      if (j.numel > 0 && (!j.dst || !j.own || (j.n > 1 && !j.scratch))) call_error("fold", "null pointer");
    }
    run_on(*st, [js = std::move(js)] {
      for (const auto& j : js) {
        quarantine().check(j.dst, static_cast<size_t>(j.numel) * c10::elementSize(j.dtype));
        fold_job(j);
      }
    });
  }

  at::Tensor scratch(int64_t numel, const at::Tensor& like, Stream s) override {
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

  void keep(const at::Tensor& t, Stream s) override {
    auto st = stream_of(s, "keep");
    if (st->host) return;
    run_on(*st, [t] {});  // the reference goes once the work before it has run
  }

  // Same-host blocks (fake_ipc.h): /dev/shm segments; a flag wait holds its stream's thread.
  bool ipc_supported() override { return true; }
  void* ipc_create(size_t bytes, int nflags, IpcHandle* h, IpcBlock* b, bool host) override {
    return fake::ipc_create(bytes, nflags, h, b, host);
  }
  bool ipc_readable(const IpcHandle& h) override { return fake::ipc_readable(h); }
  void* ipc_open(const IpcHandle& h, IpcBlock* b) override { return fake::ipc_open(h, b); }
  void ipc_close(void* token) override { fake::ipc_close(token); }
  void flag_write(uint32_t* flag, uint32_t value, Stream s) override {
    run_on(*stream_of(s, "flag_write"), [flag, value] { flag_store(flag, value); });
  }
  void flag_wait(Stream s, const uint32_t* flag, uint32_t value) override {
    run_on(*stream_of(s, "flag_wait"), [flag, value] { flag_block(flag, value); });
  }
  void flag_set(uint32_t* flag, uint32_t value) override { flag_store(flag, value); }

  UniqueId new_id() override {
    UniqueId id;
    std::random_device rd;
    for (int i = 0; i < 16; i += 4) {
      const uint32_t v = rd();
      std::memcpy(id.bytes.data() + i, &v, 4);
    }
    std::memcpy(id.bytes.data() + 16, &kMagic, 4);
    return id;
  }

  Comm comm_init(const UniqueId& id, int nranks, int rank) override {
    if (nranks < 1) call_error("comm_init", "nranks must be positive, got " + std::to_string(nranks));
    if (rank < 0 || rank >= nranks)
      call_error("comm_init", "rank " + std::to_string(rank) + " out of range for " + std::to_string(nranks) + " ranks");
    uint32_t magic;
    std::memcpy(&magic, id.bytes.data() + 16, 4);
    if (magic != kMagic) call_error("comm_init", "the id was not made by the fake runtime's new_id()");
    auto c = std::make_shared<CommImpl>(id, nranks, rank);
    c->start();
    std::lock_guard<std::mutex> lk(mu_);
    comms_[c.get()] = c;
    return c.get();
  }

  State comm_state(Comm c, std::string* why) override { return comm_of(c, "comm_state")->state(why); }

  void comm_abort(Comm c) override {
    auto comm = comm_of(c, "comm_abort");
    std::shared_ptr<Marker> hold;
    {
      std::lock_guard<std::mutex> lk(mu_);
      hold = abort_hold_;
    }
    if (hold) hold->wait();  // a slow, blocking abort (debug "abort_hold")
    comm->abort();
  }

  void comm_destroy(Comm c) override {
    std::shared_ptr<CommImpl> comm;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = comms_.find(c);
      if (it == comms_.end()) call_error("comm_destroy", "unknown communicator");
      comm = std::move(it->second);
      comms_.erase(it);
    }
    comm->shutdown();
  }

  void group_start() override {
    std::lock_guard<std::mutex> lk(mu_);
    ++groups_[std::this_thread::get_id()].depth;
  }

  void group_end() override {
    std::vector<std::pair<std::shared_ptr<StreamCore>, std::vector<Op>>> work;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = groups_.find(std::this_thread::get_id());
      if (it == groups_.end() || it->second.depth == 0) call_error("group_end", "no group_start() before it");
      if (--it->second.depth > 0) return;
      work = std::move(it->second.work);
      groups_.erase(it);
    }
    // The host stream's share runs inline: last, so the other streams already have theirs.
    std::stable_partition(work.begin(), work.end(), [](const auto& w) { return !w.first->host; });
    for (auto& w : work) launch(*w.first, std::move(w.second));
  }

  void send(const void* buf, size_t bytes, int peer, Comm c, Stream s) override {
    auto comm = usable(c, "send");
    auto st = stream_of(s, "send");
    check_peer("send", *comm, peer, "peer");
    if (bytes && !buf) call_error("send", "null buffer");
    Op op;
    op.comm = comm;
    op.sends.push_back({peer, buf, bytes, 0});
    submit(std::move(op), st);
  }

  void recv(void* buf, size_t bytes, int peer, Comm c, Stream s) override {
    auto comm = usable(c, "recv");
    auto st = stream_of(s, "recv");
    check_peer("recv", *comm, peer, "peer");
    if (bytes && !buf) call_error("recv", "null buffer");
    Op op;
    op.comm = comm;
    op.recvs.push_back({peer, buf, bytes, 0, {}});
    submit(std::move(op), st);
  }

  void all_reduce(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp redop, Comm c,
                  Stream s) override {
    auto comm = usable(c, "all_reduce");
    auto st = stream_of(s, "all_reduce");
    check_nccl_reduction("all_reduce", dtype, redop);
    if (count < 0) call_error("all_reduce", "negative count");
    if (count > 0 && (!in || !out)) call_error("all_reduce", "null buffer");
    const size_t bytes = static_cast<size_t>(count) * c10::elementSize(dtype);
    Op op;
    op.comm = comm;
    op.code = kAllReduce;
    exchange_all(*comm, op, [&](int) { return in; }, bytes);
    const int n = comm->nranks(), me = comm->rank();
    op.after_recvs = [=](Op& o) {
      std::vector<const void*> parts(n);
      for (int i = 0, k = 0; i < n; ++i) parts[i] = i == me ? in : o.recvs[k++].msg.data.get();
      quarantine().check(out, bytes);
      fold_parts(out, std::move(parts), count, dtype, redop);
    };
    submit(std::move(op), st);
  }

  void broadcast(void* buf, size_t bytes, int root, Comm c, Stream s) override {
    auto comm = usable(c, "broadcast");
    auto st = stream_of(s, "broadcast");
    check_peer("broadcast", *comm, root, "root");
    if (bytes && !buf) call_error("broadcast", "null buffer");
    Op op;
    op.comm = comm;
    op.code = kBroadcast;
    if (comm->rank() == root) {
      for (int p = 0; p < comm->nranks(); ++p)
        if (p != root) op.sends.push_back({p, buf, bytes, 0});
    } else {
      op.recvs.push_back({root, buf, bytes, 0, {}});
    }
    submit(std::move(op), st);
  }

  void all_gather(const void* in, void* out, size_t bytes, Comm c, Stream s) override {
    auto comm = usable(c, "all_gather");
    auto st = stream_of(s, "all_gather");
    if (bytes && (!in || !out)) call_error("all_gather", "null buffer");
    const int me = comm->rank();
    auto* o = static_cast<uint8_t*>(out);
    Op op;
    op.comm = comm;
    op.code = kAllGather;
    exchange_all(*comm, op, [&](int) { return in; }, bytes);
    int k = 0;
    for (int p = 0; p < comm->nranks(); ++p)
      if (p != me) op.recvs[k++].dst = o + static_cast<size_t>(p) * bytes;
    op.before_recvs = [=](Op&) {
      if (bytes) std::memmove(o + static_cast<size_t>(me) * bytes, in, bytes);
    };
    submit(std::move(op), st);
  }

  void reduce_scatter(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp redop, Comm c,
                      Stream s) override {
    auto comm = usable(c, "reduce_scatter");
    auto st = stream_of(s, "reduce_scatter");
    check_nccl_reduction("reduce_scatter", dtype, redop);
    if (count < 0) call_error("reduce_scatter", "negative count");
    if (count > 0 && (!in || !out)) call_error("reduce_scatter", "null buffer");
    const size_t bytes = static_cast<size_t>(count) * c10::elementSize(dtype);
    const auto* blocks = static_cast<const uint8_t*>(in);
    Op op;
    op.comm = comm;
    op.code = kReduceScatter;
    exchange_all(*comm, op, [&](int p) { return blocks + static_cast<size_t>(p) * bytes; }, bytes);
    const int n = comm->nranks(), me = comm->rank();
    op.after_recvs = [=](Op& o) {
      std::vector<const void*> parts(n);
      for (int i = 0, k = 0; i < n; ++i)
        parts[i] = i == me ? blocks + static_cast<size_t>(me) * bytes : o.recvs[k++].msg.data.get();
      fold_parts(out, std::move(parts), count, dtype, redop);
    };
    submit(std::move(op), st);
  }

 private:
  std::shared_ptr<StreamCore> stream_of(Stream s, const char* call) {
    if (s == caller_.get()) return caller_;
    std::lock_guard<std::mutex> lk(mu_);
    auto it = streams_.find(s);
    if (it == streams_.end()) call_error(call, "unknown stream");
    return it->second;
  }

  EventImpl* event_of(Event e, const char* call) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = events_.find(e);
    if (it == events_.end()) call_error(call, "unknown event");
    return it->second.get();
  }

  std::shared_ptr<CommImpl> comm_of(Comm c, const char* call) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = comms_.find(c);
    if (it == comms_.end()) call_error(call, "unknown communicator");
    return it->second;
  }

  // A communicator a new operation may be issued on.
  std::shared_ptr<CommImpl> usable(Comm c, const char* call) {
    auto comm = comm_of(c, call);
    if (comm->busy())
      call_error(call, "the communicator is still enqueueing its last launch (ncclInProgress): wait until "
                       "comm_state() is no longer kPending");
    return comm;
  }

  static void check_peer(const char* call, const CommImpl& c, int peer, const char* what) {
    if (peer < 0 || peer >= c.nranks())
      call_error(call, std::string(what) + " " + std::to_string(peer) + " out of range for a communicator of " +
                           std::to_string(c.nranks()) + " ranks");
  }

  // One send to and one receive (kept for the fold) from every other rank, in rank order.
  template <typename Src>
  static void exchange_all(CommImpl& c, Op& op, Src src, size_t bytes) {
    for (int p = 0; p < c.nranks(); ++p) {
      if (p == c.rank()) continue;
      op.sends.push_back({p, src(p), bytes, 0});
      op.recvs.push_back({p, nullptr, bytes, 0, {}});
    }
  }

  // Issue-order numbers of the op's sends and receives with each peer: at the call, or, for a
  // captured op, at each replay.
  static void number(Op& op) {
    std::lock_guard<std::mutex> lk(op.comm->mu());
    for (auto& s : op.sends) s.seq = op.comm->take_send_number(s.peer);
    for (auto& r : op.recvs) r.seq = op.comm->take_recv_number(r.peer);
  }

  // A fresh copy of a captured op, for one replay.
  static Op replica(const Op& t) {
    Op op;
    op.comm = t.comm;
    op.code = t.code;
    op.sends = t.sends;
    for (const auto& r : t.recvs) op.recvs.push_back({r.peer, r.dst, r.bytes, 0, {}});
    op.before_recvs = t.before_recvs;
    op.after_recvs = t.after_recvs;
    number(op);
    return op;
  }

  // Into the calling thread's open group, or as a task of its own.
  void submit(Op op, const std::shared_ptr<StreamCore>& st) {
    if (capture().active.load() == 0 || !capturing(st.get())) number(op);
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = groups_.find(std::this_thread::get_id());
      if (it != groups_.end() && it->second.depth > 0) {
        auto& work = it->second.work;
        auto w = std::find_if(work.begin(), work.end(), [&](const auto& x) { return x.first == st; });
        if (w == work.end()) {
          work.emplace_back(st, std::vector<Op>{});
          w = std::prev(work.end());
        }
        w->second.push_back(std::move(op));
        return;
      }
    }
    std::vector<Op> ops;
    ops.push_back(std::move(op));
    launch(*st, std::move(ops));
  }

  void launch(StreamCore& st, std::vector<Op> ops) {
    // NCCL's non-blocking launch: ncclGroupEnd starts a thread that enqueues the group and
    // returns ncclInProgress; the communicators take no call until that thread ends. The work
    // itself goes on the stream here, so events recorded after it cover it (the real runtime
    // defers those records until NCCL's thread is done). A blocking-mode pair communicator
    // enqueues on the calling thread.
    std::vector<std::shared_ptr<CommImpl>> threaded;
    for (auto& op : ops)
      if (!launches_inline(*op.comm) && std::find(threaded.begin(), threaded.end(), op.comm) == threaded.end())
        threaded.push_back(op.comm);
    if (!threaded.empty() && enqueue_us_.load() > 0) {  // 0: usable at once (unit tests)
      for (auto& c : threaded) c->begin_launch();
      ++launch_threads_;
      const int64_t us = enqueue_us_.load();
      std::thread([threaded, us] {
        if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
        for (auto& c : threaded) c->end_launch();
      }).detach();
    }
    auto shared = std::make_shared<std::vector<Op>>(std::move(ops));
    std::function<void()> replay = [shared] {
      std::vector<Op> now;
      for (const auto& t : *shared) now.push_back(replica(t));
      run_ops(now);
    };
    if (capture_task(&st, replay)) return;
    if (st.host) {
      run_on(st, [shared] { run_ops(*shared); });
      return;
    }
    // A kernel: resident (debug "resident_limit") before it moves anything.
    auto res = residency_;
    run_on(st, [shared, res] {
      const bool slot = res->enter([&] {
        for (auto& op : *shared)
          if (op.comm->aborted()) return true;
        return false;
      });
      run_ops(*shared);
      if (slot) res->leave();
    });
  }

  std::mutex mu_;
  const std::shared_ptr<StreamCore> caller_;
  std::atomic<int64_t> enqueue_us_{kEnqueueMicros};
  std::atomic<int64_t> launch_threads_{0};  // threads non-blocking launches started (debug "launch_threads")
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
  std::vector<std::shared_ptr<FakeGraph>> user_graphs_;  // kept by debug("end_capture", 1)
};

}  // namespace

int64_t Runtime::debug(const std::string& what, int64_t) {
  TORCH_CHECK_VALUE(false, "fastcomm: the ", name(), " device runtime has no test hook '", what, "'");
}

std::unique_ptr<Runtime> make_fake_runtime(bool blocking_pairs) { return std::make_unique<FakeRuntime>(blocking_pairs); }

}  // namespace device
}  // namespace fastcomm
