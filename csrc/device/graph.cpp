// A plan captured into a CUDA graph (device/graph.h), and the runtimes' default graph calls.
#include "device/graph.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <unordered_map>

#include "common/errors.h"

namespace fastcomm {
namespace device {

void Runtime::begin_capture(Stream) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime cannot capture CUDA graphs");
}
void* Runtime::end_capture(Stream) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime cannot capture CUDA graphs");
}
void Runtime::graph_launch(void*, Stream) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime cannot launch CUDA graphs");
}
void Runtime::graph_destroy(void*) {}

namespace {

constexpr uint32_t kGraphMagic = 0x70636667;  // "gfcp"

// What one side of a pair sends the other before the capture: its parts in the canonical order
// (entries follow in a second message), and, from the leader, the plan communicator's id.
struct Hello {
  uint32_t magic = kGraphMagic;
  uint32_t count = 0;
  uint32_t has_id = 0;
  uint32_t pad = 0;
  UniqueId id;
};

at::Tensor bytes_of(const void* p, size_t n) {
  at::Tensor t = at::empty({(int64_t)std::max<size_t>(n, 1)}, at::TensorOptions().dtype(at::kByte));
  if (n) std::memcpy(t.data_ptr(), p, n);
  return t;
}

}  // namespace

PlanGraph::PlanGraph(std::shared_ptr<void> owner, Runtime& rt, HostLink& host, int rank, Stream alloc,
                     std::vector<DeviceOp> dops, bool naive)
    : owner_(std::move(owner)), rt_(rt), host_(host), rank_(rank), naive_(naive) {
  try {
    origin_ = rt_.new_stream();
    // A careless design agrees and allocates with the capture already begun (tests show the
    // runtime refuses it).
    if (naive_) {
      rt_.begin_capture(origin_);
      open_capture_ = true;
    }
    auto batch = std::make_shared<Batch>();
    std::unordered_map<uint64_t, uint64_t> seq;
    const Lowering how{rt_, alloc, rank_, /*group_comms=*/false, 0};
    for (auto& d : dops) {
      auto op = lower(d, batch, how);
      op->key = Key{d.id, seq[d.id]++};
      timeout_ = std::max(timeout_, d.timeout);
      if (label_.find(d.label) == std::string::npos) label_ += (label_.empty() ? "" : ", ") + d.label;
      ops_.push_back(std::move(op));
    }
    if (timeout_.count() <= 0) timeout_ = std::chrono::minutes(30);
    // The canonical order: by group, then by place in the group. Every member of a group holds
    // its ops in the same order, so both sides of each pair see the same sequence.
    std::stable_sort(ops_.begin(), ops_.end(), [](const auto& a, const auto& b) {
      return a->key.id != b->key.id ? a->key.id < b->key.id : a->key.seq < b->key.seq;
    });
    for (auto& op : ops_)
      for (auto& p : op->parts) pair(p->peer).parts.push_back(p.get());
    agree();
    connect();
    record_graph();
  } catch (...) {
    release();
    throw;
  }
}

PlanGraph::~PlanGraph() { release(); }

PlanGraph::Pair& PlanGraph::pair(int peer) {
  for (auto& p : pairs_)
    if (p.peer == peer) return p;
  pairs_.emplace_back();
  Pair& p = pairs_.back();
  p.peer = peer;
  p.leader = rank_ < peer;
  return p;
}

