#include "transport/gloo/transport.h"

#include <ATen/ATen.h>

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/errors.h"

namespace fastcomm {

namespace {
// A frame starts with two words: bytes of the frame used, and control flags (0 on a data frame;
// a control frame carries no records).
constexpr size_t kLenWords = 16;
constexpr uint64_t kCtlClose = 1;     // the sender is closing: answer once you have read this
constexpr uint64_t kCtlCloseAck = 2;  // the answer
constexpr uint64_t kCtlAll = kCtlClose | kCtlCloseAck;
// How long stop() waits for those answers. A peer answers once it has read every frame before
// "closing" and no op of a group with us runs there any more (a rank that leaves after its
// last op may be ahead of its peers, whose ops of that group may still be running: our
// connection closing would fail them). Only a peer that is stopped, hung, or waits for an op
// we never issued does not, and for that one the op timeout (minutes, by default) would be
// far too long a shutdown.
constexpr std::chrono::seconds kCloseWait{10};
// Frames are cut at about this size. Smaller frames overlap the receiver's fold with the
// transfer of the next frame sooner; larger ones pay Gloo's per-message cost (a ready notice,
// a wake-up of the receiving thread and of the reaper) less often. Every posted receive is
// this large, but only the bytes a frame fills are ever touched.
constexpr size_t kFrameTarget = 1024 * 1024;
// Receives kept posted per peer: up to this many frames may be in flight to one peer before
// the sender has to wait for the receiver's thread to post again.
constexpr int kRecvWindow = 4;
// Sent frames kept for reuse (per transport, all peers together).
constexpr size_t kPoolMax = 8;
constexpr int kFrameTag = 0x6663;
// How long a wait on Gloo may last: a receive for a peer's next frame stays posted while the
// peer is idle, for as long as the job runs. (The process groups' own timeout, which bounds
// making the connection, would otherwise apply; ops are timed by the engine.)
constexpr std::chrono::milliseconds kIdleWait{std::chrono::hours(24 * 7)};
// Bulk transfers use tags from here on, one per slot number (modulo the span: far more than
// can ever be in flight between two ranks). Gloo tags are non-negative ints.
constexpr int kBulkTagBase = 0x10000;
constexpr uint64_t kBulkTagSpan = uint64_t(1) << 30;
// Which spans go as bulk transfers, by default. A bulk transfer saves the copies through
// frames (CPU), but its data leaves only after the offer has reached the receiver's op and
// the receive is posted: a few thread hand-offs that frames, whose receives are always
// posted, do not wait for. So the choice depends on the link: while other traffic to the peer
// is in flight (a batch, async ops), that wait hides behind it and the saved CPU is what
// counts, from kBulkBusyMin up; on an idle link (one op at a time) the wait is the op's
// latency, and only spans from kBulkIdleMin up, whose copies cost as much, go bulk.
// The bulk_bytes setting (FASTCOMM_GLOO_BULK_BYTES) replaces both.
constexpr size_t kBulkBusyMin = 256 * 1024;
constexpr size_t kBulkIdleMin = 1024 * 1024;

int bulk_tag(uint64_t slot) { return kBulkTagBase + (int)(slot % kBulkTagSpan); }

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

// Outgoing frame: malloc'd once at frame_max() bytes (never zero-filled, never grown, so
// appending never re-copies), and shared with the tensor Gloo sends from until the send is
// reaped, then returned to the pool.
struct GlooOutBuf {
  uint8_t* data = nullptr;
  size_t size = 0;
  explicit GlooOutBuf(size_t cap) : data(static_cast<uint8_t*>(std::malloc(cap))) {
    TORCH_CHECK(data != nullptr, "fastcomm: out of memory for a Gloo frame of ", cap, " bytes");
  }
  GlooOutBuf(const GlooOutBuf&) = delete;
  ~GlooOutBuf() { std::free(data); }
};

struct GlooOutPool {
  std::mutex mu;
  std::vector<std::unique_ptr<GlooOutBuf>> free;
};

// A bulk transfer in flight: the handle the op polls, and what Gloo needs kept alive (its work,
// and the tensor over the memory it reads or writes).
struct GlooTransport::BulkXfer : Bulk {
  int peer = -1;
  bool send = false;
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor bytes;
  // Under bulk_mu_: transfers to wait on right after this one, by the same thread, and
  // whether that thread has already moved on (then a transfer cannot join it any more).
  std::deque<std::shared_ptr<BulkXfer>> then;
  bool waiter_left = false;
};

GlooTransport::GlooTransport(int rank, int world_size, std::vector<char> remote, size_t max_payload,
                             Doorbell bell, std::chrono::milliseconds linger, size_t bulk_bytes)
    : rank_(rank),
      world_size_(world_size),
      remote_(std::move(remote)),
      max_payload_(max_payload),
      frame_max_(std::max(kFrameTarget, kLenWords + sizeof(Header) + align8(max_payload))),
      pool_(std::make_shared<GlooOutPool>()),
      linger_(linger),
      bell_(bell),
      bulk_min_(bulk_bytes),
      bulk_next_(world_size, 0) {
  TORCH_CHECK_VALUE((int)remote_.size() == world_size_, "fastcomm: Gloo transport: bad peer list");
  peers_.reserve(world_size_);
  for (int r = 0; r < world_size_; ++r) peers_.push_back(std::make_unique<Peer>());
}

GlooTransport::~GlooTransport() {
  stop();
  // Our references to the process groups first, then the frames they may point into.
  for (auto& p : peers_) {
    std::lock_guard<std::mutex> lk(p->link_mu);
    p->pg.reset();
  }
  unfinished_.clear();
  bulk_unfinished_.clear();
  bulk_unfinished_bytes_.clear();
}

std::shared_ptr<GlooOutBuf> GlooTransport::new_frame() {
  GlooOutBuf* b = nullptr;
  {
    std::lock_guard<std::mutex> lk(pool_->mu);
    if (!pool_->free.empty()) {
      b = pool_->free.back().release();
      pool_->free.pop_back();
    }
  }
  if (!b) b = new GlooOutBuf(frame_max_);
  b->size = kLenWords;  // the length word is filled in when the frame is sent
  // The last owner is the reaper dropping a sent frame's tensor, or this thread for a frame
  // that was never sent; the pool outlives the transport if a frame Gloo holds does.
  return std::shared_ptr<GlooOutBuf>(b, [pool = pool_](GlooOutBuf* b) {
    std::unique_ptr<GlooOutBuf> own(b);
    std::lock_guard<std::mutex> lk(pool->mu);
    if (pool->free.size() < kPoolMax) pool->free.push_back(std::move(own));
  });
}

void GlooTransport::connect(int peer) {
  if (peer < 0 || peer >= world_size_ || !remote_[peer] || stop_) return;
  Peer& p = *peers_[peer];
  int none = 0;  // the engine and the connector's listener may ask at once
  if (p.link.load() != 0 || !p.link.compare_exchange_strong(none, 1)) return;
  p.asked_ns = std::chrono::steady_clock::now().time_since_epoch().count();
  {
    std::lock_guard<std::mutex> lk(want_mu_);
    want_.push_back(peer);
  }
  want_cv_.notify_all();
}

GlooWants GlooTransport::wanted(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lk(want_mu_);
  // Served until stop() is past its closing handshake: a peer leaving with data for this rank
  // (an abort notice) may ask for the connection while this rank leaves too.
  auto ready = [&] { return stop_.load() || !want_.empty() || look_; };
  if (timeout_ms < 0)
    want_cv_.wait(lk, ready);
  else
    want_cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready);
  GlooWants out;
  out.stopping = stop_.load();
  if (!out.stopping) {
    out.peers.swap(want_);
    out.look = look_;
  }
  look_ = false;
  return out;
}

void GlooTransport::look_for_asks() {
  {
    std::lock_guard<std::mutex> lk(want_mu_);
    if (look_ || stop_) return;
    look_ = true;
  }
  want_cv_.notify_all();
}

bool GlooTransport::attach(int peer, c10::intrusive_ptr<c10d::Backend> pg, int peer_rank) {
  TORCH_CHECK(peer >= 0 && peer < world_size_ && remote_[peer] && pg, "fastcomm: rank ", rank_,
              ": bad Gloo connection for rank ", peer);
  Peer& p = *peers_[peer];
  {
    std::lock_guard<std::mutex> lk(link_start_mu_);
    // Still during stop()'s handshake: data held for this peer must reach it (close_handshake).
    if (stop_ || p.link.load() != 1) return false;
    if (!reaper_.joinable()) {
      reaper_ = std::thread([this] { reap_main(); });
      pthread_setname_np(reaper_.native_handle(), "fc_gloo_reap");
    }
    {
      // Held frames and bulk sends go out first, in order; later ones follow them, since
      // senders take link_mu too until they see the link up.
      std::lock_guard<std::mutex> lk2(p.link_mu);
      p.pg = std::move(pg);
      p.prank = peer_rank;
      std::vector<Peer::Held> held;
      held.swap(p.held);
      for (auto& h : held) {
        if (h.frame) {
          const uint64_t words[2] = {h.frame->size, h.flags};
          std::memcpy(h.frame->data, words, kLenWords);
          post_frame(peer, h.frame);
        } else {
          post_held_bulk(peer, h.bulk);
        }
      }
      p.link = 2;
    }
    p.thread = std::thread([this, peer] { recv_main(peer); });
    pthread_setname_np(p.thread.native_handle(), "fc_gloo_recv");
  }
  {
    std::lock_guard<std::mutex> lk(close_mu_);  // stop() may wait for this connection
  }
  close_cv_.notify_all();
  connected_.fetch_add(1);
  send_cv_.notify_one();
  bell_.ring();
  return true;
}

void GlooTransport::attach_failed(int peer, const std::string& why) {
  if (peer < 0 || peer >= world_size_ || !remote_[peer]) return;
  mark_dead(peer, "connecting to rank " + std::to_string(peer) + " (Gloo) failed: " + why);
}

std::string GlooTransport::pending_reason(int peer) {
  const Peer& p = *peers_[peer];
  if (p.link.load() != 1 || p.dead) return "";
  const int64_t ns = std::chrono::steady_clock::now().time_since_epoch().count() - p.asked_ns.load();
  return "no connection to rank " + std::to_string(peer) + " yet (asked for " + std::to_string(ns / 1000000) +
         " ms ago; it has not answered: gone, or stalled)";
}

bool GlooTransport::try_send(int peer, const Header& hdr, const void* payload) {
  Peer& p = *peers_[peer];
  if (p.link.load(std::memory_order_relaxed) == 0) connect(peer);
  const size_t rec = sizeof(Header) + align8(hdr.len);
  TORCH_INTERNAL_ASSERT(kLenWords + rec <= frame_max_, "message of ", hdr.len,
                        " bytes exceeds the Gloo frame");
  if (p.out && p.out->size + rec > frame_max_) {
    // Sent before flush(): harmless (order is kept), and keeps every frame within the
    // receiver's posted buffers.
    flush_peer(peer);
    p.out.reset();
  }
  if (!p.out) p.out = new_frame();
  GlooOutBuf& b = *p.out;
  const size_t at = b.size;
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

bool GlooTransport::send_frame(int peer, const std::shared_ptr<GlooOutBuf>& b, uint64_t flags) {
  Peer& p = *peers_[peer];
  const uint64_t words[2] = {b->size, flags};
  std::memcpy(b->data, words, kLenWords);
  if (p.link.load() != 2) {
    std::lock_guard<std::mutex> lk(p.link_mu);
    if (p.link.load() != 2) {  // attach() sends it, before anything later
      p.held.push_back(Peer::Held{b, flags, nullptr});
      return true;
    }
  }
  return post_frame(peer, b);
}

bool GlooTransport::post_frame(int peer, const std::shared_ptr<GlooOutBuf>& b) {
  Peer& p = *peers_[peer];
  auto opts = at::TensorOptions().dtype(at::kByte);
  std::vector<at::Tensor> t{at::from_blob(b->data, {(int64_t)b->size}, [b](void*) {}, opts)};
  try {
    auto w = p.pg->send(t, p.prank, kFrameTag);
    peers_[peer]->frames_in_flight.fetch_add(1);
    std::lock_guard<std::mutex> lk(send_mu_);
    // Past the reaper's end nobody waits on it: it lives, unwaited, as long as the transport.
    if (reaper_done_) unfinished_.push_back(std::move(w));
    else sends_.push_back({peer, std::move(w)});
    return true;
  } catch (const std::exception& e) {
    mark_dead(peer, "Gloo send failed: " + what_of(e));
    return false;
  }
}

void GlooTransport::flush_peer(int peer) {
  Peer& p = *peers_[peer];
  if (!p.out || p.out->size <= kLenWords || stop_ || p.dead) return;  // dead: the engine fails the ops
  if (send_frame(peer, p.out, 0)) {
    ++frames_sent_;
    p.sent_data = true;
  }
}

void GlooTransport::send_control(int peer, uint64_t flags) {
  if (peers_[peer]->dead) return;
  if (send_frame(peer, new_frame(), flags)) send_cv_.notify_one();
}

const Message* GlooTransport::peek(int peer) {
  Peer& p = *peers_[peer];
  if (p.have) return &p.msg;
  if (p.link.load(std::memory_order_relaxed) == 0) connect(peer);
  if (!p.cur.buf.defined()) {
    if (p.ready.load(std::memory_order_acquire) == 0) return nullptr;
    std::lock_guard<std::mutex> lk(p.mu);
    p.cur = std::move(p.inbox.front());
    p.inbox.pop_front();
    p.ready.fetch_sub(1, std::memory_order_relaxed);
    p.pos = kLenWords;
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
    // Handed back to the receiver thread to post again: a fresh buffer would cost page faults
    // on every large frame. Beyond a window's worth, spare buffers are freed.
    std::lock_guard<std::mutex> lk(p.mu);
    if ((int)p.free.size() < kRecvWindow) p.free.push_back(std::move(p.cur.buf));
    p.cur = Frame{};
  }
}

// Gone, and every bulk transfer with it settled. The engine fails whatever it has not seen done
// once this says false; frames are published before the receiver reports the death, but a
// transfer the peer completed just before it went may still be on its waiter thread.
bool GlooTransport::peer_alive(int peer) {
  const Peer& p = *peers_[peer];
  return !p.dead.load() || p.bulk_in_flight.load() > 0;
}

size_t GlooTransport::bulk_min(int peer, bool more_ops) {
  if (!remote_[peer]) return SIZE_MAX;
  if (bulk_min_ != 0) return bulk_min_;
  // Busy: other ops go along with this one, or earlier traffic to the peer is still in
  // flight. (Not this pass's unsent frame: in a batch, the first op's bytes would then go as
  // a frame that the later ops' offers queue behind.)
  const Peer& p = *peers_[peer];
  const bool busy = more_ops || p.frames_in_flight.load() > 0 || p.bulk_in_flight.load() > 0;
  return busy ? kBulkBusyMin : kBulkIdleMin;
}

std::shared_ptr<Bulk> GlooTransport::send_bulk(int peer, at::Tensor bytes) {
  if (peers_[peer]->link.load(std::memory_order_relaxed) == 0) connect(peer);
  return start_bulk(peer, true, bulk_next_[peer]++, std::move(bytes), nullptr);
}

std::shared_ptr<Bulk> GlooTransport::recv_bulk(int peer, uint64_t slot, at::Tensor bytes, Bulk* with) {
  return start_bulk(peer, false, slot, std::move(bytes), with);
}

std::shared_ptr<Bulk> GlooTransport::start_bulk(int peer, bool send, uint64_t slot, at::Tensor bytes,
                                                Bulk* with) {
  Peer& p = *peers_[peer];
  if (p.link.load() != 2 && !stop_ && !p.dead) {
    // (Only a send can come first: a receive answers an offer, which came over the link.)
    std::lock_guard<std::mutex> lk(p.link_mu);
    if (p.link.load() != 2) {
      auto x = std::make_shared<BulkXfer>();
      x->slot = slot;
      x->peer = peer;
      x->send = send;
      x->bytes = std::move(bytes);
      p.held.push_back(Peer::Held{nullptr, 0, x});
      return x;
    }
  }
  c10::intrusive_ptr<c10d::Work> w;
  if (!stop_ && !p.dead) {
    try {
      std::vector<at::Tensor> v{bytes};
      w = send ? p.pg->send(v, p.prank, bulk_tag(slot)) : p.pg->recv(v, p.prank, bulk_tag(slot));
    } catch (const std::exception& e) {
      mark_dead(peer, (send ? "Gloo send to rank " : "Gloo receive from rank ") +
                          std::to_string(peer) + " failed: " + what_of(e));
    }
  }
  return watch_bulk(peer, send, std::move(w), std::move(bytes), slot, with);
}

void GlooTransport::drain_bulk(int peer, const Message& m) {
  BulkOffer offer;
  if (m.hdr.len != sizeof(offer) || !remote_[peer]) return;
  std::memcpy(&offer, m.data, sizeof(offer));
  // Nobody waits for it: its handle is dropped, its waiter thread lets the buffer go.
  recv_bulk(peer, offer.slot, at::empty({(int64_t)offer.bytes}, at::TensorOptions().dtype(at::kByte)),
            nullptr);
}

std::shared_ptr<Bulk> GlooTransport::watch_bulk(int peer, bool send, c10::intrusive_ptr<c10d::Work> w,
                                                at::Tensor bytes, uint64_t slot, Bulk* with) {
  auto x = std::make_shared<BulkXfer>();
  x->slot = slot;
  x->peer = peer;
  x->send = send;
  x->work = std::move(w);
  x->bytes = std::move(bytes);
  watch(x, with);
  return x;
}

void GlooTransport::post_held_bulk(int peer, const std::shared_ptr<BulkXfer>& x) {
  Peer& p = *peers_[peer];
  if (!stop_ && !p.dead) {
    try {
      std::vector<at::Tensor> v{x->bytes};
      x->work = p.pg->send(v, p.prank, bulk_tag(x->slot));
    } catch (const std::exception& e) {
      mark_dead(peer, "Gloo send to rank " + std::to_string(peer) + " failed: " + what_of(e));
    }
  }
  watch(x, nullptr);
}

void GlooTransport::watch(const std::shared_ptr<BulkXfer>& x, Bulk* with) {
  const int peer = x->peer;
  if (!x->work) {  // never started: the peer is dead (the engine fails the op) or we are stopping
    x->state.store(2, std::memory_order_release);
    return;
  }
  ++bulk_started_;
  std::lock_guard<std::mutex> lk(bulk_mu_);
  if (bulk_stop_) {
    abort_quietly(x->work);
    Released none;  // an aborted transfer keeps its references
    settle_bulk(*x, false, none);
    x->state.store(2, std::memory_order_release);
    return;
  }
  peers_[peer]->bulk_in_flight.fetch_add(1);
  bulk_live_.push_back(x);
  // mark_dead() aborts the live transfers of a peer after setting its flag: one registered
  // after that pass must be aborted here, or its waiter could wait for good.
  if (peers_[peer]->dead) abort_quietly(x->work);
  auto* joint = dynamic_cast<BulkXfer*>(with);
  if (joint && joint->peer == peer && !joint->waiter_left) {
    joint->then.push_back(x);
    return;
  }
  bulk_queue_.push_back(x);
  // One waiter per transfer: an idle one if there is one for it, else a new one.
  if (bulk_idle_ < (int)bulk_queue_.size()) bulk_threads_.emplace_back([this] { bulk_main(); });
  else bulk_cv_.notify_one();
}

void GlooTransport::settle_bulk(BulkXfer& x, bool ok, Released& release) {
  if (ok) {
    // Gloo is done with the memory: let go of it before the op sees the transfer done (the op
    // may recycle its scratch then, and only takes back buffers nobody else holds).
    release.works.push_back(std::move(x.work));
    release.tensors.push_back(std::move(x.bytes));
  } else {
    // Aborted (peer dead, or stopping) rather than completed: Gloo may still point into the
    // memory, so the work and the memory stay until the transport goes.
    bulk_unfinished_.push_back(x.work);
    bulk_unfinished_bytes_.push_back(x.bytes);
  }
}

void GlooTransport::bulk_main() {
  pthread_setname_np(pthread_self(), "fc_gloo_bulk");
  std::unique_lock<std::mutex> lk(bulk_mu_);
  for (;;) {
    ++bulk_idle_;
    bulk_cv_.wait(lk, [&] { return bulk_stop_ || !bulk_queue_.empty(); });
    --bulk_idle_;
    if (bulk_queue_.empty()) return;  // stopping, nothing left to wait on
    std::shared_ptr<BulkXfer> x = std::move(bulk_queue_.front());
    bulk_queue_.pop_front();
    while (x) {
      lk.unlock();
      bool ok = false;
      std::string err;
      try {
        ok = x->work->wait(kIdleWait);
      } catch (const std::exception& e) {
        err = what_of(e);
      }
      if (!ok && !err.empty() && !stop_)
        mark_dead(x->peer, x->send ? "Gloo send to rank " + std::to_string(x->peer) + " failed: " + err
                                   : "Gloo receive from rank " + std::to_string(x->peer) + " failed: " + err);
      Released release;
      lk.lock();
      bulk_live_.erase(std::remove(bulk_live_.begin(), bulk_live_.end(), x), bulk_live_.end());
      settle_bulk(*x, ok, release);
      if (!release.works.empty()) {
        // The references go before the op can see the transfer done: it takes its scratch
        // back for reuse only if nobody else holds it.
        lk.unlock();
        release = Released{};
        lk.lock();
      }
      x->state.store(ok ? 1 : 2, std::memory_order_release);
      peers_[x->peer]->bulk_in_flight.fetch_sub(1);  // after the state: see peer_alive
      std::shared_ptr<BulkXfer> next;
      if (!x->then.empty()) {
        next = std::move(x->then.front());
        x->then.pop_front();
        next->then = std::move(x->then);  // (a later joiner would have joined x: keep the order)
      }
      x->waiter_left = true;
      lk.unlock();
      x = std::move(next);
      lk.lock();
    }
    lk.unlock();
    // Once per chain: the op moves on only once all of it is over.
    if (!(bulk_hook_ && !stop_ && bulk_hook_())) bell_.ring();
    lk.lock();
  }
}

void GlooTransport::stop_bulk() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lk(bulk_mu_);
    bulk_stop_ = true;
    for (auto& x : bulk_live_) abort_quietly(x->work);
    threads.swap(bulk_threads_);
  }
  bulk_cv_.notify_all();
  for (auto& t : threads) t.join();
}

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
    // stop() may be waiting for this peer's answer to "closing".
    std::lock_guard<std::mutex> lk(close_mu_);
  }
  close_cv_.notify_all();
  {
    // The reaper may be waiting on a send to this peer that will never complete.
    std::lock_guard<std::mutex> lk(send_mu_);
    if (reaping_.work && reaping_.peer == peer) abort_quietly(reaping_.work);
  }
  {
    // So may bulk transfers with it.
    std::lock_guard<std::mutex> lk(bulk_mu_);
    for (auto& x : bulk_live_)
      if (x->peer == peer) abort_quietly(x->work);
  }
  bell_.ring();  // the engine's next health pass fails this peer's groups
}

