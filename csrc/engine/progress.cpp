#include "engine/progress.h"

#include <time.h>

#include <algorithm>

#include "common/errors.h"
#include "engine/op_comm.h"

namespace fastcomm {

// How long an op waits before the connector is asked to look for requests (health_locked).
constexpr std::chrono::milliseconds kLookForAsks{50};

namespace {
// The time deadlines count from: the coarse clock (a read of a kernel word, where a precise
// read costs a blocking op several percent), one resolution step on, so that no op times out
// early. Deadlines are met against the precise clock, which the coarse one lags.
Clock::time_point deadline_base() {
  static const Clock::duration step = [] {
    timespec r{};
    clock_getres(CLOCK_MONOTONIC_COARSE, &r);
    return std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(r.tv_sec) +
                                                       std::chrono::nanoseconds(r.tv_nsec));
  }();
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
  static_assert(Clock::is_steady, "steady_clock reads CLOCK_MONOTONIC, which the coarse clock follows");
  return Clock::time_point(std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(t.tv_sec) +
                                                                       std::chrono::nanoseconds(t.tv_nsec))) +
         step;
}
}  // namespace

Progress::Progress(std::mutex& mu, int rank, std::vector<int64_t> pids, TransportSet& tr, MessageRouter& router,
                   std::function<void()> wake_background)
    : mu_(mu),
      rank_(rank),
      pids_(std::move(pids)),
      tr_(tr),
      router_(router),
      wake_background_(std::move(wake_background)),
      bell_(tr.doorbell()),
      dead_(pids_.size(), 0) {}

std::string Progress::failure_prefix(const GroupState& g, const Pending& p) const {
  return "fastcomm: rank " + std::to_string(rank_) + ", group " + g.label + ": " + describe(p.op->desc()) +
         " (op #" + std::to_string(p.seq) + ")";
}

std::string Progress::exited_locked(const std::vector<int>& ranks) const {
  if (n_dead_ == 0) return "";
  // Peers whose process exited, and same-host peers alive that shut their engine down.
  std::string exited, closed;
  int n_exited = 0, n_closed = 0;
  for (int r : ranks) {
    if (r == rank_ || !dead_[r]) continue;
    // Only same-host peers' pids are known (the rendezvous hands out no other host's).
    std::string about = pids_[r] > 0 ? "pid " + std::to_string(pids_[r]) : "";
    const std::string why = tr_.of(r)->death_reason(r);
    const bool shut = why == Transport::kShutDown;
    if (!why.empty() && !shut) about += (about.empty() ? "" : ", ") + why;
    std::string& list = shut ? closed : exited;
    int& n = shut ? n_closed : n_exited;
    list += std::string(n++ ? " and " : "") + "rank " + std::to_string(r) + (about.empty() ? "" : " (" + about + ")");
  }
  std::string who;
  if (n_exited) who = exited + (n_exited == 1 ? " has exited" : " have exited");
  if (n_closed) who += (who.empty() ? "" : ", and ") + closed + " " + Transport::kShutDown;
  return who;
}

void Progress::post_locked(PostedOps ops, const c10::intrusive_ptr<Work>& work, Done& done,
                           const std::shared_ptr<const void>& keep) {
  if (work->is_async()) pending_async_.fetch_add(1);
  const auto now = deadline_base();
  for (auto& x : ops) {
    GroupState& g = *x.group;
    const std::string exited = exited_locked(g.ranks);
    // A group across hosts queues the op anyway: health fails it and tells the members, some
    // of which cannot see the death themselves (health_locked).
    bool remote = false;
    for (int r : g.ranks) remote = remote || !tr_.is_local(r);
    if (!exited.empty() && (x.port || !remote)) {
      settle_locked(done, work,
                    comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ", group " + g.label + ": " +
                                  (x.any_source ? "recv from any source (tag " + std::to_string(x.port->tag) + ")"
                                                : describe(x.op->desc())) +
                                  " cannot run: " + exited));
      continue;
    }
    Pending p;
    p.op = std::move(x.op);
    p.keep = keep;
    p.work = work;
    p.timeout = x.timeout;
    p.deadline = now + (x.timeout.count() > 0 ? x.timeout : g.timeout);
    if (x.port && (x.any_source || !x.port->waiting.empty())) {
      x.port->waiting.push_back(WaitingRecv{std::move(p), x.any_source ? nullptr : &g});
      if (!x.port->busy) {
        x.port->busy = true;
        busy_ports_.push_back(x.port);
      }
      continue;
    }
    enqueue_locked(g, std::move(p));
  }
  posting_batch_ = ops.size() > 1;
  eager_pass_locked(done);
  posting_batch_ = false;
}

