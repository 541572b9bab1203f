#include "device/agreement.h"

#include <algorithm>

namespace fastcomm {
namespace device {

void PairAgreement::ready(const Item& it, Out& out) {
  if (leader_) {
    probed_.erase(it.key);  // a recv took the key: its probe's answer no longer matters
    answered_.erase(it.key);
  } else if (probes_.erase(it.key)) {
    out.frames.push_back(Frame{kOffer, epoch_, {Entry{it.key, it.sig}}});
  }
  if (cancelled(it.key)) {
    out.failed.push_back({it.token, Why::kCancelled, Sig{}});
    return;
  }
  open_[it.key] = it;
  if (leader_) {
    to_propose_.push_back(it.key);
  } else {
    match(out);
  }
}

void PairAgreement::flush(Out& out) {
  if (!leader_) return;
  if (!to_probe_.empty()) {
    Frame p{kProbe, epoch_, {}};
    for (const Key& k : to_probe_) p.entries.push_back(Entry{k, Sig{}});
    to_probe_.clear();
    out.frames.push_back(std::move(p));
  }
  if (to_propose_.empty()) return;
  Frame f;
  f.type = kPropose;
  f.epoch = epoch_;
  for (const Key& k : to_propose_) {
    auto it = open_.find(k);
    if (it != open_.end()) f.entries.push_back(Entry{k, it->second.sig});
  }
  to_propose_.clear();
  if (!f.entries.empty()) out.frames.push_back(std::move(f));
}

void PairAgreement::watch(const Key& k) {
  watched_.insert(k);
  if (leader_ && !cancelled(k) && probed_.insert(k).second) to_probe_.push_back(k);
}

void PairAgreement::unwatch(const Key& k) {
  watched_.erase(k);
  // An unanswered probe is forgotten (its late answer is ignored): a message that never comes
  // holds nothing here.
  if (leader_ && !answered_.count(k)) probed_.erase(k);
}

bool PairAgreement::offered(const Key& k) const {
  if (cancelled(k)) return true;
  if (leader_) return answered_.count(k) > 0;
  for (const Entry& e : proposals_)
    if (e.key == k) return true;
  return false;
}

bool PairAgreement::waiting() const {
  if (!awaiting_.empty() || !watched_.empty()) return true;
  // proposed or probed, not answered
  if (leader_) return open_.size() > to_propose_.size() || probed_.size() > answered_.size();
  return !open_.empty();
}

// Follower: proposals matched to ready items, in proposal order; a proposal with no item here
// yet waits without holding back those after it.
void PairAgreement::match(Out& out) {
  Frame commits{kCommit, epoch_, {}}, mismatches{kMismatch, epoch_, {}};
  for (auto it = proposals_.begin(); it != proposals_.end();) {
    auto f = open_.find(it->key);
    if (f == open_.end()) {
      ++it;
      continue;
    }
    Item item = f->second;
    open_.erase(f);
    if (compatible(it->sig, item.sig)) {
      if (item.agree_only) {
        awaiting_[item.key] = item;
        out.awaiting.push_back(item.token);
      } else {
        out.launch.push_back(item.token);
      }
      commits.entries.push_back(*it);
    } else {
      out.failed.push_back({item.token, Why::kMismatch, it->sig});
      mismatches.entries.push_back(Entry{it->key, item.sig});
    }
    it = proposals_.erase(it);
  }
  if (!commits.entries.empty()) out.frames.push_back(std::move(commits));
  if (!mismatches.entries.empty()) out.frames.push_back(std::move(mismatches));
}

void PairAgreement::receive(const Frame& f, Out& out) {
  if (f.type == kReset) {
    if (f.epoch > epoch_) {
      // The peer reset the channel: what is held here fails too, and this side's floors go back.
      Frame ack{kResetAck, f.epoch, drop_all(Why::kReset, {}, out)};
      epoch_ = f.epoch;
      out.new_epoch = true;
      take_floors(f.entries, out);
      out.frames.push_back(std::move(ack));
    } else if (f.epoch == epoch_) {
      // Both sides reset at once: each takes the other's floors.
      take_floors(f.entries, out);
    }
    return;
  }
  if (f.type == kRelease) {
    if (f.epoch > epoch_ && !leader_) {
      epoch_ = f.epoch;
      out.released = true;
    }
    return;
  }
  if (f.epoch < epoch_) return;  // sent before the peer saw this side's reset: stale
  if (f.type == kResetAck) {
    take_floors(f.entries, out);
    return;
  }
  if (f.type == kProbe) {
    if (leader_) return;
    // Answered once the send is ready here; the send itself is not claimed.
    Frame offers{kOffer, epoch_, {}};
    for (const Entry& e : f.entries) {
      if (cancelled(e.key) || open_.count(e.key)) offers.entries.push_back(e);
      else probes_.insert(e.key);
    }
    if (!offers.entries.empty()) out.frames.push_back(std::move(offers));
    return;
  }
  if (f.type == kOffer) {
    if (!leader_) return;
    for (const Entry& e : f.entries)
      if (probed_.count(e.key)) answered_.insert(e.key);
    return;
  }
  if (f.type == kPropose) {
    if (leader_) return;  // only the leader proposes
    Frame cancels{kCancel, epoch_, {}};
    for (const Entry& e : f.entries) {
      if (cancelled(e.key)) cancels.entries.push_back(e);
      else proposals_.push_back(e);
    }
    if (!cancels.entries.empty()) out.frames.push_back(std::move(cancels));
    match(out);
    return;
  }
  if (f.type == kGo || f.type == kRefuse) {
    for (const Entry& e : f.entries) {
      auto it = awaiting_.find(e.key);
      if (it == awaiting_.end()) continue;  // cancelled here meanwhile
      out.decided.push_back({it->second.token, f.type == kGo});
      awaiting_.erase(it);
    }
    return;
  }
  // The follower's answers to proposals: kCommit, kMismatch, kCancel.
  for (const Entry& e : f.entries) {
    auto it = open_.find(e.key);
    if (it == open_.end()) continue;  // cancelled here meanwhile
    Item item = it->second;
    open_.erase(it);
    if (f.type == kCommit) {
      if (item.agree_only) out.answered.push_back(item.token);
      else out.launch.push_back(item.token);
    } else {
      out.failed.push_back({item.token, f.type == kMismatch ? Why::kMismatch : Why::kCancelled, e.sig});
    }
  }
}

void PairAgreement::reset(const std::vector<Key>& launched, Out& out) {
  Frame f{kReset, epoch_ + 1, drop_all(Why::kReset, launched, out)};
  ++epoch_;
  out.frames.push_back(std::move(f));
}

bool PairAgreement::release(Out& out) {
  if (!leader_ || holding() || !to_propose_.empty()) return false;
  ++epoch_;
  out.frames.push_back(Frame{kRelease, epoch_, {}});
  return true;
}

std::vector<Entry> PairAgreement::drop_all(Why why, const std::vector<Key>& launched, Out& out) {
  for (const Key& k : launched) raise_floor(k);
  for (auto& [k, item] : open_) {
    raise_floor(k);
    out.failed.push_back({item.token, why, Sig{}});
  }
  for (auto& [k, item] : awaiting_) {
    raise_floor(k);
    out.failed.push_back({item.token, why, Sig{}});
  }
  for (const Entry& e : proposals_) raise_floor(e.key);  // the peer's: cancelled on its side too
  open_.clear();
  awaiting_.clear();
  to_propose_.clear();
  proposals_.clear();
  // Probes of the old epoch are lost with it: the leader asks again for what is still watched.
  probes_.clear();
  probed_.clear();
  answered_.clear();
  to_probe_.clear();
  if (leader_)
    for (const Key& k : watched_)
      if (!cancelled(k) && probed_.insert(k).second) to_probe_.push_back(k);
  std::vector<Entry> floors;
  for (auto& [id, seq] : floor_) floors.push_back(Entry{Key{id, seq}, Sig{}});
  return floors;
}

void PairAgreement::take_floors(const std::vector<Entry>& floors, Out& out) {
  for (const Entry& e : floors) raise_floor(e.key);
  for (auto* held : {&open_, &awaiting_}) {
    for (auto it = held->begin(); it != held->end();) {
      if (!cancelled(it->first)) {
        ++it;
        continue;
      }
      out.failed.push_back({it->second.token, Why::kCancelled, Sig{}});
      it = held->erase(it);
    }
  }
  proposals_.erase(std::remove_if(proposals_.begin(), proposals_.end(), [&](const Entry& e) { return cancelled(e.key); }),
                   proposals_.end());
  to_propose_.erase(std::remove_if(to_propose_.begin(), to_propose_.end(), [&](const Key& k) { return !open_.count(k); }),
                    to_propose_.end());
  for (auto it = probes_.begin(); it != probes_.end();) it = cancelled(*it) ? probes_.erase(it) : std::next(it);
}

}  // namespace device
}  // namespace fastcomm
