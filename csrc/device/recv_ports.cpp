#include "device/recv_ports.h"

namespace fastcomm {
namespace device {

namespace {

Key next_key(const std::unordered_map<uint64_t, uint64_t>& next_seq, uint64_t id) {
  auto it = next_seq.find(id);
  return Key{id, it == next_seq.end() ? 0 : it->second};
}

void unwatch_all(RecvPorts::Channels& ch, const std::unordered_map<uint64_t, uint64_t>& next_seq,
                 const RecvPorts::Recv& r) {
  for (const auto& s : r.from) ch.unwatch(s.rank, next_key(next_seq, s.id));
}

}  // namespace

bool RecvNumbers::take(uint64_t id, const PortKey* port, bool any, Key& key) {
  if (port != nullptr && (any || unbound_.count(*port))) {
    ++unbound_[*port];
    return false;
  }
  key = Key{id, next_seq_[id]++};
  return true;
}

void RecvNumbers::settled(const PortKey& port) {
  auto it = unbound_.find(port);
  if (it != unbound_.end() && --it->second == 0) unbound_.erase(it);
}

void RecvPorts::step(Channels& ch, std::unordered_map<uint64_t, uint64_t>& next_seq, std::vector<Bound>& bound,
                     std::vector<Failed>& failed) {
  for (auto pit = ports_.begin(); pit != ports_.end();) {
    Port& p = pit->second;
    while (!p.queue.empty()) {
      Recv& r = p.queue.front();
      const size_t n = r.from.size();
      if (!r.any) {
        const Key k{r.from[0].id, next_seq[r.from[0].id]++};
        bound.push_back(Bound{r.token, r.from[0], k});
        p.queue.pop_front();
        continue;
      }
      size_t chosen = n;
      for (size_t i = 0; i < n; ++i) {
        const DeviceOp::Sender& s = r.from[(p.next + i) % n];
        const Key k = next_key(next_seq, s.id);
        ch.watch(s.rank, k);
        if (chosen == n && ch.offered(s.rank, k)) chosen = (p.next + i) % n;
      }
      if (chosen < n) {
        unwatch_all(ch, next_seq, r);
        const DeviceOp::Sender s = r.from[chosen];
        bound.push_back(Bound{r.token, s, Key{s.id, next_seq[s.id]++}});
        p.next = (chosen + 1) % n;
        p.queue.pop_front();
        continue;
      }
      int dead = -1;
      for (const auto& s : r.from)
        if (ch.failed(s.rank)) {
          dead = s.rank;
          break;
        }
      if (dead < 0) break;  // waits for an offer; the recvs behind it wait for it
      unwatch_all(ch, next_seq, r);
      failed.push_back(Failed{r.token, dead});
      p.queue.pop_front();
    }
    pit = p.queue.empty() ? ports_.erase(pit) : std::next(pit);
  }
}

bool RecvPorts::remove(Channels& ch, const std::unordered_map<uint64_t, uint64_t>& next_seq, void* token) {
  for (auto pit = ports_.begin(); pit != ports_.end(); ++pit) {
    auto& q = pit->second.queue;
    for (auto it = q.begin(); it != q.end(); ++it) {
      if (it->token != token) continue;
      if (it->any) unwatch_all(ch, next_seq, *it);
      q.erase(it);
      if (q.empty()) ports_.erase(pit);
      return true;
    }
  }
  return false;
}

}  // namespace device
}  // namespace fastcomm
