#include <pthread.h>

#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "transport/gloo/internal.h"

namespace fastcomm {

using namespace gloo_wire;

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

}  // namespace fastcomm
