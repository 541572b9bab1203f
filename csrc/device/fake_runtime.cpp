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
// - A non-blocking NCCL launch: for a while after group_end() (kEnqueueMicros) the communicators
//   it used say kPending and refuse calls, as ncclInProgress does.
// - Capture: debug("begin_capture", mode) captures the caller's stream; in the global mode
//   (0) an event query or synchronize from a thread not in the relaxed mode invalidates the
//   capture and fails, as CUDA's "potentially unsafe" calls do.
// - Abort races a transfer that already has its data: a receive whose message has arrived still
//   writes it after comm_abort. Scratch memory is poisoned when freed, and a stream that writes
//   into freed scratch is counted (debug("late_writes")): memory must outlive every stream that
//   may still write it.
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

namespace fastcomm {
namespace device {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;
using Clock = std::chrono::steady_clock;

[[noreturn]] void call_error(const char* call, const std::string& what) {
  throw_comm_error(std::string("fastcomm fake runtime: ") + call + ": " + what);
}

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
// Freed scratch and capture: process-wide, as a device's memory and CUDA's capture mode are.

// Freed scratch blocks, poisoned and kept (up to a bound) so a late write into one is seen.
struct Quarantine {
  std::mutex mu;
  std::deque<std::pair<uint8_t*, size_t>> blocks;
  size_t bytes = 0;
  std::atomic<int64_t> late_writes{0};
  static constexpr size_t kMaxBytes = size_t(64) << 20;

  void add(void* p, size_t n) {
    std::memset(p, 0xa5, n);
    std::lock_guard<std::mutex> lk(mu);
    blocks.emplace_back(static_cast<uint8_t*>(p), n);
    bytes += n;
    while (bytes > kMaxBytes && !blocks.empty()) {
      bytes -= blocks.front().second;
      ::free(blocks.front().first);
      blocks.pop_front();
    }
  }
  // A stream is about to write [p, p + n).
  void check(const void* p, size_t n) {
    if (n == 0) return;
    const auto* b = static_cast<const uint8_t*>(p);
    std::lock_guard<std::mutex> lk(mu);
    for (auto& [q, m] : blocks) {
      if (b < q + m && q < b + n) {
        ++late_writes;
        std::fprintf(stderr, "fastcomm fake runtime: a stream wrote %zu bytes into freed scratch\n", n);
        return;
      }
    }
  }
};
Quarantine& quarantine() {
  static Quarantine* q = new Quarantine();  // never destroyed: streams may write at exit
  return *q;
}

struct Capture {
  std::mutex mu;
  const void* stream = nullptr;  // the stream being captured, or null
  bool global = false;
  bool invalidated = false;
};
Capture& capture() {
  static Capture* c = new Capture();
  return *c;
}
thread_local bool tl_relaxed = false;

// A call CUDA calls potentially unsafe during a global-mode capture (an event query or sync).
void unsafe_call(const char* call) {
  if (tl_relaxed) return;
  Capture& c = capture();
  std::lock_guard<std::mutex> lk(c.mu);
  if (c.stream == nullptr || !c.global) return;
  c.invalidated = true;
  call_error(call, "operation not permitted when stream is capturing (a graph is captured in the global mode "
                   "and this thread is not in the relaxed mode); the capture is invalidated");
}

// ------------------------------------------------------------------------------------------
// Streams and events

struct StreamCore {
  const bool host;  // the host stream: its work runs at once on the calling thread
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  bool stopping = false;  // destroy_stream: drain, then end
  bool closed = false;    // the worker has ended; nothing runs on it any more
  std::thread th;

  explicit StreamCore(bool host_stream) : host(host_stream) {
    if (!host) th = std::thread([this] { loop(); });
  }
  ~StreamCore() {
    if (th.joinable()) {
      if (th.get_id() == std::this_thread::get_id()) th.detach();
      else stop();
    }
  }

  // Queues `f` behind everything enqueued so far; false (f left as it was) where the stream has
  // ended.
  bool push(std::function<void()>& f) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (closed) return false;
      q.push_back(std::move(f));
    }
    cv.notify_one();
    return true;
  }