void Progress::eager_pass_locked(Done& done) {
  const size_t stashed = router_.stashed();
  pass_locked(done);
  // Once more if a transport thread was refused meanwhile, or if the pass stashed messages
  // (maybe of an op it had already stepped, which nobody would ring for).
  if (rerun_.load() || router_.stashed() > stashed) pass_locked(done);
}

void Progress::enqueue_locked(GroupState& g, Pending p) {
  p.seq = g.next_seq++;
  g.queue.push_back(std::move(p));
  if (!g.busy) {
    g.busy = true;
    busy_.push_back(&g);
  }
}

// A receive is bound to a channel by taking that channel's next seq, so the k-th message on
// every (src, dst, tag) channel still goes to the k-th receive bound there (non-overtaking).
// Specific receives already bound hold the seqs below next_seq, so an any-source one only ever
// takes a message no earlier receive was waiting for.
bool Progress::match_locked(RecvPort& port) {
  bool any = false;
  const std::vector<int>& ranks = port.group->ranks;
  const size_t n = ranks.size();
  while (!port.waiting.empty()) {
    WaitingRecv& w = port.waiting.front();
    GroupState* ch = w.channel;
    if (ch == nullptr) {
      // The first member, from the one after the last match on, whose next message on its
      // channel is here: no sender is starved by a busier one.
      size_t from = n;
      for (size_t k = 0; k < n && from == n; ++k) {
        const size_t i = (port.next_try + k) % n;
        GroupState* c = port.from[i];
        if (c != nullptr && router_.peek(*c, c->next_seq, ranks[i]) != nullptr) from = i;
      }
      if (from == n) break;  // later receives wait too: this one comes first for any sender
      port.next_try = (from + 1) % n;
      ch = port.from[from];
      OpRequest r = static_cast<const UnboundRecv&>(*w.p.op).request();
      r.peer = ranks[from];
      // (The placeholder is dropped under the lock: the new op holds the same tensor.)
      w.p.op = collective_spec(OpKind::kRecv).make(r, view_of(*ch, rank_, 0));
      w.p.work->set_source((int)from);
    }
    enqueue_locked(*ch, std::move(w.p));
    port.waiting.pop_front();
    any = true;
  }
  return any;
}

std::string Progress::port_prefix(const RecvPort& port, const Pending& p) const {
  const OpDesc& d = p.op->desc();
  return "fastcomm: rank " + std::to_string(rank_) + ", group " + port.group->label + ": recv from any source (tag " +
         std::to_string(port.tag) + ", dtype=" + c10::toString(d.dtype) + ", numel=" + std::to_string(d.numel) + ")";
}

void Progress::fail_any_source_locked(RecvPort& port, const std::string& msg, Done& done) {
  std::deque<WaitingRecv> keep;
  for (auto& w : port.waiting) {
    if (w.channel != nullptr) {
      keep.push_back(std::move(w));
      continue;
    }
    settle_locked(done, w.p.work, comm_error_ptr(port_prefix(port, w.p) + msg));
    done.gone.push_back(std::move(w.p));
  }
  port.waiting.swap(keep);
}

void Progress::idle_port_locked(size_t i) {
  busy_ports_[i]->busy = false;
  busy_ports_[i] = busy_ports_.back();
  busy_ports_.pop_back();
}

