// A pair channel's same-host transport (device/ipc_link.h), and the Runtime's defaults for a
// runtime without one.
#include "device/ipc_link.h"

#include <algorithm>
#include <cstring>

#include "common/errors.h"

namespace fastcomm {
namespace device {

namespace {

constexpr uint32_t kTag = 0x4C435049;  // "IPCL": the id is a link's, not an NCCL unique id

// The channel id of a link: its ring's geometry and the runtime's handle.
struct Wire {
  uint32_t tag;
  uint16_t slots;
  uint16_t flags;  // WireFlags
  uint64_t slot_bytes;
  Runtime::IpcHandle handle;
};
enum WireFlags : uint16_t {
  kHostRing = 1,  // the ring is in host memory
  kAskHost = 2,   // follower: it cannot read the leader's ring; send it again in host memory
  kRehosted = 4,  // leader: this epoch's ring again, in host memory (no new link)
};
Wire wire_of(const UniqueId& id) {
  Wire w;
  std::memcpy(&w, id.bytes.data(), sizeof(w));
  return w;
}
static_assert(sizeof(Wire) == sizeof(UniqueId), "an IPC link's id fills a communicator id");

// Flags of a ring: filled[K], consumed[K], then what the opener says (it closed, it opened,
// it ended the link) and what the owner says (it ended the link; the chunks it enqueued, sent
// and received; it released a send still waiting for room, so what it wrote since may be
// garbage). Host words that no stream waits on are plain stores.
size_t closed_flag(uint32_t k) { return 2 * (size_t)k; }
size_t opened_flag(uint32_t k) { return 2 * (size_t)k + 1; }
size_t opener_ended_flag(uint32_t k) { return 2 * (size_t)k + 2; }
size_t owner_ended_flag(uint32_t k) { return 2 * (size_t)k + 3; }
size_t tx_enqueued_flag(uint32_t k) { return 2 * (size_t)k + 4; }
size_t garbage_flag(uint32_t k) { return 2 * (size_t)k + 5; }
size_t rx_enqueued_flag(uint32_t k) { return 2 * (size_t)k + 6; }
constexpr int kExtraFlags = 7;

// Whether counter `have` has reached `want` (cyclic: the counters are 32-bit words).
bool reached(uint32_t have, uint64_t want) { return (int32_t)(have - (uint32_t)want) >= 0; }

uint32_t load(const uint32_t* f) { return __atomic_load_n(f, __ATOMIC_ACQUIRE); }
void store(uint32_t* f, uint32_t v) { __atomic_store_n(f, v, __ATOMIC_RELEASE); }

}  // namespace

void* Runtime::ipc_create(size_t, int, IpcHandle*, IpcBlock*, bool) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime has no same-host IPC");
}
bool Runtime::ipc_readable(const IpcHandle&) { return true; }
void* Runtime::ipc_open(const IpcHandle&, IpcBlock*, const IpcClaim&) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime has no same-host IPC");
}
void Runtime::ipc_close(void*) {}
void Runtime::flag_write(uint32_t*, uint32_t, Stream) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime has no stream flags");
}
void Runtime::flag_wait(Stream, const uint32_t*, uint32_t) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime has no stream flags");
}
void Runtime::copy_flag(void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value, Stream s) {
  copy(dst, src, bytes, s);
  flag_write(flag, value, s);
}
void Runtime::fold_flag(const FoldJob& job, uint32_t* flag, uint32_t value, Stream s) {
  fold(&job, 1, s);
  flag_write(flag, value, s);
}
void Runtime::flag_set(uint32_t*, uint32_t) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime has no stream flags");
}

IpcLink::IpcLink(Runtime& rt, int peer, uint32_t epoch, size_t ring_bytes, uint32_t slots, bool host, bool fixed)
    : rt_(rt), peer_(peer), epoch_(epoch), fixed_(fixed), slots_(std::min<uint32_t>(std::max<uint32_t>(slots, 1), 0xffff)) {
  // Slots of whole 256-byte lines, so every chunk of a tensor stays aligned for the copies.
  slot_bytes_ = std::max<size_t>(256, (ring_bytes / slots_) & ~size_t(255));
  make_own(host, 0);
  tx_wait_.assign(slots_, 0);
  // Every slot free before the peer can see the ring (its id is not out yet).
  if (fixed_)
    for (uint32_t k = 0; k < slots_; ++k) rt_.flag_set(own_flag(slots_ + k), 1);
}