  // Runs what is queued, then ends the worker.
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stopping = true;
    }
    cv.notify_one();
    if (th.joinable()) th.join();
  }

  void loop() {
    pthread_setname_np(pthread_self(), "fcfake-stream");
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return !q.empty() || stopping; });
        if (q.empty()) {
          closed = true;
          return;
        }
        f = std::move(q.front());
        q.pop_front();
      }
      try {
        f();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fastcomm fake runtime: a stream task failed: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "fastcomm fake runtime: a stream task failed\n");
      }
      // `f` (and what it holds: tensors kept alive, communicators) goes here, outside the lock.
    }
  }
};

// Runs `f` on `s`: now on the host stream (or on one that has ended), else queued.
void run_on(StreamCore& s, std::function<void()> f) {
  if (s.host || !s.push(f)) f();
}

// One record(): done once the stream reaches it.
struct Marker {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  void set() {
    {
      std::lock_guard<std::mutex> lk(mu);
      done = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return done; });
  }
  bool ready() {
    std::lock_guard<std::mutex> lk(mu);
    return done;
  }
};

struct EventImpl {
  std::mutex mu;
  std::shared_ptr<Marker> latest;  // null: never recorded (complete)
  std::shared_ptr<Marker> get() {
    std::lock_guard<std::mutex> lk(mu);
    return latest;
  }
};

// ------------------------------------------------------------------------------------------
// Wire

constexpr uint32_t kMagic = 0x6b666366;  // "fcfk"
constexpr uint64_t kMaxErrorBytes = 1 << 16;
enum FrameKind : uint16_t { kHello = 1, kData = 2, kAck = 3, kError = 4 };
// The operation a data frame belongs to: a receive that matches another operation's send is a
// protocol violation, reported as such.
enum OpCode : uint16_t { kP2P = 1, kAllReduce = 2, kBroadcast = 3, kAllGather = 4, kReduceScatter = 5 };

const char* op_name(uint16_t code) {
  switch (code) {
    case kP2P: return "send/recv";
    case kAllReduce: return "all_reduce";
    case kBroadcast: return "broadcast";
    case kAllGather: return "all_gather";
    case kReduceScatter: return "reduce_scatter";
    default: return "unknown operation";
  }
}

struct FrameHdr {
  uint32_t magic;
  uint16_t kind;
  uint16_t op;
  uint64_t seq;    // kData/kAck: the send's number on its (communicator, pair); kHello: the rank
  uint64_t bytes;  // payload bytes; kHello: the communicator's size
};
static_assert(sizeof(FrameHdr) == 24, "FrameHdr layout");

