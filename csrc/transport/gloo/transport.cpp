#include "transport/gloo/transport.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/errors.h"

namespace fastcomm {

namespace {
// Receives for frame heads of up to this size are always posted ahead of time (Gloo accepts a
// message shorter than the receive buffer), so a frame that fits costs one Gloo message and
// no ready-to-receive round trip. Larger frames send the rest as one body, whose receive is
// posted once the head has told its length. Below malloc's mmap threshold, so posting a head
// receive costs no system call.
constexpr size_t kHeadBytes = 64 * 1024;
constexpr size_t kLenWords = 16;  // head bytes used, body bytes
// Frames are cut at about this size, so a large op streams as several frames and the receiver
// folds one while the next is on the wire (a single multi-megabyte frame would serialise the
// transfer and the reduction).
constexpr size_t kFrameTarget = 256 * 1024;
constexpr int kBodyWindow = 2;
// Head receives kept posted per peer: the next frame's head is matched while the current one
// is handed over, instead of after a fresh ready-to-receive round trip.
constexpr int kHeadWindow = 2;
constexpr int kHeadTag = 0x6663;
constexpr int kBodyTag = 0x6664;

size_t align8(size_t n) { return (n + 7) & ~size_t(7); }

std::string what_of(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

void abort_quietly(const c10::intrusive_ptr<c10d::Work>& w) {
  try {
    w->abort();
  } catch (...) {
    // Already finished, or nothing to abort: either way nothing is left waiting on it.
  }
}
}  // namespace

// Outgoing frame under construction: malloc'd so growing it never zero-fills payload bytes;
// shared with the tensors Gloo sends from until the reaper drops them.
struct GlooOutBuf {
  uint8_t* data = nullptr;
  size_t size = 0, cap = 0;
  GlooOutBuf(const GlooOutBuf&) = delete;
  GlooOutBuf() = default;
  ~GlooOutBuf() { std::free(data); }
  void reserve(size_t n) {
    if (n <= cap) return;
    // Large ops append their pieces back to back; growing fourfold re-copies a frame at most
    // once or twice on its way to megabytes.
    const size_t c = std::max(n, cap * 4);
    auto* d = static_cast<uint8_t*>(std::realloc(data, c));
    TORCH_CHECK(d != nullptr, "fastcomm: out of memory for a Gloo frame of ", c, " bytes");
    data = d;
    cap = c;
  }
};

GlooTransport::GlooTransport(c10::intrusive_ptr<c10d::Backend> pg, int rank, int world_size,
                             std::vector<char> remote, size_t max_payload, Doorbell bell,
                             std::chrono::milliseconds linger)
    : pg_(std::move(pg)),
      rank_(rank),
      world_size_(world_size),
      remote_(std::move(remote)),
      max_payload_(max_payload),
      body_max_(std::max(kFrameTarget, max_payload + 128)),
      linger_(linger),
      bell_(bell) {
  TORCH_CHECK_VALUE(pg_, "fastcomm: no Gloo process group for the Gloo transport");
  TORCH_CHECK_VALUE((int)remote_.size() == world_size_, "fastcomm: Gloo transport: bad peer list");
  peers_.reserve(world_size_);
  for (int r = 0; r < world_size_; ++r) peers_.push_back(std::make_unique<Peer>());
}

GlooTransport::~GlooTransport() {
  stop();
  pg_.reset();  // our reference to the process group first, then the frames it may point into
  unfinished_.clear();
}

void GlooTransport::connect(int peer) {
  Peer& p = *peers_[peer];
  if (p.started || !remote_[peer] || stop_) return;
  p.started = true;
  if (!reaper_.joinable()) reaper_ = std::thread([this] { reap_main(); });
  p.thread = std::thread([this, peer] { recv_main(peer); });
}

bool GlooTransport::try_send(int peer, const Header& hdr, const void* payload) {
  Peer& p = *peers_[peer];
  if (!p.started) connect(peer);
  // A new frame starts with its two length words, filled in when it is sent.
  auto start_frame = [&p] {
    p.out = std::make_shared<GlooOutBuf>();
    p.out->reserve(4096);
    p.out->size = kLenWords;
  };
  if (!p.out) start_frame();
  const size_t rec = sizeof(Header) + align8(hdr.len);
  if (p.out->size > kLenWords && p.out->size + rec > body_max_) {
    // Sent before flush(): harmless (order is kept), and keeps every body within the
    // receiver's posted buffer.
    flush_peer(peer);
    start_frame();
  }
  GlooOutBuf& b = *p.out;
  const size_t at = b.size;
  b.reserve(at + rec);
  std::memcpy(b.data + at, &hdr, sizeof(Header));
  if (hdr.len) std::memcpy(b.data + at + sizeof(Header), payload, hdr.len);
  b.size = at + rec;
  if (!p.dirty) {
    p.dirty = true;
    dirty_.push_back(peer);
  }
  return true;  // unbounded: the receiver's thread drains Gloo into its inbox
}

void GlooTransport::flush() {
  for (int peer : dirty_) {
    Peer& p = *peers_[peer];
    p.dirty = false;
    flush_peer(peer);
    p.out.reset();
  }
  if (!dirty_.empty()) send_cv_.notify_one();
  dirty_.clear();
}

void GlooTransport::flush_peer(int peer) {
  Peer& p = *peers_[peer];
  std::shared_ptr<GlooOutBuf> b = p.out;
  if (!b || b->size <= kLenWords || stop_ || p.dead) return;  // dead: the engine fails the ops
  const uint64_t total = b->size;
  // The head takes the records that fit in it whole, so head and body parse on their own.
  uint64_t head = total;
  if (total > kHeadBytes) {
    head = kLenWords;
    while (head < total) {
      Header h;
      std::memcpy(&h, b->data + head, sizeof(Header));
      const uint64_t rec = sizeof(Header) + align8(h.len);
      if (head + rec > kHeadBytes) break;
      head += rec;
    }
  }
  const uint64_t words[2] = {head, total - head};
  std::memcpy(b->data, words, kLenWords);
  auto opts = at::TensorOptions().dtype(at::kByte);
  auto keep = [b](void*) {};
  std::vector<at::Tensor> ht{at::from_blob(b->data, {(int64_t)head}, keep, opts)};
  try {
    auto w = pg_->send(ht, peer, kHeadTag);
    ++frames_sent_;
    c10::intrusive_ptr<c10d::Work> wb;
    if (total > head) {
      std::vector<at::Tensor> bt{at::from_blob(b->data + head, {(int64_t)(total - head)}, keep, opts)};
      wb = pg_->send(bt, peer, kBodyTag);
    }
    std::lock_guard<std::mutex> lk(send_mu_);
    sends_.push_back({peer, std::move(w)});
    if (wb) sends_.push_back({peer, std::move(wb)});
  } catch (const std::exception& e) {
    mark_dead(peer, "Gloo send failed: " + what_of(e));
  }
}

const Message* GlooTransport::peek(int peer) {
  Peer& p = *peers_[peer];
  if (p.have) return &p.msg;
  if (!p.started) connect(peer);
  if (!p.cur.buf.defined()) {
    if (p.ready.load(std::memory_order_acquire) == 0) return nullptr;
    std::lock_guard<std::mutex> lk(p.mu);
    p.cur = std::move(p.inbox.front());
    p.inbox.pop_front();
    p.ready.fetch_sub(1, std::memory_order_relaxed);
    p.pos = p.cur.start;
  }
  const uint8_t* base = p.cur.buf.data_ptr<uint8_t>();
  TORCH_INTERNAL_ASSERT(p.pos + sizeof(Header) <= p.cur.len, "corrupt Gloo frame from rank ", peer);
  std::memcpy(&p.msg.hdr, base + p.pos, sizeof(Header));
  p.cur_bytes = sizeof(Header) + align8(p.msg.hdr.len);
  TORCH_INTERNAL_ASSERT(p.pos + p.cur_bytes <= p.cur.len, "corrupt Gloo frame from rank ", peer);
  p.msg.data = base + p.pos + sizeof(Header);
  p.have = true;
  return &p.msg;
}

void GlooTransport::pop(int peer) {
  Peer& p = *peers_[peer];
  TORCH_INTERNAL_ASSERT(p.have, "pop without peek");
  p.have = false;
  p.pos += p.cur_bytes;
  if (p.pos >= p.cur.len) {
    // Body buffers are megabytes: handing one back spares the receiver a fresh allocation
    // and its page faults on every large frame.
    if (p.cur.start == 0 && p.cur.buf.use_count() == 1) {
      std::lock_guard<std::mutex> lk(p.mu);
      if (!p.spare.defined()) p.spare = std::move(p.cur.buf);
    }
    p.cur = Frame{};
  }
}

bool GlooTransport::peer_alive(int peer) { return !peers_[peer]->dead.load(); }

std::string GlooTransport::death_reason(int peer) {
  Peer& p = *peers_[peer];
  std::lock_guard<std::mutex> lk(p.mu);
  return p.why;
}

void GlooTransport::mark_dead(int peer, const std::string& why) {
  Peer& p = *peers_[peer];
  {
    std::lock_guard<std::mutex> lk(p.mu);
    if (p.why.empty()) p.why = why;
  }
  p.dead = true;
  {
    // The reaper may be waiting on a send to this peer that will never complete.
    std::lock_guard<std::mutex> lk(send_mu_);
    if (reaping_.work && reaping_.peer == peer) abort_quietly(reaping_.work);
  }
  bell_.ring();  // the engine's next health pass fails this peer's groups
}

c10::intrusive_ptr<c10d::Work> GlooTransport::post_recv(int peer, at::Tensor& t, int tag) {
  Peer& p = *peers_[peer];
  std::lock_guard<std::mutex> lk(p.mu);
  if (stop_) return {};
  std::vector<at::Tensor> v{t};
  auto w = pg_->recv(v, peer, tag);
  p.posted.push_back(w);
  return w;
}

void GlooTransport::recv_main(int peer) {
  Peer& p = *peers_[peer];
  auto opts = at::TensorOptions().dtype(at::kByte);
  std::deque<std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>>> heads;
  // Posted once the peer first sent a body, then always kept kBodyWindow deep.
  std::deque<std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>>> bodies;
  auto forget = [&](const c10::intrusive_ptr<c10d::Work>& w) {
    std::lock_guard<std::mutex> lk(p.mu);
    p.posted.erase(std::remove(p.posted.begin(), p.posted.end(), w), p.posted.end());
  };
  auto post_head = [&] {
    at::Tensor t = at::empty({(int64_t)kHeadBytes}, opts);
    auto w = post_recv(peer, t, kHeadTag);
    if (!w) return false;
    heads.emplace_back(std::move(t), std::move(w));
    return true;
  };
  auto post_body = [&] {
    at::Tensor b;
    {
      std::lock_guard<std::mutex> lk(p.mu);
      b = std::move(p.spare);
      p.spare = at::Tensor();
    }
    if (!b.defined()) b = at::empty({(int64_t)body_max_}, opts);
    auto w = post_recv(peer, b, kBodyTag);
    if (!w) return false;
    bodies.emplace_back(std::move(b), std::move(w));
    return true;
  };
  auto deliver = [&](Frame f) {
    {
      std::lock_guard<std::mutex> lk(p.mu);
      p.inbox.push_back(std::move(f));
    }
    p.ready.fetch_add(1, std::memory_order_release);
  };
  try {
    for (int i = 0; i < kHeadWindow; ++i)
      if (!post_head()) return;
    while (!stop_) {
      auto [t, w] = std::move(heads.front());
      heads.pop_front();
      const bool ok = w->wait();
      forget(w);
      if (stop_ || !ok || !post_head()) break;
      uint64_t words[2];
      std::memcpy(words, t.data_ptr<uint8_t>(), kLenWords);
      TORCH_CHECK(words[0] >= kLenWords && words[0] <= kHeadBytes && words[1] <= body_max_,
                  "corrupt Gloo frame from rank ", peer, " (head ", words[0], ", body ", words[1], ")");
      if (words[0] > kLenWords) deliver(Frame{std::move(t), kLenWords, words[0]});
      if (words[1] > 0) {
        while ((int)bodies.size() < kBodyWindow)
          if (!post_body()) return;
        auto [bt, bw] = std::move(bodies.front());
        bodies.pop_front();
        const bool bok = bw->wait();
        forget(bw);
        if (stop_ || !bok || !post_body()) break;
        deliver(Frame{std::move(bt), 0, words[1]});
      }
      bell_.ring();
    }
  } catch (const std::exception& e) {
    if (!stop_) mark_dead(peer, "Gloo receive from rank " + std::to_string(peer) + " failed: " + what_of(e));
  }
}

void GlooTransport::reap_main() {
  std::unique_lock<std::mutex> lk(send_mu_);
  for (;;) {
    send_cv_.wait(lk, [&] { return stop_ || !sends_.empty(); });
    if (sends_.empty()) break;  // stopping, nothing left
    InFlight f = std::move(sends_.front());
    sends_.pop_front();
    // A frame to a peer already declared dead can never be delivered: drop it unwaited.
    if (peers_[f.peer]->dead) {
      abort_quietly(f.work);
      unfinished_.push_back(std::move(f.work));
      continue;
    }
    reaping_ = f;
    lk.unlock();
    bool sent = false;
    try {
      if (stop_) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            stop_deadline_ - std::chrono::steady_clock::now());
        sent = f.work->wait(std::max(left, std::chrono::milliseconds(1)));
      } else {
        sent = f.work->wait();
      }
    } catch (const std::exception& e) {
      if (!stop_) mark_dead(f.peer, "Gloo send to rank " + std::to_string(f.peer) + " failed: " + what_of(e));
    }
    lk.lock();
    reaping_ = InFlight{-1, {}};
    if (!sent) unfinished_.push_back(f.work);
    f.work.reset();  // a completed send drops its frame here
  }
  reaper_done_ = true;
  reaper_done_cv_.notify_all();
}