void IpcLink::make_own(bool host, uint16_t flags) {
  Wire w{};
  w.tag = kTag;
  w.slots = (uint16_t)slots_;
  w.flags = (uint16_t)(flags | (host ? kHostRing : 0));
  w.slot_bytes = slot_bytes_;
  RelaxedCapture relaxed(rt_);  // see close_peer
  own_token_ = rt_.ipc_create(slots_ * slot_bytes_, (int)(2 * slots_ + kExtraFlags), &w.handle, &own_, host);
  host_ = host;
  std::memcpy(id_.bytes.data(), &w, sizeof(w));
}

bool IpcLink::is_host(const UniqueId& id) { return (wire_of(id).flags & kHostRing) != 0; }
bool IpcLink::asks_host(const UniqueId& id) { return (wire_of(id).flags & kAskHost) != 0; }
bool IpcLink::is_rehosted(const UniqueId& id) { return (wire_of(id).flags & kRehosted) != 0; }
bool IpcLink::readable(Runtime& rt, const UniqueId& id) { return rt.ipc_readable(wire_of(id).handle); }

void IpcLink::ask_host() {
  Wire w = wire_of(id_);
  w.flags |= kAskHost;
  std::memcpy(id_.bytes.data(), &w, sizeof(w));
}

void IpcLink::rehost() {
  TORCH_INTERNAL_ASSERT(tx_seq_ == 0 && rx_seq_ == 0 && peer_token_ == nullptr, "IPC ring moved after use");
  // Nobody opened the device ring (the peer could not): closing it unlinks its name.
  RelaxedCapture relaxed(rt_);  // see close_peer
  rt_.ipc_close(own_token_);
  own_token_ = nullptr;
  own_ = Runtime::IpcBlock{};
  make_own(/*host=*/true, kRehosted);
}

IpcLink::~IpcLink() {
  abort();
  close_peer();
  if (own_token_ == nullptr) return;
  RelaxedCapture relaxed(rt_);  // see close_peer
  rt_.ipc_close(own_token_);
}

bool IpcLink::is_ipc(const UniqueId& id) {
  uint32_t tag;
  std::memcpy(&tag, id.bytes.data(), sizeof(tag));
  return tag == kTag;
}

void IpcLink::open_peer(const UniqueId& id) {
  TORCH_INTERNAL_ASSERT(peer_token_ == nullptr, "IPC link opened twice");
  const Wire w = wire_of(id);
  TORCH_INTERNAL_ASSERT(w.tag == kTag && w.slots > 0 && w.slot_bytes > 0, "not an IPC link id");
  // The claim: the owner frees a ring nobody claimed once it has ended the link (IpcLinks::poll),
  // and a ring it has ended is not mapped here. Each side stores its word, fences, then reads
  // the other's, so whichever comes second sees the first: the ring is never freed under a
  // mapping, nor kept for an opener that will never come.
  const uint32_t k = w.slots;
  Runtime::IpcClaim claim;
  claim.give_back = [k](uint32_t* f) { store(f + closed_flag(k), 1); };  // not mapped: the owner may free it
  claim.take = [k, give_back = claim.give_back](uint32_t* f) {
    __atomic_store_n(f + opened_flag(k), 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(f + owner_ended_flag(k), __ATOMIC_SEQ_CST) == 0) return true;
    give_back(f);  // ended: it is not mapped here
    return false;
  };
  Runtime::IpcBlock b;
  RelaxedCapture relaxed(rt_);  // see close_peer
  peer_token_ = rt_.ipc_open(w.handle, &b, claim);
  theirs_ = b;
  peer_slots_ = w.slots;
  peer_slot_bytes_ = w.slot_bytes;
  rx_wait_.assign(peer_slots_, 0);
}