void Progress::drop_idle_locked() {
  busy_.erase(std::remove_if(busy_.begin(), busy_.end(),
                             [](GroupState* g) {
                               if (!g->queue.empty()) return false;
                               g->busy = false;
                               return true;
                             }),
              busy_.end());
}

Progress::Alone Progress::step_alone_locked(GroupState& g, Op& op, int spins, Done& done, std::exception_ptr& err) {
  if (stopped_ || !g.queue.empty()) return Alone::kQueue;
  if (n_dead_ != 0)
    for (int r : g.ranks)
      if (dead_[r]) return Alone::kQueue;
  Pending p;
  p.op = OpPtr(&op, OpRelease(false));
  p.seq = g.next_seq;
  bool finished = false;
  try {
    OpComm comm(router_, tr_, pending_async_.load() > 0, g, p);
    op.step(comm);
    finished = op.done();
    if (!finished && spins > 0) {
      tr_.flush();
      do {
        cpu_relax();
        if (op.step(comm)) tr_.flush();  // an op with more round trips than one sends anew
        finished = op.done();
      } while (!finished && --spins > 0);
    }
  } catch (...) {
    err = std::current_exception();
  }
  if (!err && !finished) return Alone::kQueue;  // post_locked's pass publishes its sends
  if (err) {
    tell_peers_locked(g, p, err);
    router_.purge(g, p.seq);
  }
  ++g.next_seq;
  ++g.head_seq;
  // Ops queued elsewhere get the eager pass post_locked would have run: they may be waiting
  // for what this step set aside, or for a pass a transport thread was refused.
  if (!busy_.empty() || !busy_ports_.empty()) {
    eager_pass_locked(done);  // (which publishes this op's sends too)
  } else {
    tr_.flush();
  }
  return err ? Alone::kFailed : Alone::kFinished;
}

bool Progress::pass_locked(Done& done) {
  // First with messages of ops further up the list left where they are (no copy into the
  // stash): a batch's ops come in the order the peer posted them, and a pass that is past the
  // first of them when they arrive finds them all on its rerun, in place.
  struct Defer {
    MessageRouter& r;
    explicit Defer(MessageRouter& router) : r(router) { r.set_defer(true); }
    ~Defer() { r.set_defer(false); }
  };
  bool any;
  {
    Defer defer(router_);
    any = pass_once_locked(done);
  }
  if (router_.took_deferred()) any |= pass_once_locked(done);
  return any;
}

bool Progress::pass_once_locked(Done& done) {
  if (stopped_) return false;
  // (Read first: a store on every pass would be a locked instruction for a flag rarely set.)
  if (rerun_.load()) rerun_.store(false);
  const bool more_ops = posting_batch_ || pending_async_.load() > 1;
  bool any = false;
  // Receives matched now are stepped in this same pass, on their channels.
  for (size_t i = 0; i < busy_ports_.size();) {
    RecvPort& port = *busy_ports_[i];
    any |= match_locked(port);
    if (port.waiting.empty()) idle_port_locked(i);
    else ++i;
  }
  bool emptied = false;
  for (size_t i = 0; i < busy_.size();) {
    GroupState& g = *busy_[i];
    if (g.queue.empty()) {  // (left by a loop that threw before its sweep)
      emptied = true;
      ++i;
      continue;
    }
    Pending& p = g.queue.front();
    bool finished = false;
    std::exception_ptr err;
    bool stepped = false;
    try {
      OpComm comm(router_, tr_, more_ops, g, p);
      stepped = p.op->step(comm);
      finished = p.op->done();
    } catch (...) {
      err = std::current_exception();
    }
    any |= stepped;
    // What was dropped may have hidden a message this op (already stepped) can use now: that
    // counts as progress, so the caller runs another pass instead of sleeping.
    if (!stepped && !finished && !err) any |= router_.drop_stale(g, rank_);
    if (err) {
      fail_front_locked(g, err, done, true);
      any = true;
    } else if (finished) {
      settle_locked(done, p.work, nullptr);
      done.gone.push_back(std::move(p));
      g.queue.pop_front();
      ++g.head_seq;
      any = true;
    } else {
      ++i;
      continue;
    }
    if (!g.queue.empty()) continue;  // its next op is now at the front: stepped at the same index
    emptied = true;
    ++i;
  }
  if (emptied) drop_idle_locked();
  tr_.flush();
  return any;
}

