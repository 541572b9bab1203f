#include "transport/gloo/transport.h"

#include <ATen/ATen.h>

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/errors.h"
#include "transport/gloo/internal.h"

namespace fastcomm {

using namespace gloo_wire;

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