// Writes `a` then `b` whole on a non-blocking socket: 0, or the errno that stopped it. Waits for
// room with poll; `stop` (abort) ends such waits (abort also shuts the socket, which ends them
// anyway).
int write_full(int fd, const void* a, size_t na, const void* b, size_t nb, const std::atomic<bool>& stop) {
  iovec iov[2] = {{const_cast<void*>(a), na}, {const_cast<void*>(b), nb}};
  int i = 0;
  for (;;) {
    while (i < 2 && iov[i].iov_len == 0) ++i;
    if (i == 2) return 0;
    msghdr m{};
    m.msg_iov = iov + i;
    m.msg_iovlen = 2 - i;
    const ssize_t w = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      const int e = errno;
      if (e == EINTR) continue;
      if (e == EAGAIN || e == EWOULDBLOCK) {
        if (stop.load()) return ECANCELED;
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      return e;
    }
    size_t left = static_cast<size_t>(w);
    while (left > 0 && i < 2) {
      const size_t t = std::min(left, iov[i].iov_len);
      iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + t;
      iov[i].iov_len -= t;
      left -= t;
      if (iov[i].iov_len == 0) ++i;
    }
  }
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// ------------------------------------------------------------------------------------------
// Communicators

struct Msg {
  uint16_t op = 0;
  uint64_t bytes = 0;
  std::unique_ptr<uint8_t[]> data;
};

struct Peer {
  // Under CommImpl::mu.
  int fd = -1;      // the connection (this rank's own slot: none, it is always up)
  bool up = false;  // connected and identified
  std::unordered_map<uint64_t, Msg> inbox;  // data frames not taken yet, by send number
  std::unordered_set<uint64_t> acks;        // acks of this rank's sends not waited for yet
  std::string gone;  // set: its connection closed; an operation that needs it fails then
  uint64_t next_send = 0, next_recv = 0;    // numbers of the next send / receive issued
  // One writer at a time on fd.
  std::mutex wmu;
  // The progress thread's own.
  bool dead = false;
  FrameHdr hdr{};
  size_t hdr_got = 0;
  Msg cur;
  size_t cur_got = 0;
};

struct SendPart {
  int peer;
  const void* buf;
  size_t bytes;
  uint64_t seq;
};
struct RecvPart {
  int peer;
  void* dst;  // null: keep the message (op.recvs[i].msg) for the fold
  size_t bytes;
  uint64_t seq;
  Msg msg;
};

class CommImpl {
 public:
  CommImpl(const UniqueId& id, int nranks, int rank) : nranks_(nranks), rank_(rank) {
    static const char* hex = "0123456789abcdef";
    for (int i = 0; i < 16; ++i) {
      name_ += hex[id.bytes[i] >> 4];
      name_ += hex[id.bytes[i] & 15];
    }
    for (int r = 0; r < nranks; ++r) peers_.emplace_back(new Peer);
    peers_[rank]->up = true;
  }

  ~CommImpl() {
    shutdown();
    close_fd(listen_fd_);
    close_fd(wake_fd_);
    for (auto& p : peers_) close_fd(p->fd);
  }

  int nranks() const { return nranks_; }
  int rank() const { return rank_; }
  const std::string& name() const { return name_; }

  // The listener and the progress thread; throws (naming comm_init) where they cannot be made.
  void start() {
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) call_error("comm_init", "socket() failed: " + errno_str(errno));
    sockaddr_un a;
    const socklen_t len = address(rank_, &a);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len) != 0) {
      const int e = errno;
      if (e == EADDRINUSE)
        call_error("comm_init", "rank " + std::to_string(rank_) + " of communicator " + name_ +
                                    " is already initialised on this host");
      call_error("comm_init", "bind() failed: " + errno_str(e));
    }
    if (::listen(listen_fd_, 128) != 0) call_error("comm_init", "listen() failed: " + errno_str(errno));
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) call_error("comm_init", "eventfd() failed: " + errno_str(errno));
    if (nranks_ == 1) state_ = State::kReady;
    progress_ = std::thread([this] { progress(); });
  }

  State state(std::string* why) {
    std::lock_guard<std::mutex> lk(mu_);
    if (why && state_ == State::kFailed) *why = why_;
    if (state_ == State::kReady && busy()) return State::kPending;
    return state_;
  }

  // A launch is still being enqueued (ncclInProgress): the communicator takes no call.
  bool busy() const { return Clock::now().time_since_epoch().count() < busy_until_.load(); }
  void set_busy(int64_t micros) {
    if (micros <= 0) return;
    busy_until_ = (Clock::now() + std::chrono::microseconds(micros)).time_since_epoch().count();
  }

  // Ends the communicator's work: what waits on it completes without moving data. Any thread.
  void abort() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (aborted_) return;
      aborted_ = true;
      if (state_ != State::kFailed) {
        why_ = "aborted";
      } else {
        why_ = "aborted; earlier failure: " + why_;
      }
      state_ = State::kFailed;
      for (int r = 0; r < nranks_; ++r)
        if (r != rank_ && peers_[r]->fd >= 0) ::shutdown(peers_[r]->fd, SHUT_RDWR);
    }
    cv_.notify_all();
    wake();
  }

  // abort() and the progress thread joined; the sockets close with the last reference (work
  // still queued on a stream holds one).
  void shutdown() {
    abort();
    if (progress_.joinable()) progress_.join();
  }

  // Issue-order numbers for a new operation's sends / receives with `peer`.
  uint64_t take_send_number(int peer) { return peers_[peer]->next_send++; }
  uint64_t take_recv_number(int peer) { return peers_[peer]->next_recv++; }
  std::mutex& mu() { return mu_; }

  // ---- the parts of an operation, run by its stream task. Each returns false where the
  // communicator was aborted: the operation then stops without moving (more) data.

  bool post_send(uint16_t code, const SendPart& s) {
    std::unique_lock<std::mutex> lk(mu_);
    Peer& p = *peers_[s.peer];
    if (!hold(lk, [&] { return p.up; })) return false;
    if (s.peer == rank_) {
      Msg m;
      m.op = code;
      m.bytes = s.bytes;
      m.data.reset(new uint8_t[std::max<size_t>(s.bytes, 1)]);
      if (s.bytes) std::memcpy(m.data.get(), s.buf, s.bytes);
      p.inbox.emplace(s.seq, std::move(m));
      cv_.notify_all();
      return true;
    }
    const int fd = p.fd;
    lk.unlock();
    const FrameHdr h{kMagic, kData, code, s.seq, s.bytes};
    const int e = write_to(p, fd, h, s.buf);
    if (e == EPIPE || e == ECONNRESET)
      return stuck("peer rank " + std::to_string(s.peer) + " of the communicator closed its connection");
    if (e != 0) return stuck("a send to rank " + std::to_string(s.peer) + " failed: " + errno_str(e));
    return true;
  }

  bool take_recv(uint16_t code, RecvPart& r) {
    std::unique_lock<std::mutex> lk(mu_);
    Peer& p = *peers_[r.peer];
    // Abort races a transfer that already has its data: that one still lands.
    cv_.wait(lk, [&] { return aborted_ || p.inbox.count(r.seq) != 0 || !p.gone.empty(); });
    auto it = p.inbox.find(r.seq);
    if (it == p.inbox.end()) {
      if (!aborted_) set_failed(p.gone);
      hold(lk, [] { return false; });
      return false;
    }
    Msg m = std::move(it->second);
    p.inbox.erase(it);
    if (m.op != code || m.bytes != r.bytes) {
      std::string why;
      if (m.op != code) {
        why = std::string("protocol violation: this rank's ") + op_name(code) + " #" + std::to_string(r.seq) +
              " with rank " + std::to_string(r.peer) + " matched its " + op_name(m.op);
      } else {
        why = "size mismatch: a receive of " + std::to_string(r.bytes) + " bytes from rank " +
              std::to_string(r.peer) + " matched a send of " + std::to_string(m.bytes) + " bytes (" +
              op_name(code) + " #" + std::to_string(r.seq) + " between the pair)";
      }
      set_failed(why);
      const int fd = p.fd;
      lk.unlock();
      if (r.peer != rank_) {
        const std::string told = "rank " + std::to_string(rank_) + " reported: " + why;
        const FrameHdr h{kMagic, kError, 0, 0, told.size()};
        write_to(p, fd, h, told.data());
      }
      lk.lock();
      hold(lk, [] { return false; });
      return false;
    }
    if (r.peer == rank_) {
      p.acks.insert(r.seq);
      cv_.notify_all();
    }
    const int fd = p.fd;
    const bool aborted = aborted_;
    lk.unlock();
    if (r.dst) {
      quarantine().check(r.dst, r.bytes);
      if (r.bytes) std::memcpy(r.dst, m.data.get(), r.bytes);
    } else {
      r.msg = std::move(m);
    }
    if (aborted) return true;
    if (r.peer != rank_) {
      const FrameHdr h{kMagic, kAck, 0, r.seq, 0};
      const int e = write_to(p, fd, h, nullptr);
      if (e == EPIPE || e == ECONNRESET) {
        // The data landed; the peer is gone (its sender needs no ack any more), which fails
        // what needs it from now on.
        std::lock_guard<std::mutex> g(mu_);
        if (p.gone.empty()) p.gone = "peer rank " + std::to_string(r.peer) + " of the communicator closed its connection";
        cv_.notify_all();
      } else if (e != 0) {
        return stuck("an ack to rank " + std::to_string(r.peer) + " failed: " + errno_str(e));
      }
    }
    return true;
  }

  bool wait_ack(const SendPart& s) {
    std::unique_lock<std::mutex> lk(mu_);
    Peer& p = *peers_[s.peer];
    if (!hold(lk, [&] { return p.acks.count(s.seq) != 0 || !p.gone.empty(); })) return false;
    if (!p.acks.count(s.seq)) {
      set_failed(p.gone);  // the peer is gone: this send is never received
      hold(lk, [] { return false; });
      return false;
    }
    p.acks.erase(s.seq);
    return true;
  }

 private:
  // Waits (not spinning) until pred() or abort; true for pred().
  template <typename Pred>
  bool hold(std::unique_lock<std::mutex>& lk, Pred pred) {
    cv_.wait(lk, [&] { return aborted_ || pred(); });
    return !aborted_;
  }

  // A failure inside a task: reported, and the task stays stuck until abort (as NCCL's kernels
  // do). Always false.
  bool stuck(const std::string& why) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!aborted_) set_failed(why);
    hold(lk, [] { return false; });
    return false;
  }

  // Under mu_. The first failure is the one reported.
  void set_failed(const std::string& why) {
    if (state_ == State::kFailed) return;
    state_ = State::kFailed;
    why_ = why;
    cv_.notify_all();
  }

  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!aborted_) set_failed(why);
  }

  int write_to(Peer& p, int fd, const FrameHdr& h, const void* payload) {
    std::lock_guard<std::mutex> wl(p.wmu);
    return write_full(fd, &h, sizeof h, payload, payload ? h.bytes : 0, aborted_);
  }

  void wake() {
    if (wake_fd_ < 0) return;
    const uint64_t one = 1;
    ssize_t rc = ::write(wake_fd_, &one, sizeof one);
    (void)rc;
  }

  socklen_t address(int r, sockaddr_un* a) const {
    std::memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    const std::string s = "fcfake-" + name_ + "-" + std::to_string(r);
    a->sun_path[0] = '\0';  // the abstract namespace: no file, gone with the socket
    std::memcpy(a->sun_path + 1, s.data(), s.size());
    return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + s.size());
  }

  // ---- the progress thread: bootstrap, then draining of incoming frames.

  struct Accepted {
    int fd;
    FrameHdr h{};
    size_t got = 0;
  };

  // The connection with `r` is made (by this thread).
  void set_up(int r, int fd) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      peers_[r]->fd = fd;
      peers_[r]->up = true;
      if (aborted_) ::shutdown(fd, SHUT_RDWR);
      bool all = true;
      for (auto& p : peers_) all = all && p->up;
      if (all && state_ == State::kPending) state_ = State::kReady;
    }
    cv_.notify_all();
  }

  bool all_up() {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& p : peers_)
      if (!p->up) return false;
    return true;
  }

  // One attempt to connect to the higher rank `r`: true once connected (and hello sent).
  bool try_connect(int r) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      fail("bootstrap: socket() failed: " + errno_str(errno));
      return false;
    }
    sockaddr_un a;
    const socklen_t len = address(r, &a);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0) {
      const int e = errno;
      close_fd(fd);
      // Not listening yet (has not called comm_init), or its backlog is full: later.
      if (e != ECONNREFUSED && e != ENOENT && e != EAGAIN && e != EINTR && e != EINPROGRESS)
        fail("bootstrap: connect() to rank " + std::to_string(r) + " failed: " + errno_str(e));
      return false;
    }
    const FrameHdr h{kMagic, kHello, 0, static_cast<uint64_t>(rank_), static_cast<uint64_t>(nranks_)};
    if (write_full(fd, &h, sizeof h, nullptr, 0, aborted_) != 0) {
      close_fd(fd);
      return false;
    }
    set_up(r, fd);
    return true;
  }

  // Reads a connecting rank's hello: false when the connection is done with (identified, or
  // dropped).
  bool read_hello(Accepted& c) {
    for (;;) {
      const ssize_t n = ::recv(c.fd, reinterpret_cast<char*>(&c.h) + c.got, sizeof c.h - c.got, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n <= 0) {
        close_fd(c.fd);
        return false;
      }
      c.got += static_cast<size_t>(n);
      if (c.got < sizeof c.h) continue;
      const uint64_t r = c.h.seq;
      bool taken = true;
      if (r < static_cast<uint64_t>(rank_)) {
        std::lock_guard<std::mutex> lk(mu_);
        taken = peers_[r]->up;
      }
      if (c.h.magic != kMagic || c.h.kind != kHello || c.h.bytes != static_cast<uint64_t>(nranks_) ||
          r >= static_cast<uint64_t>(rank_) || taken) {
        fail("protocol violation: a bad hello on communicator " + name_ + " (rank " + std::to_string(r) +
             " of " + std::to_string(c.h.bytes) + ")");
        close_fd(c.fd);
        return false;
      }
      set_up(static_cast<int>(r), c.fd);
      return false;
    }
  }

  // A whole frame from `r` has arrived.
  void deliver(int r, Peer& p) {
    const FrameHdr h = p.hdr;
    Msg m = std::move(p.cur);
    p.hdr_got = 0;
    p.cur_got = 0;
    std::lock_guard<std::mutex> lk(mu_);
    if (h.kind == kData) {
      m.op = h.op;
      m.bytes = h.bytes;
      if (!p.inbox.emplace(h.seq, std::move(m)).second && !aborted_)
        set_failed("protocol violation: rank " + std::to_string(r) + " sent message #" + std::to_string(h.seq) +
                   " twice");
    } else if (h.kind == kAck) {
      p.acks.insert(h.seq);
    } else if (h.kind == kError) {
      if (!aborted_) set_failed(std::string(reinterpret_cast<const char*>(m.data.get()), h.bytes));
    }
    cv_.notify_all();
  }

  // Drains what `r` sent; false once the connection is lost (reported).
  bool read_frames(int r) {
    Peer& p = *peers_[r];
    size_t budget = size_t(16) << 20;  // then let the other connections have a turn
    while (budget > 0) {
      char* at;
      size_t want;
      if (p.hdr_got < sizeof p.hdr) {
        at = reinterpret_cast<char*>(&p.hdr) + p.hdr_got;
        want = sizeof p.hdr - p.hdr_got;
      } else {
        at = reinterpret_cast<char*>(p.cur.data.get()) + p.cur_got;
        want = p.hdr.bytes - p.cur_got;
      }
      const ssize_t n = ::recv(p.fd, at, want, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n <= 0) {
        // As NCCL over sockets: the communicator fails once an operation needs that peer.
        const std::string how = n == 0 ? "" : std::string(" (") + errno_str(errno) + ")";
        {
          std::lock_guard<std::mutex> lk(mu_);
          p.gone = "peer rank " + std::to_string(r) + " of the communicator closed its connection" + how;
        }
        cv_.notify_all();
        return false;
      }
      budget -= std::min(budget, static_cast<size_t>(n));
      if (p.hdr_got < sizeof p.hdr) {
        p.hdr_got += static_cast<size_t>(n);
        if (p.hdr_got < sizeof p.hdr) continue;
        const FrameHdr& h = p.hdr;
        const bool ok = h.magic == kMagic &&
                        ((h.kind == kData) || (h.kind == kAck && h.bytes == 0) ||
                         (h.kind == kError && h.bytes <= kMaxErrorBytes));
        if (!ok) {
          fail("protocol violation: a bad frame from rank " + std::to_string(r));
          return false;
        }
        p.cur = Msg{};
        p.cur.data.reset(new uint8_t[std::max<uint64_t>(h.bytes, 1)]);
        if (h.bytes == 0) deliver(r, p);
      } else {
        p.cur_got += static_cast<size_t>(n);
        if (p.cur_got == p.hdr.bytes) deliver(r, p);
      }
    }
    return true;
  }

  void progress() {
    pthread_setname_np(pthread_self(), "fcfake-comm");
    std::vector<Accepted> accepted;
    int delay_ms = 1;
    Clock::time_point next_try = Clock::now();
    int next_connect = rank_ + 1;  // the lower rank connects, in rank order
    std::vector<pollfd> fds;
    std::vector<int> who;  // -1 wake, -2 listener, -3 - i accepted[i], r >= 0 peer r
    try {
      for (;;) {
        if (aborted_.load()) break;
        int timeout = -1;
        if (next_connect < nranks_) {
          if (Clock::now() >= next_try) {
            while (next_connect < nranks_ && try_connect(next_connect)) ++next_connect;
            if (next_connect < nranks_) {
              delay_ms = std::min(delay_ms * 2, 20);
              next_try = Clock::now() + std::chrono::milliseconds(delay_ms);
            }
          }
          if (next_connect < nranks_) {
            const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next_try - Clock::now()).count();
            timeout = static_cast<int>(std::max<int64_t>(ms, 0)) + 1;
          }
        }
        if (listen_fd_ >= 0 && accepted.empty() && all_up()) close_fd(listen_fd_);  // bootstrapped
        fds.clear();
        who.clear();
        fds.push_back({wake_fd_, POLLIN, 0});
        who.push_back(-1);
        if (listen_fd_ >= 0) {
          fds.push_back({listen_fd_, POLLIN, 0});
          who.push_back(-2);
        }
        for (size_t i = 0; i < accepted.size(); ++i) {
          fds.push_back({accepted[i].fd, POLLIN, 0});
          who.push_back(-3 - static_cast<int>(i));
        }
        for (int r = 0; r < nranks_; ++r) {
          if (r == rank_ || peers_[r]->fd < 0 || peers_[r]->dead) continue;
          fds.push_back({peers_[r]->fd, POLLIN, 0});
          who.push_back(r);
        }
        const int k = ::poll(fds.data(), fds.size(), timeout);
        if (k < 0) {
          if (errno == EINTR) continue;
          fail("progress: poll() failed: " + errno_str(errno));
          break;
        }
        bool drop_accepted = false;
        for (size_t i = 0; i < fds.size(); ++i) {
          if (fds[i].revents == 0) continue;
          const int w = who[i];
          if (w == -1) {
            uint64_t v;
            while (::read(wake_fd_, &v, sizeof v) > 0) {
            }
          } else if (w == -2) {
            for (;;) {
              const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
              if (fd < 0) {
                const int e = errno;
                if (e == EINTR || e == ECONNABORTED) continue;
                if (e != EAGAIN && e != EWOULDBLOCK) fail("bootstrap: accept() failed: " + errno_str(e));
                break;
              }
              accepted.push_back({fd});
            }
          } else if (w <= -3) {
            Accepted& c = accepted[static_cast<size_t>(-3 - w)];
            if (!read_hello(c)) {
              c.fd = -1;  // closed, or now a peer's
              drop_accepted = true;
            }
          } else if (!read_frames(w)) {
            peers_[w]->dead = true;
          }
        }
        if (drop_accepted)
          accepted.erase(std::remove_if(accepted.begin(), accepted.end(), [](const Accepted& c) { return c.fd < 0; }),
                         accepted.end());
      }
    } catch (const std::exception& e) {
      fail(std::string("progress thread: ") + e.what());
    }
    for (auto& c : accepted) close_fd(c.fd);
  }

  const int nranks_;
  const int rank_;
  std::string name_;  // hex of the id's first 16 bytes
  std::vector<std::unique_ptr<Peer>> peers_;
  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::kPending;
  std::string why_;
  std::atomic<bool> aborted_{false};
  std::atomic<int64_t> busy_until_{0};  // steady-clock ticks
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::thread progress_;
};