// The other members fail the op too instead of waiting for data that will not come. A full
// ring just means a peer learns by its own timeout.
void Progress::tell_peers_locked(const GroupState& g, const Pending& p, std::exception_ptr e,
                                 const std::vector<char>* skip) {
  std::string why;
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& ex) {
    why = ex.what_without_backtrace();
  } catch (const std::exception& ex) {
    why = ex.what();
  }
  why.resize(std::min(why.size(), tr_.max_payload()));
  Header h = OpComm::header_of(g, p, 0, 0, (uint32_t)why.size());
  h.flags = kMsgAbort;
  for (int r : g.ranks)
    if (r != rank_ && !dead_[r] && !(skip && (*skip)[r])) tr_.of(r)->try_send(r, h, why.data());
}

void Progress::fail_front_locked(GroupState& g, std::exception_ptr e, Done& done, bool tell_peers,
                                 const std::vector<char>* skip) {
  Pending& p = g.queue.front();
  if (tell_peers) tell_peers_locked(g, p, e, skip);
  settle_locked(done, p.work, e);
  router_.purge(g, p.seq);
  done.gone.push_back(std::move(p));
  g.queue.pop_front();
  ++g.head_seq;
}

// A peer may exit right after sending what our ops still need, and its death can become
// visible before a pass has used those messages. So deaths are noted first; a transport
// publishes a peer's messages before it reports the peer gone, so passes then use everything
// it sent; only then is the peer's memory released and are the ops still waiting on it failed.
// Using the messages can take several passes (stashed ones); the cap bounds a streak fed by
// live peers.
void Progress::health_locked(Done& done) {
  if (stopped_) return;
  std::vector<int> newly_dead;
  auto look = [&](const std::vector<int>& ranks) {
    for (int r : ranks) {
      if (r == rank_ || dead_[r]) continue;
      // A remote peer's death shows only on a connection this rank holds: a member it never
      // talks to (a hierarchical op's member, or leader, on another host) is not connected to
      // for it (connections follow traffic); its death reaches this rank through the peers
      // that do talk to it, which fail the op and tell the other members.
      Transport* tr = tr_.of(r);
      if (!tr->peer_alive(r)) {
        dead_[r] = 1;
        ++n_dead_;
        newly_dead.push_back(r);
      }
    }
  };
  for (GroupState* g : busy_) look(g->ranks);
  for (RecvPort* port : busy_ports_) look(port->group->ranks);
  if (!newly_dead.empty()) {
    for (int pass = 0; pass < 256 && pass_locked(done); ++pass) {
    }
    for (int r : newly_dead) tr_.of(r)->release_peer(r);
  }
  const auto now = Clock::now();
  // An op waiting this long may wait for a peer that asks this rank for a connection it does
  // not want itself (a mismatched op's message, an any-source receive's sender): the connector
  // then reads its requests (fastcomm/_connect.py; it paces the reads).
  bool waits_long = !busy_ports_.empty();
  for (GroupState* g : busy_)
    waits_long = waits_long || (!g->queue.empty() && now - (g->queue.front().deadline - g->timeout) >= kLookForAsks);
  if (waits_long) tr_.gloo_look_for_asks();
  bool emptied = false;
  for (size_t i = 0; i < busy_.size();) {
    GroupState& g = *busy_[i];
    if (g.queue.empty()) {  // (left by a loop that threw before its sweep)
      emptied = true;
      ++i;
      continue;
    }
    const std::string exited = exited_locked(g.ranks);
    const bool dead = !exited.empty();
    Pending& p = g.queue.front();
    std::string msg;
    if (dead) {
      msg = failure_prefix(g, p) + " failed: " + exited;
    } else if (now >= p.deadline) {
      // Names the timeout that ran out (and keeps the word "timeout", which torch's own
      // suite and users' handlers match, as they match Gloo's "Timed out").
      msg = failure_prefix(g, p) + " timed out after " +
            (p.timeout.count() > 0 ? std::to_string(p.timeout.count()) + " ms, the call's own timeout"
                                   : std::to_string(g.timeout.count()) +
                                         " ms, the group's timeout (new_group's, else init's)") +
            "; a member stalled or issued this group's collectives in a different order";
      std::vector<int> awaited;
      if (p.op) p.op->awaiting(awaited);
      awaited.erase(std::remove_if(awaited.begin(), awaited.end(),
                                   [&](int q) { return q < 0 || (size_t)q >= g.ranks.size(); }),
                    awaited.end());
      if (!awaited.empty()) {
        msg += " (it was waiting for rank";
        msg += awaited.size() > 1 ? "s " : " ";
        for (size_t k = 0; k < awaited.size(); ++k)
          msg += (k ? ", " : "") + std::to_string(g.ranks[(size_t)awaited[k]]);
        msg += ")";
      }
      for (int r : g.ranks) {
        if (r == rank_) continue;
        Transport* t = tr_.of(r);
        const std::string why = t ? t->pending_reason(r) : std::string();
        if (!why.empty()) msg += "; " + why;
      }
    }
    if (msg.empty()) {
      ++i;
      continue;
    }
    auto e = comm_error_ptr(msg);
    // A dead member dooms every queued op of the group; a timeout only the one that stalled.
    // Members on a dead rank's host are not told of its death: each finds out itself (the
    // look above covers every member of a busy group; a notice could reach one first, and it
    // would keep the dead rank's segment mapped). A member on another host sees the death only
    // through a connection it holds, and connections follow traffic (a hierarchical op's leader
    // never talks to the other host's members): those this rank knows to be off the dead
    // ranks' hosts are told (the others on this rank's host, or, a dead rank being on this
    // rank's host, the members on other hosts).
    std::vector<char> skip;
    if (dead) {
      bool dead_here = false, dead_away = false;
      for (int r : g.ranks)
        if (dead_[r]) (tr_.is_local(r) ? dead_here : dead_away) = true;
      skip.assign(dead_.size(), 0);
      for (int r : g.ranks) skip[r] = tr_.is_local(r) ? dead_here : dead_away;
    }
    do {
      fail_front_locked(g, e, done, true, dead ? &skip : nullptr);
    } while (dead && !g.queue.empty());
    emptied |= g.queue.empty();
    ++i;
  }
  if (emptied) drop_idle_locked();
  // Waiting receives: an any-source one fails once any member is gone (that one may have been
  // its sender), or at its deadline; specific ones reach their channels and fail there.
  for (size_t i = 0; i < busy_ports_.size();) {
    RecvPort& port = *busy_ports_[i];
    const std::string exited = exited_locked(port.group->ranks);
    if (!exited.empty()) {
      const std::string msg = " failed: " + exited + ", and may have been the sender";
      fail_any_source_locked(port, msg, done);
    } else {
      while (!port.waiting.empty() && port.waiting.front().channel == nullptr &&
             now >= port.waiting.front().p.deadline) {
        Pending& p = port.waiting.front().p;
        settle_locked(done, p.work,
                      comm_error_ptr(port_prefix(port, p) + " timed out after " +
                                    std::to_string(port.group->timeout.count()) +
                                    " ms: no member sent this rank a message with that tag"));
        done.gone.push_back(std::move(p));
        port.waiting.pop_front();
      }
    }
    if (port.waiting.empty()) idle_port_locked(i);
    else ++i;
  }
  tr_.flush();  // abort notices
}