c10::intrusive_ptr<c10d::Work> GlooTransport::post_recv(int peer, at::Tensor& t, int tag) {
  Peer& p = *peers_[peer];
  std::lock_guard<std::mutex> lk(p.mu);
  if (stop_) return {};
  std::vector<at::Tensor> v{t};
  auto w = p.pg->recv(v, p.prank, tag);
  p.posted.push_back(w);
  return w;
}

void GlooTransport::recv_main(int peer) {
  pthread_setname_np(pthread_self(), "fc_gloo_recv");
  Peer& p = *peers_[peer];
  auto opts = at::TensorOptions().dtype(at::kByte);
  std::deque<std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>>> window;
  auto forget = [&](const c10::intrusive_ptr<c10d::Work>& w) {
    std::lock_guard<std::mutex> lk(p.mu);
    p.posted.erase(std::remove(p.posted.begin(), p.posted.end(), w), p.posted.end());
  };
  auto post = [&] {
    at::Tensor t;
    {
      std::lock_guard<std::mutex> lk(p.mu);
      if (!p.free.empty()) {
        t = std::move(p.free.back());
        p.free.pop_back();
      }
    }
    if (!t.defined()) t = at::empty({(int64_t)frame_max_}, opts);
    auto w = post_recv(peer, t, kFrameTag);
    if (!w) return false;
    window.emplace_back(std::move(t), std::move(w));
    return true;
  };
  // Checks a frame as a whole before any of it is used, so a corrupt one fails the peer here
  // rather than in the engine's peek().
  auto check = [&](const uint8_t* base, uint64_t used, uint64_t flags) {
    TORCH_CHECK(used >= kLenWords && used <= frame_max_, "corrupt Gloo frame from rank ", peer,
                " (", used, " bytes)");
    TORCH_CHECK((flags & ~kCtlAll) == 0 && (flags == 0 || used == kLenWords),
                "corrupt Gloo frame from rank ", peer, " (flags ", flags, ")");
    for (uint64_t pos = kLenWords; pos < used;) {
      Header h;
      TORCH_CHECK(pos + sizeof(Header) <= used, "corrupt Gloo frame from rank ", peer);
      std::memcpy(&h, base + pos, sizeof(Header));
      pos += sizeof(Header) + align8(h.len);
      TORCH_CHECK(pos <= used, "corrupt Gloo frame from rank ", peer);
    }
  };
  std::string why;  // set once the connection failed
  try {
    for (int i = 0; i < kRecvWindow; ++i)
      if (!post()) return;
    bool can_post = true;
    while (!stop_ && !window.empty()) {
      auto [t, w] = std::move(window.front());
      window.pop_front();
      const bool ok = w->wait(kIdleWait);
      forget(w);
      if (stop_ || !ok) break;
      const uint8_t* base = t.data_ptr<uint8_t>();
      uint64_t words[2];
      std::memcpy(words, base, kLenWords);
      check(base, words[0], words[1]);
      if (words[1] & kCtlClose) {
        // Its engine is shut down: it needs nothing more from us (stop() need not wait for its
        // answer), and every frame it sent before this one has been read (frames arrive in
        // order), which is what our answer tells it, once its leaving can fail nothing here.
        p.peer_closing = true;
        answer_close(peer);
      }
      if (words[1] & kCtlCloseAck) p.close_acked = true;
      if (words[1]) {
        std::lock_guard<std::mutex> lk(close_mu_);
        close_cv_.notify_all();
      }
      if (words[0] > kLenWords) {
        {
          std::lock_guard<std::mutex> lk(p.mu);
          p.inbox.push_back(Frame{std::move(t), words[0]});
        }
        p.ready.fetch_add(1, std::memory_order_release);
      }
      // First the pass that uses the frame, on this thread as a bulk waiter's is (a driver
      // asleep for it would cost a wake-up), or, if another thread is in a pass, a ring. Only
      // then the receive that replaces it: posting goes through Gloo (and its lock on the
      // connection, which the loop thread holds while it moves data), and in a traced case on
      // a busy machine it took over 2 ms, which a driver asleep for this frame waited out too.
      // The rest of the window stays posted meanwhile, so the sender need not wait for this one.
      if (!(words[0] > kLenWords && bulk_hook_ && !stop_ && bulk_hook_())) bell_.ring();
      // Posting fails once the peer has left (it sent its last frames and closed); what had
      // arrived by then (this frame, and any others the window completed) still reaches the
      // engine before the peer is declared dead.
      bool stopping = false;
      if (can_post) {
        try {
          stopping = !post();
        } catch (const std::exception& e) {
          can_post = false;
          why = "Gloo receive from rank " + std::to_string(peer) + " failed: " + what_of(e);
        }
      }
      if (stopping) break;
    }
  } catch (const std::exception& e) {
    if (why.empty()) why = "Gloo receive from rank " + std::to_string(peer) + " failed: " + what_of(e);
  }
  if (!why.empty() && !stop_) mark_dead(peer, why);
}