void IpcLink::start_at(uint64_t chunks) {
  TORCH_INTERNAL_ASSERT(!fixed_ && ready() && tx_seq_ == 0 && rx_seq_ == 0 && slots_ == peer_slots_,
                        "start_at on a link that is not an unused eager one");
  for (uint32_t k = 0; k < slots_; ++k) {
    const uint32_t uses = (uint32_t)(chunks / slots_ + (k < chunks % slots_ ? 1 : 0));
    store(own_flag(k), uses);           // filled by this side
    store(own_flag(slots_ + k), uses);  // consumed by the peer
  }
  store(own_flag(tx_enqueued_flag(slots_)), (uint32_t)chunks);
  store(own_flag(rx_enqueued_flag(slots_)), (uint32_t)chunks);
  tx_seq_ = rx_seq_ = chunks;
}

size_t IpcLink::add(const Part& p, Stream s) {
  TORCH_INTERNAL_ASSERT(ready(), "IPC link used before the peer's ring was mapped");
  TORCH_INTERNAL_ASSERT(stream_ == nullptr || stream_ == s, "an IPC link's parts go on one stream");
  stream_ = s;
  // Folding chunk i in place is right only once chunk i of the tensor was sent, which the order
  // below (send chunk i, then receive chunk i) gives where both rings are cut alike.
  const bool in_ring = p.fold_in_ring && p.recvs.size() == 1 && p.sends.size() == 1 &&
                       peer_slot_bytes_ == slot_bytes_ && p.sends[0].second == p.recvs[0].second;
  size_t folded = 0;
  struct Cursor {
    size_t buf = 0, off = 0;
  } cs, cr;
  auto next_send = [&]() -> bool {
    const auto& v = p.sends;
    while (cs.buf < v.size() && cs.off >= v[cs.buf].second) cs.buf++, cs.off = 0;
    if (cs.buf == v.size()) return false;
    Step st;
    st.tx = true;
    st.src = (const uint8_t*)v[cs.buf].first + cs.off;
    st.n = std::min(slot_bytes_, v[cs.buf].second - cs.off);
    cs.off += st.n;
    steps_.push_back(st);
    return true;
  };
  auto next_recv = [&]() -> bool {
    const auto& v = p.recvs;
    while (cr.buf < v.size() && cr.off >= v[cr.buf].second) cr.buf++, cr.off = 0;
    if (cr.buf == v.size()) return false;
    Step st;
    st.n = std::min(peer_slot_bytes_, v[cr.buf].second - cr.off);
    st.dst = (uint8_t*)v[cr.buf].first + cr.off;
    if (in_ring) {
      st.in_ring = true;
      st.fold = p.ring_fold;
      st.fold.dst = (uint8_t*)st.fold.dst + cr.off;
      st.fold.own = (const uint8_t*)st.fold.own + cr.off;
      st.fold.numel = (int64_t)(st.n / c10::elementSize(st.fold.dtype));
      folded += st.n;
    }
    cr.off += st.n;
    steps_.push_back(st);
    return true;
  };
  // Chunk i of the part's sends, then chunk i of its receives (the order ipc_link.h argues from).
  const size_t before = steps_.size();
  for (;;) {
    const bool a = next_send();
    const bool b = next_recv();
    if (!a && !b) break;
  }
  steps_added_ += steps_.size() - before;
  part_ends_.push_back(steps_added_);
  return folded;
}