void PlanGraph::agree() {
  const std::string who = "fastcomm.plan.capture: rank " + std::to_string(rank_) + ", groups " + label_;
  struct Io {
    c10::intrusive_ptr<Work> send_hello, send_entries, recv_hello, recv_entries;
    at::Tensor in_hello, in_entries;
    std::vector<Entry> mine;
  };
  std::vector<Io> io(pairs_.size());
  auto wait_for = [&](const c10::intrusive_ptr<Work>& w, int peer) {
    try {
      w->wait(timeout_);
    } catch (const std::exception& e) {
      throw_comm_error(who + ": the agreement with rank " + std::to_string(peer) + " failed (" + e.what() +
                       "); every member of the plan's groups must capture the same plan");
    }
  };
  for (size_t i = 0; i < pairs_.size(); ++i) {
    Pair& q = pairs_[i];
    Hello h;
    h.count = (uint32_t)q.parts.size();
    if (q.leader) {
      q.id = rt_.new_id();
      h.has_id = 1;
      h.id = q.id;
    }
    for (Part* p : q.parts) io[i].mine.push_back(Entry{p->op->key, p->sig});
    io[i].send_hello = host_.control_send(q.peer, bytes_of(&h, sizeof h), 1);
    if (!io[i].mine.empty())
      io[i].send_entries = host_.control_send(q.peer, bytes_of(io[i].mine.data(), io[i].mine.size() * sizeof(Entry)), 1);
    io[i].in_hello = at::empty({(int64_t)sizeof(Hello)}, at::TensorOptions().dtype(at::kByte));
    io[i].recv_hello = host_.control_recv(q.peer, io[i].in_hello, 1);
  }
  for (size_t i = 0; i < pairs_.size(); ++i) {
    Pair& q = pairs_[i];
    wait_for(io[i].recv_hello, q.peer);
    Hello h;
    std::memcpy(&h, io[i].in_hello.data_ptr(), sizeof h);
    if (h.magic != kGraphMagic || (bool)h.has_id == q.leader)
      throw_comm_error(who + ": a bad agreement message from rank " + std::to_string(q.peer));
    if (!q.leader) q.id = h.id;
    if (h.count > 0) {
      io[i].in_entries = at::empty({(int64_t)(h.count * sizeof(Entry))}, at::TensorOptions().dtype(at::kByte));
      io[i].recv_entries = host_.control_recv(q.peer, io[i].in_entries, 1);
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
    if (io[i].send_hello) wait_for(io[i].send_hello, q.peer);
    if (io[i].send_entries) wait_for(io[i].send_entries, q.peer);
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
    q.comm = rt_.comm_init(q.id, 2, q.leader ? 0 : 1);
    q.stream = rt_.new_stream();
  }
  const auto deadline = Clock::now() + timeout_;
  for (;;) {
    bool all = true;
    for (auto& q : pairs_) {
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

void PlanGraph::record_graph() {
  std::vector<Event> evs;  // events used only to order the capture's streams
  auto ev = [&] {
    evs.push_back(rt_.new_event());
    return evs.back();
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
  const bool needs_join = std::any_of(ops_.begin(), ops_.end(), [](const auto& o) { return o->parts.size() != 1; });
  if (needs_join) join_ = rt_.new_stream();
  try {
    if (!open_capture_) rt_.begin_capture(origin_);
    open_capture_ = true;
    const Event fork = ev();
    rt_.record(fork, origin_);
    for (auto& q : pairs_) rt_.wait(q.stream, fork);
    if (join_) rt_.wait(join_, fork);
    std::unordered_map<uint64_t, std::pair<Stream, Event>> last;  // each group's last end
    for (auto& up : ops_) {
      DevOp& op = *up;
      auto pred = last.find(op.key.id);
      for (auto& p : op.parts) {
        Pair& q = pair(p->peer);
        if (pred != last.end() && pred->second.first != q.stream) rt_.wait(q.stream, pred->second.second);
        const int peer_rank = q.leader ? 1 : 0;
        rt_.group_start();
        try {
          for (auto& [buf, n] : p->sends) rt_.send(buf, n, peer_rank, q.comm, q.stream);
          for (auto& [buf, n] : p->recvs) rt_.recv(buf, n, peer_rank, q.comm, q.stream);
        } catch (...) {
          rt_.group_end();
          throw;
        }
        rt_.group_end();
        settle(q);
      }
      Stream end = op.parts.size() == 1 ? pair(op.parts[0]->peer).stream : join_;
      if (end == join_) {
        for (auto& p : op.parts) {
          const Event e = ev();
          rt_.record(e, pair(p->peer).stream);
          rt_.wait(join_, e);
        }
        if (op.parts.empty() && pred != last.end() && pred->second.first != join_) rt_.wait(join_, pred->second.second);
      }
      for (auto& [dst, src, n] : op.copies) rt_.copy(dst, src, n, end);
      if (!op.folds.empty()) rt_.fold(op.folds.data(), (int)op.folds.size(), end);
      const Event done = ev();
      rt_.record(done, end);
      last[op.key.id] = {end, done};
    }
    for (auto& q : pairs_) {
      const Event e = ev();
      rt_.record(e, q.stream);
      rt_.wait(origin_, e);
    }
    if (join_) {
      const Event e = ev();
      rt_.record(e, join_);
      rt_.wait(origin_, e);
    }
    open_capture_ = false;
    graph_ = rt_.end_capture(origin_);
  } catch (...) {
    for (Event e : evs) rt_.destroy_event(e);
    throw;
  }
  for (Event e : evs) rt_.destroy_event(e);
}

void PlanGraph::replay() {
  std::lock_guard<std::mutex> lk(mu_);
  check_locked(false, timeout_);
  const Stream caller = rt_.current_stream();
  TORCH_CHECK(!rt_.capturing(caller), "fastcomm.plan graph: rank ", rank_, ", groups ", label_,
              ": replay() while the caller's stream is being captured is not supported; replay outside the capture");
  rt_.graph_launch(graph_, caller);
  Event e;
  if (!spare_.empty()) {
    e = spare_.back();
    spare_.pop_back();
  } else {
    e = rt_.new_event();
  }
  rt_.record(e, caller);
  runs_.push_back(Run{e, Clock::now()});
  ++replays_;
}

void PlanGraph::wait(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lk(mu_);
  check_locked(true, timeout.count() > 0 ? timeout : timeout_);
}

int64_t PlanGraph::replays() const {
  std::lock_guard<std::mutex> lk(mu_);
  return replays_;
}

void PlanGraph::check_locked(bool block, std::chrono::milliseconds timeout) {
  if (broken_) std::rethrow_exception(broken_);
  const auto start = Clock::now();
  auto harvest = [&] {
    while (!runs_.empty() && rt_.query(runs_.front().end) == State::kReady) {
      spare_.push_back(runs_.front().end);
      runs_.pop_front();
    }
  };
  for (int spins = 0;; ++spins) {
    harvest();
    if (runs_.empty() && block) return;
    // A fault matters while runs are in flight or one is about to be launched (a replay
    // against a dead peer would never finish).
    std::string fault;
    for (auto& q : pairs_) {
      std::string why;
      if (rt_.comm_state(q.comm, &why) == State::kFailed) {
        fault = "the plan's channel to rank " + std::to_string(q.peer) + " failed: " + why;
        break;
      }
      if (!host_.peer_alive(q.peer)) {
        fault = "rank " + std::to_string(q.peer) + " is gone";
        break;
      }
    }
    if (!fault.empty()) {
      // A peer that finished its runs and left: this side's last run may still be folding.
      // Harvest what already ran for a while before failing.
      const auto grace = Clock::now() + std::chrono::seconds(1);
      while (block && !runs_.empty() && Clock::now() < grace) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        harvest();
      }
      if (!block || !runs_.empty()) fail_locked(fault);
      return;
    }
    if (runs_.empty()) return;
    const auto now = Clock::now();
    const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(now - runs_.front().launched);
    if (age > timeout_ || (block && now - start > timeout)) {
      std::string peers;
      for (auto& q : pairs_) peers += (peers.empty() ? "" : ", ") + std::to_string(q.peer);
      fail_locked("a replay of the graph not done after " + std::to_string(age.count()) +
                  " ms (timeout); the plan's peers: ranks [" + peers + "]");
    }
    if (!block) return;
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
    else std::this_thread::yield();
  }
}

void PlanGraph::fail_locked(const std::string& why) {
  broken_ = comm_error_ptr("fastcomm.plan graph: rank " + std::to_string(rank_) + ", groups " + label_ + ": " + why +
                           "; the graph is dead (capture the plan again)");
  for (auto& q : pairs_) {
    try {
      if (q.comm) rt_.comm_abort(q.comm);  // the runs in flight return without moving data
    } catch (...) {
    }
  }
  std::rethrow_exception(broken_);
}

void PlanGraph::abort(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_) return;
  try {
    fail_locked(why);
  } catch (...) {
  }
}

void PlanGraph::release() {
  std::lock_guard<std::mutex> lk(mu_);
  // Runs in flight finish (or fail, aborting the communicators so that they drain) before the
  // memory and communicators go: a replay may still write the scratch.
  if (!runs_.empty() && !broken_) {
    try {
      check_locked(true, timeout_);
    } catch (...) {
    }
  }
  for (auto& r : runs_) {
    try {
      rt_.synchronize(r.end);
    } catch (...) {
    }
    spare_.push_back(r.end);
  }
  runs_.clear();
  auto quietly = [](auto f) {
    try {
      f();
    } catch (...) {
    }
  };
  if (open_capture_) quietly([&] { rt_.graph_destroy(rt_.end_capture(origin_)); });  // refused or dropped
  open_capture_ = false;
  if (graph_) quietly([&] { rt_.graph_destroy(graph_); });
  graph_ = nullptr;
  for (auto& q : pairs_) {
    if (q.comm) quietly([&] { rt_.comm_destroy(q.comm); });
    if (q.stream) quietly([&] { rt_.destroy_stream(q.stream); });
    q.comm = nullptr;
    q.stream = nullptr;
  }
  if (join_) quietly([&] { rt_.destroy_stream(join_); });
  if (origin_) quietly([&] { rt_.destroy_stream(origin_); });
  join_ = origin_ = nullptr;
  for (Event e : spare_) quietly([&] { rt_.destroy_event(e); });
  spare_.clear();
  ops_.clear();
}

}  // namespace device
}  // namespace fastcomm