void Progress::health() {
  Done done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    health_locked(done);
  }
  finish(done);
}

void Progress::stop_locked(std::exception_ptr e, Done& done) {
  stopped_ = true;
  for (GroupState* g : busy_) {
    while (!g->queue.empty()) fail_front_locked(*g, e, done, false);
    g->busy = false;
  }
  busy_.clear();
  for (RecvPort* port : busy_ports_) {
    for (auto& w : port->waiting) {
      settle_locked(done, w.p.work, e);
      done.gone.push_back(std::move(w.p));
    }
    port->waiting.clear();
    port->busy = false;
  }
  busy_ports_.clear();
}

// Works become done here, in the order the passes finish ops, never later from another
// thread's list.
void Progress::settle_locked(Done& done, const c10::intrusive_ptr<Work>& w, std::exception_ptr e) {
  bool has_future = false;
  if (!w->settle(e, false, &has_future)) return;
  if (w->is_async()) pending_async_.fetch_sub(1);
  done.works.push_back(w);
  if (has_future) {
    publish_q_.push_back(w);
    publish_pending_.store(true, std::memory_order_relaxed);
  }
}

// Futures are completed in settle order by one thread at a time (whoever finds none publishing
// takes the whole queue, again until it is empty), so callbacks of a group's ops run in issue
// order even when several threads drive; a thread stuck in a callback delays later callbacks
// but never the Works themselves, whose state was settled under the lock.
void Progress::finish(Done& done, bool may_block) {
  if (!done.empty()) {
    bell_.ring_if_sleeping();  // another thread of this process may be asleep waiting for these
    done.works.clear();
  }
  done.gone.clear();
  if (!publish_pending_.load(std::memory_order_relaxed)) return;
  if (!may_block) {
    wake_background_();
    return;
  }
  std::unique_lock<std::mutex> lk(mu_);
  if (publishing_) return;
  publishing_ = true;
  while (!publish_q_.empty()) {
    Works batch;
    batch.swap(publish_q_);
    publish_pending_.store(false, std::memory_order_relaxed);
    lk.unlock();
    for (auto& w : batch) w->publish();
    batch.clear();  // (a Work may be the last holder of its outputs: dropped without the lock)
    lk.lock();
  }
  publishing_ = false;
}