size_t IpcLink::pump() {
  if (!steps_.empty()) {
    // What the peer has enqueued: its sends of the chunks this side receives, and its receives of
    // the chunks this side sends.
    const uint32_t peer_tx = load(theirs_.flags + tx_enqueued_flag(peer_slots_));
    const uint32_t peer_rx = load(theirs_.flags + rx_enqueued_flag(peer_slots_));
    const uint64_t tx0 = tx_seq_, rx0 = rx_seq_;
    while (!steps_.empty()) {
      const Step& st = steps_.front();
      if (st.tx) {
        // Chunk tx_seq_ reuses the slot of chunk tx_seq_ - K, which the peer's receive of that
        // chunk frees.
        if (tx_seq_ >= slots_ && !reached(peer_rx, tx_seq_ - slots_ + 1)) break;
        enqueue_tx(st);
      } else {
        if (!reached(peer_tx, rx_seq_ + 1)) break;
        enqueue_rx(st);
      }
      steps_.pop_front();
      ++steps_done_;
    }
    if (tx_seq_ != tx0) store(own_flag(tx_enqueued_flag(slots_)), (uint32_t)tx_seq_);
    if (rx_seq_ != rx0) store(own_flag(rx_enqueued_flag(slots_)), (uint32_t)rx_seq_);
  }
  size_t parts = 0;
  while (!part_ends_.empty() && part_ends_.front() <= steps_done_) {
    part_ends_.pop_front();
    ++parts;
  }
  return parts;
}

void IpcLink::enqueue_tx(const Step& st) {
  const uint32_t k = (uint32_t)(tx_seq_ % slots_);
  // The flags hold the use modulo 2^32 (the waits compare cyclically); whether a use is the
  // slot's first is decided on the full count, which never wraps.
  const uint64_t use64 = tx_seq_ / slots_ + 1;
  const uint32_t use = (uint32_t)use64;
  ++tx_seq_;
  // A wait the host sees met already is left off: the peer's stream wrote the flag once its
  // read of the slot was done, and this side's copy is enqueued after that.
  if (use64 > 1) {
    if (!reached(load(own_flag(slots_ + k)), use - 1)) rt_.flag_wait(stream_, own_flag(slots_ + k), use - 1);
    tx_wait_[k] = use64 - 1;
  }
  uint8_t* slot = (uint8_t*)own_.data + (size_t)k * slot_bytes_;
  if (fused(st.n)) {
    rt_.copy_flag(slot, st.src, st.n, own_flag(k), use, stream_);
  } else {
    rt_.copy(slot, st.src, st.n, stream_);
    rt_.flag_write(own_flag(k), use, stream_);
  }
}

void IpcLink::enqueue_rx(const Step& st) {
  const uint32_t k = (uint32_t)(rx_seq_ % peer_slots_);
  const uint64_t use64 = rx_seq_ / peer_slots_ + 1;
  const uint32_t use = (uint32_t)use64;
  ++rx_seq_;
  // (Left off where the host sees the chunk there already: the peer's stream wrote the flag
  // after the chunk's data was visible.)
  if (!skip_rx_waits) {
    if (!reached(load(peer_flag(k)), use)) rt_.flag_wait(stream_, peer_flag(k), use);
    rx_wait_[k] = use64;
  }
  const uint8_t* chunk = (const uint8_t*)theirs_.data + (size_t)k * peer_slot_bytes_;
  uint32_t* consumed = peer_flag(peer_slots_ + k);
  FoldJob j = st.fold;
  j.scratch = chunk;
  if (fused(st.n)) {
    if (st.in_ring) rt_.fold_flag(j, consumed, use, stream_);
    else rt_.copy_flag(st.dst, chunk, st.n, consumed, use, stream_);
    return;
  }
  if (st.in_ring) rt_.fold(&j, 1, stream_);
  else rt_.copy(st.dst, chunk, st.n, stream_);
  rt_.flag_write(consumed, use, stream_);
}