void GlooTransport::answer_close(int peer) {
  // The closer waits kCloseWait for the answer, then closes anyway: past that, asking is moot.
  // (Polled: a close comes once per peer and job, and the engine may be idle, with no pass
  // that could answer instead.)
  const auto until = std::chrono::steady_clock::now() + kCloseWait;
  for (;;) {
    if (stop_ || closing_flag_.load() || !close_gate_) break;
    if (close_gate_(peer) == 0) break;
    if (std::chrono::steady_clock::now() >= until) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  send_control(peer, kCtlCloseAck);
}

void GlooTransport::reap_main() {
  pthread_setname_np(pthread_self(), "fc_gloo_reap");
  std::unique_lock<std::mutex> lk(send_mu_);
  for (;;) {
    send_cv_.wait(lk, [&] { return stop_ || !sends_.empty(); });
    if (sends_.empty()) break;  // stopping, nothing left
    InFlight f = std::move(sends_.front());
    sends_.pop_front();
    // A frame to a peer already declared dead can never be delivered: drop it unwaited.
    if (peers_[f.peer]->dead) {
      peers_[f.peer]->frames_in_flight.fetch_sub(1);
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
        sent = f.work->wait(kIdleWait);
      }
    } catch (const std::exception& e) {
      if (!stop_) mark_dead(f.peer, "Gloo send to rank " + std::to_string(f.peer) + " failed: " + what_of(e));
    }
    peers_[f.peer]->frames_in_flight.fetch_sub(1);
    lk.lock();
    reaping_ = InFlight{-1, {}};
    if (!sent) unfinished_.push_back(f.work);
    f.work.reset();  // a completed send drops its frame here
  }
  reaper_done_ = true;
  reaper_done_cv_.notify_all();
}

