// The CPU fake's communicators (device/fake_comm.h): a communicator's state, abort and
// failures, the parts of an operation a stream task runs (sends, receives matched by number,
// acks), and run_ops, which runs one task's operations together.
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "device/fake_comm.h"

namespace fastcomm {
namespace device {
namespace fake {

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

CommImpl::CommImpl(const UniqueId& id, int nranks, int rank) : nranks_(nranks), rank_(rank) {
  static const char* hex = "0123456789abcdef";
  for (int i = 0; i < 16; ++i) {
    name_ += hex[id.bytes[i] >> 4];
    name_ += hex[id.bytes[i] & 15];
  }
  for (int r = 0; r < nranks; ++r) peers_.emplace_back(new Peer);
  peers_[rank]->up = true;
}

CommImpl::~CommImpl() {
  shutdown();
  close_fd(listen_fd_);
  close_fd(wake_fd_);
  for (auto& p : peers_) close_fd(p->fd);
}

State CommImpl::state(std::string* why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (why && state_ == State::kFailed) *why = why_;
  if (state_ == State::kReady && busy()) return State::kPending;
  return state_;
}

void CommImpl::abort() {
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

bool CommImpl::aborted() {
  std::lock_guard<std::mutex> lk(mu_);
  return aborted_;
}

void CommImpl::shutdown() {
  abort();
  if (progress_.joinable()) progress_.join();
}

bool CommImpl::post_send(uint16_t code, const SendPart& s) {
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

bool CommImpl::take_recv(uint16_t code, RecvPart& r) {
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

bool CommImpl::wait_ack(const SendPart& s) {
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

bool CommImpl::stuck(const std::string& why) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!aborted_) set_failed(why);
  hold(lk, [] { return false; });
  return false;
}

void CommImpl::set_failed(const std::string& why) {
  if (state_ == State::kFailed) return;
  state_ = State::kFailed;
  why_ = why;
  cv_.notify_all();
}

void CommImpl::fail(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!aborted_) set_failed(why);
}

int CommImpl::write_to(Peer& p, int fd, const FrameHdr& h, const void* payload) {
  std::lock_guard<std::mutex> wl(p.wmu);
  return write_full(fd, &h, sizeof h, payload, payload ? h.bytes : 0, aborted_);
}

void CommImpl::wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  ssize_t rc = ::write(wake_fd_, &one, sizeof one);
  (void)rc;
}

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

void CommImpl::add_graph_ref() {
  std::lock_guard<std::mutex> lk(refs_mu_);
  ++graph_refs_;
}

void CommImpl::drop_graph_ref() {
  {
    std::lock_guard<std::mutex> lk(refs_mu_);
    --graph_refs_;
  }
  refs_cv_.notify_all();
}

void CommImpl::wait_graph_refs() {
  std::unique_lock<std::mutex> lk(refs_mu_);
  refs_cv_.wait(lk, [&] { return graph_refs_ == 0; });
}

int64_t CommImpl::graph_refs() {
  std::lock_guard<std::mutex> lk(refs_mu_);
  return graph_refs_;
}

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