void IpcLink::emit_fixed(const Part& p, Stream s) {
  TORCH_INTERNAL_ASSERT(fixed_ && ready(), "emit_fixed on a link that is not a ready fixed one");
  // Both directions are cut alike, chunk i of the sends then chunk i of the receives, as add()
  // does: the order the graph's no-deadlock argument needs (docs/design.md, "CUDA graphs").
  const auto& tx = p.sends;
  const auto& rx = p.recvs;
  size_t ti = 0, toff = 0, ri = 0, roff = 0;
  for (;;) {
    while (ti < tx.size() && toff >= tx[ti].second) ++ti, toff = 0;
    while (ri < rx.size() && roff >= rx[ri].second) ++ri, roff = 0;
    if (ti == tx.size() && ri == rx.size()) break;
    if (ti < tx.size()) {
      const size_t n = std::min(slot_bytes_, tx[ti].second - toff);
      const uint32_t k = (uint32_t)(tx_seq_++ % slots_);
      uint32_t* free_flag = own_flag(slots_ + k);
      rt_.flag_wait(s, free_flag, 1);
      rt_.flag_write(free_flag, 0, s);
      rt_.copy((uint8_t*)own_.data + (size_t)k * slot_bytes_, (const uint8_t*)tx[ti].first + toff, n, s);
      rt_.flag_write(own_flag(k), 1, s);
      toff += n;
    }
    if (ri < rx.size()) {
      const size_t n = std::min(peer_slot_bytes_, rx[ri].second - roff);
      const uint32_t k = (uint32_t)(rx_seq_++ % peer_slots_);
      uint32_t* full_flag = peer_flag(k);
      rt_.flag_wait(s, full_flag, 1);
      rt_.flag_write(full_flag, 0, s);
      rt_.copy((uint8_t*)rx[ri].first + roff, (const uint8_t*)theirs_.data + (size_t)k * peer_slot_bytes_, n, s);
      rt_.flag_write(peer_flag(peer_slots_ + k), 1, s);
      roff += n;
    }
  }
}

void IpcLink::release_fixed() {
  // The flags this side's streams wait on: its sends' free flags, its receives' full flags.
  if (own_token_ != nullptr)
    for (uint32_t k = 0; k < slots_; ++k) rt_.flag_set(own_flag(slots_ + k), 1);
  if (peer_token_ != nullptr)
    for (uint32_t k = 0; k < peer_slots_; ++k) rt_.flag_set(peer_flag(k), 1);
}

void IpcLink::end_fixed(bool failed) {
  if (own_token_ != nullptr) {
    if (failed) store(own_flag(garbage_flag(slots_)), 1);
    __atomic_store_n(own_flag(owner_ended_flag(slots_)), 1, __ATOMIC_SEQ_CST);  // the claim's other half
  }
  if (peer_token_ != nullptr) store(peer_flag(opener_ended_flag(peer_slots_)), 1);
  if (failed) release_fixed();
}

void IpcLink::abort() {
  if (fixed_) return end_fixed(/*failed=*/false);
  // First the peer is told: data its receives get from here on may be garbage (this side's
  // sends stop waiting for room), so it trusts none it sees complete after this.
  if (own_token_ != nullptr) {
    // A send still waiting for room, once released, overwrites chunks the peer has not read.
    bool garbage = false;
    for (uint32_t k = 0; k < slots_; ++k)
      garbage = garbage || (tx_wait_[k] != 0 && !reached(load(own_flag(slots_ + k)), tx_wait_[k]));
    if (garbage) store(own_flag(garbage_flag(slots_)), 1);
    __atomic_store_n(own_flag(owner_ended_flag(slots_)), 1, __ATOMIC_SEQ_CST);  // the claim's other half
  }
  if (peer_token_ != nullptr) store(peer_flag(opener_ended_flag(peer_slots_)), 1);
  steps_.clear();  // never enqueued: their parts fail with the epoch
  part_ends_.clear();
  // A released wait leaves the flag at the value it waited for: cyclic-later values stay. The
  // peer's stream may still write an older value over it (a write it enqueued earlier): the
  // release is repeated until this side's stream has drained (IpcLinks::poll).
  auto release = [&](uint32_t* f, uint64_t v) {
    if (v == 0) return;
    if (!reached(__atomic_load_n(f, __ATOMIC_ACQUIRE), v)) rt_.flag_set(f, (uint32_t)v);
  };
  if (own_token_ != nullptr)
    for (uint32_t k = 0; k < slots_; ++k) release(own_flag(slots_ + k), tx_wait_[k]);
  if (peer_token_ != nullptr)
    for (uint32_t k = 0; k < peer_slots_; ++k) release(peer_flag(k), rx_wait_[k]);
}