bool Progress::try_progress(bool may_block, bool wait_lock) {
  Done done;
  bool any;
  {
    std::unique_lock<std::mutex> lk(mu_, std::defer_lock);
    if (wait_lock) lk.lock();
    else if (!lk.try_lock()) return false;
    // A pass that only set messages aside for ops it had already stepped left work for the
    // next one, which nobody rings for: that counts as progress.
    const size_t stashed = router_.stashed();
    any = pass_locked(done) || router_.stashed() > stashed;
  }
  finish(done, may_block);
  return any;
}

int Progress::busy_with(int peer) {
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) return -1;
  if (stopped_) return 0;
  auto has = [peer](const std::vector<int>& ranks) {
    return std::find(ranks.begin(), ranks.end(), peer) != ranks.end();
  };
  for (const GroupState* g : busy_)
    if (!g->queue.empty() && has(g->ranks)) return 1;
  for (const RecvPort* port : busy_ports_)
    if (has(port->group->ranks)) return 1;
  return 0;
}

bool Progress::from_transport() {
  Done done;
  {
    std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
    if (!lk.owns_lock()) {
      // The holder may run no pass (new_group) or have looked at this peer already: rerun_
      // keeps drivers to short sleeps, and this thread's next pass from ending, until a pass
      // has run since.
      rerun_.store(true);
      return false;
    }
    if (stopped_) return false;
    // Passes repeat while a thread was refused meanwhile, and while they make progress or
    // stash messages (a pass can leave work for the next, which nobody rings for). Bounded: a
    // peer streaming frames could otherwise keep this thread, and the lock, forever.
    bool more = false;
    for (int pass = 0; pass < 8; ++pass) {
      const size_t stashed = router_.stashed();
      more = pass_locked(done) || router_.stashed() > stashed || rerun_.load();
      if (!more || stopped_) break;
    }
    if (more) bell_.ring();
  }
  if (done.empty()) return true;
  // Wakes the threads waiting for these Works. Their Futures are completed by a driver, never
  // here: a callback runs user code, which could shut fastcomm (and this thread) down.
  bell_.ring_if_sleeping();
  if (publish_pending_.load(std::memory_order_relaxed)) {
    bell_.ring();
    wake_background_();
  }
  return true;
}

}  // namespace fastcomm