void GlooTransport::close_handshake() {
  // Only peers that got data from us can lose some; the others need nothing from us. Sending
  // "closing" to a peer that has no receiver for us (it made no group with us) would wait out
  // the linger, but then it never used our data either, and so it is not asked.
  const auto until = std::min(stop_deadline_, std::chrono::steady_clock::now() + kCloseWait);
  {
    // Data held for a peer whose connection is still being made (this rank failed an op early
    // and leaves: the op's message, the abort notice) must reach it, or the peer waits out its
    // timeout instead of failing on them: the connector attaches it meanwhile.
    std::unique_lock<std::mutex> lk(close_mu_);
    close_cv_.wait_until(lk, until, [&] {
      for (int r = 0; r < world_size_; ++r) {
        const Peer& p = *peers_[r];
        if (p.link.load() == 1 && p.sent_data && !p.dead) return false;
      }
      return true;
    });
  }
  std::vector<int> waiting;
  for (int r = 0; r < world_size_; ++r) {
    Peer& p = *peers_[r];
    if (p.link.load() != 2 || !p.sent_data || p.dead || p.peer_closing) continue;
    send_control(r, kCtlClose);
    ++closes_sent_;
    waiting.push_back(r);
  }
  if (waiting.empty()) return;
  std::unique_lock<std::mutex> lk(close_mu_);
  close_cv_.wait_until(lk, until, [&] {
    for (int r : waiting) {
      const Peer& p = *peers_[r];
      // A peer that is closing too may already have stopped its receiver (it had our answer
      // to its own "closing"), and needs nothing from us.
      if (!p.close_acked && !p.peer_closing && !p.dead) return false;
    }
    return true;
  });
}