void IpcLink::close_peer() {
  if (peer_token_ == nullptr) return;
  // Mapping, registering and freeing are calls a user's capture in CUDA's global mode (on any
  // thread) refuses, and is invalidated by, unless the calling thread is in the relaxed mode;
  // a link is made and let go on whatever thread fastcomm has at hand.
  RelaxedCapture relaxed(rt_);
  rt_.ipc_close_data(peer_token_);  // first: the owner frees its ring once it sees the flag
  rt_.flag_set(peer_flag(closed_flag(peer_slots_)), 1);
  rt_.ipc_close(peer_token_);
  peer_token_ = nullptr;
  theirs_ = Runtime::IpcBlock{};
}

bool IpcLink::peer_opened() const {
  return __atomic_load_n(own_.flags + opened_flag(slots_), __ATOMIC_ACQUIRE) != 0;
}

bool IpcLink::peer_ended() const {
  return __atomic_load_n(own_.flags + opener_ended_flag(slots_), __ATOMIC_ACQUIRE) != 0 ||
         (peer_token_ != nullptr && __atomic_load_n(theirs_.flags + owner_ended_flag(peer_slots_), __ATOMIC_ACQUIRE) != 0);
}

bool IpcLink::peer_garbage() const {
  return peer_token_ != nullptr && load(theirs_.flags + garbage_flag(peer_slots_)) != 0;
}

bool IpcLink::peer_done() const {
  return __atomic_load_n(own_.flags + closed_flag(slots_), __ATOMIC_ACQUIRE) != 0;
}

// ---------------------------------------------------------------------------------------------

Comm IpcLinks::add(std::unique_ptr<IpcLink> l) {
  Comm c = l.get();
  l->skip_rx_waits = skip_rx_waits_.load();
  l->fuse_bytes = fuse_bytes_.load();
  ++blocks_;
  ++made_;
  bytes_ += (int64_t)l->ring_bytes();
  if (l->host()) ++host_rings_;
  live_[c] = std::move(l);
  return c;
}

void IpcLinks::end(Comm c, EventPtr drained) {
  auto it = live_.find(c);
  TORCH_INTERNAL_ASSERT(it != live_.end(), "unknown IPC link");
  Closing x;
  x.link = std::move(it->second);
  live_.erase(it);
  x.link->abort();
  x.drained = std::move(drained);
  closing_.push_back(std::move(x));
}

void IpcLinks::retire(std::unique_ptr<IpcLink> l) {
  ++blocks_;  // counted until poll() lets it go, as a channel's
  bytes_ += (int64_t)l->ring_bytes();
  Closing x;
  x.link = std::move(l);
  closing_.push_back(std::move(x));
}

bool IpcLinks::poll(const std::function<bool(int)>& peer_alive) {
  if (closing_.empty()) return false;
  // After each link's end (IpcLink::abort) and before its claim word is read: a peer that has
  // not claimed the ring by now never maps it (IpcLink::open_peer).
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  for (size_t i = 0; i < closing_.size();) {
    Closing& x = closing_[i];
    if (x.drained && rt_.query(x.drained->ev) != State::kReady) {
      x.link->abort();  // again: a wait released once may have been set back by the peer's stream
      ++i;
      continue;
    }
    x.drained.reset();
    x.link->close_peer();
    const bool done = x.link->peer_done() || !peer_alive(x.link->peer()) || !x.link->peer_opened();
    if (!done) {
      ++i;
      continue;
    }
    gone(*x.link);
    if (offload_) {
      std::shared_ptr<IpcLink> l(std::move(x.link));
      offload_([l]() mutable { l.reset(); });  // its destructor frees the ring, on that thread
    }
    closing_.erase(closing_.begin() + (long)i);
  }
  return !closing_.empty();
}

void IpcLinks::close_all(const std::function<bool(int)>& peer_alive) {
  auto keep_if_read = [&](IpcLink& l) {
    gone(l);
    l.abort();  // (again, or first for a live one: the peer is told, this side's waits released)
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  // as in poll(): after the end, before the claim is read
    if (still_read(l, peer_alive)) {
      l.keep_own_ring();
      ++kept_;
    }
  };
  for (auto& [c, l] : live_) keep_if_read(*l);
  for (auto& x : closing_) keep_if_read(*x.link);
  live_.clear();
  closing_.clear();
}

}  // namespace device
}  // namespace fastcomm
