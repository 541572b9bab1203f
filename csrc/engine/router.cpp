#include "engine/router.h"

namespace fastcomm {

const Message* MessageRouter::peek(const GroupState& g, uint64_t seq, int peer, bool scan) {
  if (stash_msgs_) {
    auto it = stash_.find(Key{g.id, seq, peer});
    if (it != stash_.end() && !it->second.empty()) return &it->second.front().msg;
  }
  Transport* tr = tr_.of(peer);
  while (const Message* m = tr->peek(peer)) {
    if (m->hdr.group == g.id && m->hdr.seq == seq) return m;
    if (!scan) return nullptr;
    if (stale(*m)) {
      discard(tr, peer, *m);
      continue;
    }
    if (defer_) {
      const GroupState* owner = groups_.find(m->hdr.group);
      if (owner != nullptr && owner != &g && !owner->queue.empty() && owner->head_seq == m->hdr.seq) {
        deferred_ = true;
        return nullptr;
      }
    }
    auto& q = stash_[Key{m->hdr.group, m->hdr.seq, peer}];
    q.emplace_back();
    Stashed& s = q.back();
    s.bytes.assign(m->data, m->data + m->hdr.len);
    s.msg.hdr = m->hdr;
    s.msg.data = s.bytes.data();
    ++stash_msgs_;
    tr->pop(peer);
  }
  return nullptr;
}

// An offer nobody will take: its sender's transfer waits for a receive (Gloo cannot cancel it),
// holding the sender's memory and a thread, so it is received into nothing.
void MessageRouter::discard(Transport* tr, int peer, const Message& m) {
  if (m.hdr.flags & kMsgBulk) tr->drain_bulk(peer, m);
  tr->pop(peer);
}

void MessageRouter::pop(const GroupState& g, uint64_t seq, int peer, bool drop) {
  if (stash_msgs_) {
    auto it = stash_.find(Key{g.id, seq, peer});
    if (it != stash_.end() && !it->second.empty()) {
      if (drop && (it->second.front().msg.hdr.flags & kMsgBulk))
        tr_.of(peer)->drain_bulk(peer, it->second.front().msg);
      it->second.pop_front();
      if (it->second.empty()) stash_.erase(it);
      --stash_msgs_;
      return;
    }
  }
  Transport* tr = tr_.of(peer);
  if (drop) {
    if (const Message* m = tr->peek(peer)) discard(tr, peer, *m);
    return;
  }
  tr->pop(peer);
}

void MessageRouter::purge(const GroupState& g, uint64_t seq) {
  if (!stash_msgs_) return;
  for (int r : g.ranks) {
    auto it = stash_.find(Key{g.id, seq, r});
    if (it == stash_.end()) continue;
    for (auto& s : it->second)
      if (s.msg.hdr.flags & kMsgBulk) tr_.of(r)->drain_bulk(r, s.msg);
    stash_msgs_ -= it->second.size();
    stash_.erase(it);
  }
}

// A failed op leaves pieces in flight: peers may have written some of it before they learnt of
// the failure. The group's next op drops them as it peeks, but an op that must send first can
// be stuck behind a full ring whose owner is stuck the same way; so a group whose front op
// cannot move drops whatever stale messages head its peers' streams.
bool MessageRouter::drop_stale(const GroupState& g, int self) {
  bool any = false;
  for (int r : g.ranks) {
    if (r == self) continue;
    Transport* tr = tr_.of(r);
    if (!tr->linked(r)) continue;
    while (const Message* m = tr->peek(r)) {
      const GroupState* owner = groups_.find(m->hdr.group);
      if (owner == nullptr || m->hdr.seq >= owner->head_seq) break;
      discard(tr, r, *m);
      any = true;
    }
  }
  return any;
}

void MessageRouter::clear() {
  stash_.clear();
  stash_msgs_ = 0;
}

}  // namespace fastcomm
