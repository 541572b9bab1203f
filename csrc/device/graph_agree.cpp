// A plan's capture, before the graph (device/graph.h): the agreement with every peer (order,
// matching, and per pair a link of the plan's own or a communicator) and the communicators up.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "common/errors.h"
#include "device/graph.h"

namespace fastcomm {
namespace device {

namespace {

constexpr uint32_t kGraphMagic = 0x70636667;  // "gfcp"
constexpr uint32_t kVerdictMagic = 0x76636667;  // "gfcv"

// What one side of a pair sends the other before the capture: its parts in the canonical order
// (entries follow in a second message), and either the plan communicator's id (leader) or a
// link's ring (the leader's offer, the follower's acceptance). The follower sends its hello
// once it has the leader's.
struct Hello {
  uint32_t magic = kGraphMagic;
  uint32_t count = 0;
  uint32_t has_id = 0;
  uint32_t link = 0;  // `ring` is this side's link ring
  UniqueId id;
  UniqueId ring;
};

// The leader's answer to a follower's reply to its offer of a link: the link stands, or the
// pair goes over a communicator of this id.
struct Verdict {
  uint32_t magic = kVerdictMagic;
  uint32_t link = 0;
  uint32_t pad[2] = {0, 0};
  UniqueId id;
};

at::Tensor bytes_of(const void* p, size_t n) {
  at::Tensor t = at::empty({(int64_t)std::max<size_t>(n, 1)}, at::TensorOptions().dtype(at::kByte));
  if (n) std::memcpy(t.data_ptr(), p, n);
  return t;
}

}  // namespace

bool PlanGraph::can_link(int peer) const { return links_.on && links_.same_host && links_.same_host(peer); }

bool PlanGraph::accepts(int peer, const UniqueId& ring) const {
  return can_link(peer) && IpcLink::is_ipc(ring) && !IpcLink::is_host(ring) && IpcLink::readable(rt_, ring);
}

std::unique_ptr<IpcLink> PlanGraph::new_link(int peer) {
  auto l = std::make_unique<IpcLink>(rt_, peer, /*epoch=*/0, links_.ring_bytes, links_.slots, /*host=*/false,
                                     /*fixed=*/true);
  // Unfused: a fused kernel's flag store is not known to be ordered after the clear the
  // stream wrote before it, and a set overtaken by a clear loses a wake-up.
  l->fuse_bytes = 0;
  return l;
}

void PlanGraph::agree() {
  const std::string who = "fastcomm.plan.capture: rank " + std::to_string(rank_) + ", groups " + label_;
  struct Io {
    c10::intrusive_ptr<Work> send_hello, send_entries, send_verdict, recv_hello, recv_entries, recv_verdict;
    at::Tensor in_hello, in_entries, in_verdict;
    std::vector<Entry> mine;
  };
  std::vector<Io> io(pairs_.size());
  auto wait_for = [&](const c10::intrusive_ptr<Work>& w, int peer) {
    try {
      w->wait(timeout_);
    } catch (const std::exception& e) {
      throw_comm_error(who + ": the agreement with rank " + std::to_string(peer) + " failed (" + e.what() +
                       "); every member of the plan's groups must capture the same plan, within the groups' "
                       "timeout (the messages of a failed agreement stay posted: later captures with rank " +
                       std::to_string(peer) + " fail too)");
    }
  };
  auto bad = [&](int peer) {
    throw_comm_error(who + ": a bad agreement message from rank " + std::to_string(peer));
  };
  auto send_mine = [&](size_t i, const Hello& h) {
    Pair& q = pairs_[i];
    io[i].send_hello = host_.control_send(q.peer, bytes_of(&h, sizeof h), 1);
    if (!io[i].mine.empty())
      io[i].send_entries = host_.control_send(q.peer, bytes_of(io[i].mine.data(), io[i].mine.size() * sizeof(Entry)), 1);
  };
  auto read_hello = [&](size_t i) {
    Pair& q = pairs_[i];
    wait_for(io[i].recv_hello, q.peer);
    Hello h;
    std::memcpy(&h, io[i].in_hello.data_ptr(), sizeof h);
    if (h.magic != kGraphMagic || (q.leader && h.has_id != 0) || (!q.leader && (h.has_id != 0) == (h.link != 0)))
      bad(q.peer);
    if (h.count > 0) {
      io[i].in_entries = at::empty({(int64_t)(h.count * sizeof(Entry))}, at::TensorOptions().dtype(at::kByte));
      io[i].recv_entries = host_.control_recv(q.peer, io[i].in_entries, 1);
    }
    return h;
  };
  // Leaders send first; a follower answers once it has the leader's hello, and a leader whose
  // offer of a link was answered confirms. Each round waits only on messages the one before it
  // sent, so no member waits on another in a cycle.
  for (size_t i = 0; i < pairs_.size(); ++i) {
    Pair& q = pairs_[i];
    for (Part* p : q.parts) io[i].mine.push_back(Entry{p->op->key, p->sig});
    io[i].in_hello = at::empty({(int64_t)sizeof(Hello)}, at::TensorOptions().dtype(at::kByte));
    io[i].recv_hello = host_.control_recv(q.peer, io[i].in_hello, 1);
    if (!q.leader) continue;
    Hello h;
    h.count = (uint32_t)q.parts.size();
    if (can_link(q.peer)) {
      q.link = new_link(q.peer);
      h.link = 1;
      h.ring = q.link->id();
    } else {
      q.id = rt_.new_id();
      h.has_id = 1;
      h.id = q.id;
    }
    send_mine(i, h);
  }
  for (size_t i = 0; i < pairs_.size(); ++i) {  // followers answer
    Pair& q = pairs_[i];
    if (q.leader) continue;
    const Hello theirs = read_hello(i);
    Hello h;
    h.count = (uint32_t)q.parts.size();
    if (theirs.link) {
      if (accepts(q.peer, theirs.ring)) {
        q.link = new_link(q.peer);
        q.peer_ring = theirs.ring;
        h.link = 1;
        h.ring = q.link->id();
      }
      io[i].in_verdict = at::empty({(int64_t)sizeof(Verdict)}, at::TensorOptions().dtype(at::kByte));
      io[i].recv_verdict = host_.control_recv(q.peer, io[i].in_verdict, 1);
    } else {
      q.id = theirs.id;
    }
    send_mine(i, h);
  }
  for (size_t i = 0; i < pairs_.size(); ++i) {  // leaders confirm their offers
    Pair& q = pairs_[i];
    if (!q.leader) continue;
    const Hello theirs = read_hello(i);
    if (!q.link) continue;
    Verdict v;
    if (theirs.link && accepts(q.peer, theirs.ring)) {
      v.link = 1;
      q.peer_ring = theirs.ring;
    } else {
      q.link.reset();  // nobody mapped its ring: it goes at once
      q.id = rt_.new_id();
      v.id = q.id;
    }
    io[i].send_verdict = host_.control_send(q.peer, bytes_of(&v, sizeof v), 1);
  }
  for (size_t i = 0; i < pairs_.size(); ++i) {  // followers learn whether their link stands
    Pair& q = pairs_[i];
    if (!io[i].recv_verdict) continue;
    wait_for(io[i].recv_verdict, q.peer);
    Verdict v;
    std::memcpy(&v, io[i].in_verdict.data_ptr(), sizeof v);
    if (v.magic != kVerdictMagic || (v.link != 0 && !q.link)) bad(q.peer);
    if (v.link == 0) {
      q.link.reset();
      q.id = v.id;
    }
  }
  for (size_t i = 0; i < pairs_.size(); ++i) {
    Pair& q = pairs_[i];
    std::vector<Entry> theirs;
    if (io[i].recv_entries) {
      wait_for(io[i].recv_entries, q.peer);
      theirs.resize((size_t)io[i].in_entries.numel() / sizeof(Entry));
      std::memcpy(theirs.data(), io[i].in_entries.data_ptr(), theirs.size() * sizeof(Entry));
    }
    for (auto* w : {&io[i].send_hello, &io[i].send_entries, &io[i].send_verdict})
      if (*w) wait_for(*w, q.peer);
    const auto& mine = io[i].mine;
    const std::string peer = "rank " + std::to_string(q.peer);
    if (theirs.size() != mine.size())
      throw_comm_error(who + ": this side's plan has " + std::to_string(mine.size()) + " ops with " + peer + ", " +
                       peer + "'s has " + std::to_string(theirs.size()) + " with this rank; every member of the "
                       "plan's groups must capture the same plan");
    for (size_t k = 0; k < mine.size(); ++k) {
      const Sig& lead = q.leader ? mine[k].sig : theirs[k].sig;
      const Sig& follow = q.leader ? theirs[k].sig : mine[k].sig;
      if (!(mine[k].key == theirs[k].key) || !compatible(lead, follow))
        throw_comm_error(who + ": op #" + std::to_string(k) + " of the plan with " + peer + " does not match: " +
                         sig_str(mine[k].sig) + " here, " + sig_str(theirs[k].sig) + " on " + peer +
                         (mine[k].key.id == theirs[k].key.id ? " (same group)" : " (of another group there)") +
                         "; every member of the plan's groups must capture the same plan");
    }
  }
}

void PlanGraph::connect() {
  for (auto& q : pairs_) {
    if (q.link) {
      q.link->open_peer(q.peer_ring);
      if (links_.made) ++*links_.made;
      if (!links_stream_) links_stream_ = rt_.new_stream();
      q.stream = links_stream_;
      continue;
    }
    q.comm = rt_.comm_init(q.id, 2, q.leader ? 0 : 1);
    if (serial_) {
      if (!links_stream_) links_stream_ = rt_.new_stream();
      q.stream = links_stream_;
    } else {
      q.stream = rt_.new_stream();
    }
  }
  const auto deadline = Clock::now() + timeout_;
  for (;;) {
    bool all = true;
    for (auto& q : pairs_) {
      if (q.link) continue;
      std::string why;
      const State s = rt_.comm_state(q.comm, &why);
      if (s == State::kFailed)
        throw_comm_error("fastcomm.plan.capture: rank " + std::to_string(rank_) + ": the plan's communicator with rank " +
                         std::to_string(q.peer) + " failed: " + why);
      if (!host_.peer_alive(q.peer))
        throw_comm_error("fastcomm.plan.capture: rank " + std::to_string(rank_) + ": rank " + std::to_string(q.peer) +
                         " is gone");
      if (s == State::kPending) {
        all = false;
        if (Clock::now() > deadline)
          throw_comm_error("fastcomm.plan.capture: rank " + std::to_string(rank_) + ": the plan's communicator with rank " +
                           std::to_string(q.peer) + " not up after " + std::to_string(timeout_.count()) + " ms");
      }
    }
    if (all) return;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace device
}  // namespace fastcomm