// ------------------------------------------------------------------------------------------
// Operations: a communicator's sends and receives of one call, run by a stream task.

struct Op {
  std::shared_ptr<CommImpl> comm;
  uint16_t code = kP2P;
  std::vector<SendPart> sends;
  std::vector<RecvPart> recvs;
  std::function<void(Op&)> before_recvs;  // once the sends are out (all_gather's own block)
  std::function<void(Op&)> after_recvs;   // once every receive has its data (the folds)
  bool dead = false;                      // aborted: no more data moves
};

// One task's operations, together (a group's on one stream, or a single call's): all sends
// out, then every receive satisfied (and acked), then every send's ack awaited. So a send and a
// receive with the same peer in one group do not wait on each other.
void run_ops(std::vector<Op>& ops) {
  for (auto& op : ops)
    for (auto& s : op.sends)
      if (!op.dead && !op.comm->post_send(op.code, s)) op.dead = true;
  for (auto& op : ops)
    if (!op.dead && op.before_recvs) op.before_recvs(op);
  for (auto& op : ops) {
    // Even after an abort: a receive whose message has arrived still lands (take_recv).
    for (auto& r : op.recvs)
      if (!op.comm->take_recv(op.code, r)) op.dead = true;
    if (!op.dead && op.after_recvs) op.after_recvs(op);
  }
  for (auto& op : ops)
    for (auto& s : op.sends)
      if (!op.dead && !op.comm->wait_ack(s)) op.dead = true;
}

