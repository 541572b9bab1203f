// The CPU fake's communicators (device/fake_comm.h): the listener and the progress thread, which
// bootstraps a communicator (the lower rank connects to the higher one's listener and says
// hello) and then drains the incoming frames of every peer into in-memory queues.
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "device/fake_comm.h"

namespace fastcomm {
namespace device {
namespace fake {

struct CommImpl::Accepted {
  int fd;
  FrameHdr h{};
  size_t got = 0;
};

void CommImpl::start() {
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

socklen_t CommImpl::address(int r, sockaddr_un* a) const {
  std::memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  const std::string s = "fcfake-" + name_ + "-" + std::to_string(r);
  a->sun_path[0] = '\0';  // the abstract namespace: no file, gone with the socket
  std::memcpy(a->sun_path + 1, s.data(), s.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + s.size());
}

void CommImpl::set_up(int r, int fd) {
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

bool CommImpl::all_up() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& p : peers_)
    if (!p->up) return false;
  return true;
}

bool CommImpl::try_connect(int r) {
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

bool CommImpl::read_hello(Accepted& c) {
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

void CommImpl::deliver(int r, Peer& p) {
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

bool CommImpl::read_frames(int r) {
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

void CommImpl::progress() {
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

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
