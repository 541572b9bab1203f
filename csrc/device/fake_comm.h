#pragma once
// The CPU fake's communicators (fake_runtime.cpp has the whole list of what it keeps): a set of
// abstract-namespace Unix sockets per communicator, a progress thread that bootstraps and
// drains them, sends and receives matched by number, and the operations a stream task runs.
// Included by fake_runtime.cpp only.
#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "device/fake_streams.h"

namespace fastcomm {
namespace device {
namespace fake {

// ------------------------------------------------------------------------------------------
// Wire

constexpr uint32_t kMagic = 0x6b666366;  // "fcfk"
constexpr uint64_t kMaxErrorBytes = 1 << 16;
enum FrameKind : uint16_t { kHello = 1, kData = 2, kAck = 3, kError = 4 };
// The operation a data frame belongs to: a receive that matches another operation's send is a
// protocol violation, reported as such.
enum OpCode : uint16_t { kP2P = 1, kAllReduce = 2, kBroadcast = 3, kAllGather = 4, kReduceScatter = 5 };

inline const char* op_name(uint16_t code) {
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
inline int write_full(int fd, const void* a, size_t na, const void* b, size_t nb, const std::atomic<bool>& stop) {
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

inline void close_fd(int& fd) {
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

  // A launch is still being enqueued by its thread (ncclInProgress): the communicator takes no call.
  bool busy() const { return launches_.load() > 0; }
  void begin_launch() { ++launches_; }
  void end_launch() { --launches_; }

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

  bool aborted() {
    std::lock_guard<std::mutex> lk(mu_);
    return aborted_;
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
  std::atomic<int64_t> launches_{0};  // non-blocking launches whose thread has not ended
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
inline void run_ops(std::vector<Op>& ops) {
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


}  // namespace fake
}  // namespace device
}  // namespace fastcomm