// ------------------------------------------------------------------------------------------
// The runtime

class FakeRuntime final : public Runtime {
  struct Group {
    int depth = 0;
    std::vector<std::pair<std::shared_ptr<StreamCore>, std::vector<Op>>> work;  // by stream, in first-use order
  };

 public:
  FakeRuntime() : caller_(std::make_shared<StreamCore>(false)) {}

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
    return c.stream != nullptr && c.stream == s;
  }
  void relax_capture_mode() override { tl_relaxed = true; }

  // Test hooks: "spin" queues `arg` ms of busy work on the caller's stream (a long kernel),
  // "hold" one that runs until "release"; "abort_hold" makes comm_abort block until "abort_release";
  // "begin_capture" captures the caller's stream (arg 0: the global mode, 1: thread-local) and
  // "end_capture" ends it (1: the graph is valid, 0: it was invalidated); "late_writes" counts
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
    if (what == "begin_capture" || what == "end_capture") {
      Capture& c = capture();
      std::lock_guard<std::mutex> lk(c.mu);
      if (what == "begin_capture") {
        if (c.stream != nullptr) call_error("debug", "a capture is under way");
        c.stream = caller_.get();
        c.global = arg == 0;
        c.invalidated = false;
        return 0;
      }
      if (c.stream != caller_.get()) call_error("debug", "no capture of this runtime's caller stream");
      c.stream = nullptr;
      return c.invalidated ? 0 : 1;
    }
    if (what == "late_writes") return quarantine().late_writes.load();
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
    auto m = std::make_shared<Marker>();
    {
      std::lock_guard<std::mutex> lk(ev->mu);
      ev->latest = m;
    }
    run_on(*st, [m] { m->set(); });
  }

  void wait(Stream s, Event e) override {
    EventImpl* ev = event_of(e, "wait");
    auto st = stream_of(s, "wait");
    auto m = ev->get();
    if (!m) return;  // never recorded: complete
    run_on(*st, [m] { m->wait(); });
  }

  State query(Event e) override {
    unsafe_call("query");
    auto m = event_of(e, "query")->get();
    return !m || m->ready() ? State::kReady : State::kPending;
  }

  void synchronize(Event e) override {
    unsafe_call("synchronize");
    auto m = event_of(e, "synchronize")->get();
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
    {
      std::lock_guard<std::mutex> lk(comm->mu());
      op.sends.push_back({peer, buf, bytes, comm->take_send_number(peer)});
    }
    submit(std::move(op), st);
  }

  void recv(void* buf, size_t bytes, int peer, Comm c, Stream s) override {
    auto comm = usable(c, "recv");
    auto st = stream_of(s, "recv");
    check_peer("recv", *comm, peer, "peer");
    if (bytes && !buf) call_error("recv", "null buffer");
    Op op;
    op.comm = comm;
    {
      std::lock_guard<std::mutex> lk(comm->mu());
      op.recvs.push_back({peer, buf, bytes, comm->take_recv_number(peer), {}});
    }
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
    {
      std::lock_guard<std::mutex> lk(comm->mu());
      if (comm->rank() == root) {
        for (int p = 0; p < comm->nranks(); ++p)
          if (p != root) op.sends.push_back({p, buf, bytes, comm->take_send_number(p)});
      } else {
        op.recvs.push_back({root, buf, bytes, comm->take_recv_number(root), {}});
      }
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
    std::lock_guard<std::mutex> lk(c.mu());
    for (int p = 0; p < c.nranks(); ++p) {
      if (p == c.rank()) continue;
      op.sends.push_back({p, src(p), bytes, c.take_send_number(p)});
      op.recvs.push_back({p, nullptr, bytes, c.take_recv_number(p), {}});
    }
  }

  // Into the calling thread's open group, or as a task of its own.
  void submit(Op op, const std::shared_ptr<StreamCore>& st) {
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
    for (auto& op : ops) op.comm->set_busy(enqueue_us_.load());
    auto shared = std::make_shared<std::vector<Op>>(std::move(ops));
    run_on(st, [shared] { run_ops(*shared); });
  }

  std::mutex mu_;
  const std::shared_ptr<StreamCore> caller_;
  std::atomic<int64_t> enqueue_us_{kEnqueueMicros};
  std::vector<std::shared_ptr<Marker>> holds_;  // "hold" kernels not released yet
  std::shared_ptr<Marker> abort_hold_;          // set: comm_abort blocks on it
  std::unordered_map<void*, std::shared_ptr<StreamCore>> streams_;
  std::unordered_map<void*, std::unique_ptr<EventImpl>> events_;
  std::unordered_map<void*, std::shared_ptr<CommImpl>> comms_;
  std::unordered_map<std::thread::id, Group> groups_;  // open groups, per calling thread
};

}  // namespace

int64_t Runtime::debug(const std::string& what, int64_t) {
  TORCH_CHECK_VALUE(false, "fastcomm: the ", name(), " device runtime has no test hook '", what, "'");
}

std::unique_ptr<Runtime> make_fake_runtime() { return std::make_unique<FakeRuntime>(); }

}  // namespace device
}  // namespace fastcomm