void GlooTransport::stop() {
  {
    std::lock_guard<std::mutex> lk(send_mu_);
    if (stop_) return;
    // In all, not per send: a dead peer fails its sends at once, a stalled one costs this once.
    stop_deadline_ = std::chrono::steady_clock::now() + linger_;
    stop_ = true;
  }
  send_cv_.notify_all();
  // Sends first: a frame already handed to Gloo should still reach its peer (the peer may be
  // waiting for this rank's last message) before the connections go. The reaper may be in an
  // unbounded wait that began before stop_: past the deadline that send is aborted.
  if (reaper_.joinable()) {
    {
      std::unique_lock<std::mutex> lk(send_mu_);
      while (!reaper_done_) {
        if (std::chrono::steady_clock::now() < stop_deadline_) {
          reaper_done_cv_.wait_until(lk, stop_deadline_);
          continue;
        }
        if (reaping_.work) abort_quietly(reaping_.work);
        reaper_done_cv_.wait_for(lk, std::chrono::milliseconds(10));
      }
    }
    reaper_.join();
  }
  for (auto& pp : peers_) {
    Peer& p = *pp;
    std::lock_guard<std::mutex> lk(p.mu);
    for (auto& w : p.posted) abort_quietly(w);
  }
  for (auto& pp : peers_)
    if (pp->thread.joinable()) pp->thread.join();
}

}  // namespace fastcomm