void GlooTransport::stop() {
  {
    std::lock_guard<std::mutex> lk(send_mu_);
    if (stop_ || closing_) return;
    // In all, not per send: a dead peer fails its sends at once, a stalled one costs this once.
    stop_deadline_ = std::chrono::steady_clock::now() + linger_;
    closing_ = true;
    closing_flag_ = true;
  }
  // Receivers keep running meanwhile: they answer peers that close too, and bring our answers.
  close_handshake();
  {
    std::lock_guard<std::mutex> lk(send_mu_);
    stop_ = true;
  }
  {
    // No connection is attached from here on (one being attached finishes first), and the
    // connector stops asking.
    std::lock_guard<std::mutex> lk(link_start_mu_);
  }
  {
    std::lock_guard<std::mutex> lk(want_mu_);
  }
  want_cv_.notify_all();
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
  // Bulk transfers still in flight belong to ops that failed or were abandoned (an op is
  // done only once its transfers are): nobody waits for them.
  stop_bulk();
  for (auto& pp : peers_) {
    Peer& p = *pp;
    std::lock_guard<std::mutex> lk(p.mu);
    for (auto& w : p.posted) abort_quietly(w);
  }
  for (auto& pp : peers_)
    if (pp->thread.joinable()) pp->thread.join();
}

std::map<std::string, uint64_t> GlooTransport::counters() {
  return {{"frames_sent", frames_sent()},
          {"closes_sent", closes_sent()},
          {"connected", connected()},
          {"bulk_started", bulk_started()},
          {"bulk_live", bulk_live()},
          {"frames_unreaped", frames_unreaped()}};
}

}  // namespace fastcomm
