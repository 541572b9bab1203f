// What a plan's CUDA graph holds (device/graph.h): the capture of the plan's device work, per
// pair in canonical order, consecutive pair ops of a pair fused into one NCCL group and one fold
// launch where their memory allows (docs/design.md, "The graph"); with more peers than the
// kernel bound, its launches in a window (docs/design.md, "Kernels in flight").
#include <ATen/ATen.h>

#include <algorithm>
#include <thread>
#include <unordered_map>

#include "common/errors.h"
#include "device/graph.h"

namespace fastcomm {
namespace device {

void PlanGraph::record_graph() {
  if (std::any_of(ops_.begin(), ops_.end(), [](const auto& o) { return o->parts.size() != 1; }))
    join_ = rt_.new_stream();
  if (windowed_) retire_ = rt_.new_stream();
  if (!open_capture_) rt_.begin_capture(origin_);
  open_capture_ = true;
  emit(origin_);
  open_capture_ = false;
  graph_ = rt_.end_capture(origin_);
}

void PlanGraph::emit(Stream origin) {
  size_t used = 0;  // events used only to order the capture's streams, in the same order each time
  auto ev = [&] {
    if (used == emit_events_.size()) emit_events_.push_back(rt_.new_event());
    return emit_events_[used++];
  };
  // A non-blocking communicator takes no call while it still enqueues its last launch.
  auto settle = [&](Pair& q) {
    for (;;) {
      std::string why;
      const State s = rt_.comm_state(q.comm, &why);
      if (s == State::kReady) return;
      if (s == State::kFailed)
        throw_comm_error("fastcomm.plan.capture: rank " + std::to_string(rank_) + ": the plan's communicator with rank " +
                         std::to_string(q.peer) + " failed: " + why);
      std::this_thread::yield();
    }
  };
  // Every run maps the links' chunks to their slots alike (the peer's run may be of the other
  // graph: the plan's own or a user's).
  for (auto& q : pairs_)
    if (q.link) q.link->restart_fixed();
  const Event fork = ev();
  rt_.record(fork, origin);
  for (auto& q : pairs_) rt_.wait(q.stream, fork);
  if (join_) rt_.wait(join_, fork);
  if (retire_) rt_.wait(retire_, fork);
  // The window (windowed_ only): every launch is one kernel (a pair's batch, or one part of an
  // op of 3+), and launch i waits until launch i - max_kernels_ and all before it are over:
  // retire_ waits on the launches' ends in order, so retired[j] means launches 0..j are over.
  std::vector<Event> retired;
  auto admit = [&](Stream s) {
    if (windowed_ && (int64_t)retired.size() >= max_kernels_) rt_.wait(s, retired[retired.size() - max_kernels_]);
  };
  auto retire = [&](Event end) {
    if (!windowed_) return;
    rt_.wait(retire_, end);
    retired.push_back(ev());
    rt_.record(retired.back(), retire_);
  };
  std::unordered_map<uint64_t, std::pair<Stream, Event>> last;  // each group's last end
  // Transfers of parts on one pair go as one NCCL group (one kernel at each replay, not one per
  // part); `ops` then have their copies and folds (one fold launch) on the pair's stream.
  auto transfer = [&](Pair& q, const std::vector<DevOp*>& ops) {
    if (q.link) {
      for (DevOp* op : ops)
        for (auto& p : op->parts)
          if (p->peer == q.peer) q.link->emit_fixed(*p, q.stream);
      return;
    }
    const int peer_rank = q.leader ? 1 : 0;
    rt_.group_start();
    try {
      for (DevOp* op : ops)
        for (auto& p : op->parts) {
          if (p->peer != q.peer) continue;
          for (auto& [buf, n] : p->sends) rt_.send(buf, n, peer_rank, q.comm, q.stream);
          for (auto& [buf, n] : p->recvs) rt_.recv(buf, n, peer_rank, q.comm, q.stream);
        }
    } catch (...) {
      rt_.group_end();
      throw;
    }
    rt_.group_end();
    settle(q);
  };
  // Pair ops, in canonical order, whose transfers wait to go together. Fusing reorders an op's
  // transfers before the folds and copies of the ops before it, so an op joins only where its
  // memory is disjoint from theirs wherever one of them writes (its group's order then holds as
  // a stream's would); an op after its group's op on another stream starts a new batch.
  struct Span {
    uintptr_t lo, hi;
  };
  struct Access {
    std::vector<Span> reads, writes;
  };
  auto access_of = [](const DevOp& op) {
    Access a;
    auto add = [](std::vector<Span>& v, const void* p, size_t n) {
      if (n > 0) v.push_back({(uintptr_t)p, (uintptr_t)p + n});
    };
    for (auto& p : op.parts) {
      for (auto& [buf, n] : p->sends) add(a.reads, buf, n);
      for (auto& [buf, n] : p->recvs) add(a.writes, buf, n);
    }
    for (auto& [dst, src, n] : op.copies) {
      add(a.writes, dst, n);
      add(a.reads, src, n);
    }
    for (const FoldJob& j : op.folds) {
      const size_t n = (size_t)j.numel * c10::elementSize(j.dtype);
      add(a.writes, j.dst, n);
      add(a.reads, j.own, n);
      add(a.reads, j.scratch, n * (size_t)std::max(j.n - 1, 0));
    }
    return a;
  };
  auto meets = [](const std::vector<Span>& a, const std::vector<Span>& b) {
    for (const Span& x : a)
      for (const Span& y : b)
        if (x.lo < y.hi && y.lo < x.hi) return true;
    return false;
  };
  struct Open {
    std::vector<DevOp*> ops;
    Access acc;  // of the ops so far
  };
  std::unordered_map<int, Open> open;
  std::unordered_map<uint64_t, int> open_on;  // group id -> the pair whose open batch holds its last op
  auto flush = [&](Pair& q) {
    Open& o = open[q.peer];
    if (o.ops.empty()) return;
    admit(q.stream);
    transfer(q, o.ops);
    std::vector<FoldJob> folds;
    for (DevOp* op : o.ops) {
      for (auto& [dst, src, n] : op->copies) rt_.copy(dst, src, n, q.stream);
      folds.insert(folds.end(), op->folds.begin(), op->folds.end());
    }
    if (!folds.empty()) rt_.fold(folds.data(), (int)folds.size(), q.stream);
    const Event done = ev();
    rt_.record(done, q.stream);
    retire(done);
    for (DevOp* op : o.ops) {
      last[op->key.id] = {q.stream, done};
      auto it = open_on.find(op->key.id);
      if (it != open_on.end() && it->second == q.peer) open_on.erase(it);
    }
    o.ops.clear();
    o.acc = Access{};
  };
  auto flush_all = [&] {
    for (auto& q : pairs_) flush(q);
  };
  for (auto& up : ops_) {
    DevOp& op = *up;
    if (op.parts.size() == 1) {
      Pair& q = pair(op.parts[0]->peer);
      // In the window, and on the one stream of a plan that mixes links and communicators,
      // launches keep the canonical order: one batch open at a time.
      if (windowed_ || serial_)
        for (auto& other : pairs_)
          if (other.peer != q.peer) flush(other);
      Open& o = open[q.peer];
      Access a = access_of(op);
      if (meets(a.reads, o.acc.writes) || meets(a.writes, o.acc.writes) || meets(a.writes, o.acc.reads)) flush(q);
      // The group's previous op still open on another pair (a group of 3+): it goes first, so
      // that its end exists to wait for.
      auto held = open_on.find(op.key.id);
      if (held != open_on.end() && held->second != q.peer) flush(pair(held->second));
      auto pred = last.find(op.key.id);
      if (pred != last.end() && pred->second.first != q.stream) {
        const Event pred_end = pred->second.second;  // flush() may rehash `last`
        flush(q);
        rt_.wait(q.stream, pred_end);
      }
      o.ops.push_back(&op);
      open_on[op.key.id] = q.peer;
      o.acc.reads.insert(o.acc.reads.end(), a.reads.begin(), a.reads.end());
      o.acc.writes.insert(o.acc.writes.end(), a.writes.begin(), a.writes.end());
      // A link pair's op goes at once: the links stream holds every link pair's work in the
      // canonical order.
      if (q.link) flush(q);
      continue;
    }
    // An op of 3+ (or of none): its parts on several pairs, its end work on the join stream. In
    // the window each part is a launch of its own, in peer order (so the pairs (lo, hi) go in
    // the same order on every rank).
    flush_all();
    auto pred = last.find(op.key.id);
    const Stream pred_stream = pred != last.end() ? pred->second.first : nullptr;
    const Event pred_end = pred != last.end() ? pred->second.second : nullptr;
    std::vector<Part*> parts;
    for (auto& p : op.parts) parts.push_back(p.get());
    // In peer order, so the pairs (lo, hi) go in the same order on every rank: the window's
    // launches, and the links stream's parts (its order is canonical).
    std::sort(parts.begin(), parts.end(), [](Part* a, Part* b) { return a->peer < b->peer; });
    for (Part* p : parts) {
      Pair& q = pair(p->peer);
      if (pred_end && pred_stream != q.stream) rt_.wait(q.stream, pred_end);
      admit(q.stream);
      transfer(q, {&op});
      const Event e = ev();
      rt_.record(e, q.stream);
      retire(e);
      rt_.wait(join_, e);
    }
    if (op.parts.empty() && pred_end && pred_stream != join_) rt_.wait(join_, pred_end);
    for (auto& [dst, src, n] : op.copies) rt_.copy(dst, src, n, join_);
    if (!op.folds.empty()) rt_.fold(op.folds.data(), (int)op.folds.size(), join_);
    const Event done = ev();
    rt_.record(done, join_);
    last[op.key.id] = {join_, done};
  }
  flush_all();
  for (auto& q : pairs_) {
    const Event e = ev();
    rt_.record(e, q.stream);
    rt_.wait(origin, e);
  }
  for (Stream s : {join_, retire_}) {
    if (!s) continue;
    const Event e = ev();
    rt_.record(e, s);
    rt_.wait(origin, e);
  }
}

}  // namespace device
}  // namespace fastcomm
