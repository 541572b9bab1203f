#pragma once
// Progress: the pass that steps the front op of every group with queued ops, the health check
// that fails ops whose peer died or whose deadline passed, and the settling of Works. Passes
// run under the engine lock; Futures are completed outside it (finish()).
//
// Ops are destroyed outside the lock too: an op may hold the last C++ reference to a tensor
// Python still sees, and dropping that takes the GIL, which a thread waiting for the lock may
// hold (new_group, say). So a pass collects what it finished in a Done, dropped after unlock.
#include <c10/util/SmallVector.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <vector>

#include "common/doorbell.h"
#include "engine/group.h"
#include "engine/router.h"
#include "transport/transport_set.h"

namespace fastcomm {

class Progress {
 public:
  using Works = std::vector<c10::intrusive_ptr<Work>>;
  // Inline storage: a blocking op's pass finishes one op, and allocating here would be a
  // measurable part of its cost.
  struct Done {
    c10::SmallVector<c10::intrusive_ptr<Work>, 2> works;
    c10::SmallVector<Pending, 2> gone;
    bool empty() const { return works.empty(); }
  };

  // `wake_background`: wakes the thread that drives async ops (it completes Futures that a
  // caller unable to block left behind).
  Progress(std::mutex& mu, int rank, std::vector<int64_t> pids, TransportSet& tr, MessageRouter& router,
           std::function<void()> wake_background);

  // One op of a post: its group (a send/recv's channel; an any-source recv's own group) and,
  // for a recv, the port of its (group, tag) if there is one (always, from any source).
  struct Posted {
    GroupState* group = nullptr;
    OpPtr op;
    RecvPort* port = nullptr;
    bool any_source = false;
    std::chrono::milliseconds timeout{0};  // > 0: the op's own, instead of its group's
  };
  // Under the lock. Queues `ops` on their groups as parts of `work` (each with its group's
  // timeout; a recv that must be matched in posting order on its port) and runs the eager
  // first pass, so small ops' sends leave before the caller even waits. A group with a member
  // known dead fails its op at once, sending nothing. (Inline storage: a blocking op posts one.)
  // `keep`: held by every queue entry of this post (a plan, for the ops it owns).
  using PostedOps = c10::SmallVector<Posted, 1>;
  void post_locked(PostedOps ops, const c10::intrusive_ptr<Work>& work, Done& done,
                   const std::shared_ptr<const void>& keep = nullptr);
  // A blocking op of one group, stepped once before anything is queued for it: most small
  // ops in small groups finish in that step, and then need no Work and no queue entry.
  // kFinished and kFailed (`err` set, peers told) leave the group at its next op; kQueue
  // (not finished, or not tried: the group has queued ops, a member died, progress stopped)
  // leaves it for post_locked() in the same locked section, which gives it this same seq.
  // `spins`: further steps it may take, with a pause between them, while only the peers'
  // answer is missing (a peer a little behind answers within a microsecond, and queueing
  // costs more than that).
  enum class Alone { kFinished, kFailed, kQueue };
  Alone step_alone_locked(GroupState& g, Op& op, int spins, Done& done, std::exception_ptr& err);
  // One pass over the busy groups; true if anything moved.
  bool pass_locked(Done& done);
  // Slow path, run while waiting: peers that exited, ops past their deadline.
  void health_locked(Done& done);
  void health();  // takes the lock, finishes
  // Returns once no thread is inside a section under the lock (shutdown's included).
  void sync() { std::lock_guard<std::mutex> lk(mu_); }
  // Fails every queued op with `e` and stops all passes (shutdown).
  void stop_locked(std::exception_ptr e, Done& done);
  bool stopped() const { return stopped_.load(); }

  // Outside the lock, after a pass that finished ops: wakes sleepers, completes Futures.
  // `may_block` false: for a caller that must not wait for the lock (it holds the GIL).
  void finish(Done& done, bool may_block = true);
  // Takes the lock (or, unless `wait_lock`, gives up at once if it is held), runs a pass,
  // finishes. True if anything moved (or was set aside for the next pass).
  bool try_progress(bool may_block = true, bool wait_lock = false);
  // The pass a transport's own thread runs once it delivered something (set_delivery_hook);
  // false if another thread holds the lock (the caller rings the doorbell then).
  bool from_transport();
  // 1 if an op of a group (or a receive) with `peer` is queued, 0 if none is or progress has
  // stopped, -1 if another thread holds the lock (the caller asks again).
  int busy_with(int peer);

  // A transport thread delivered something but found the lock taken; cleared by the next pass.
  bool rerun() const { return rerun_.load(); }
  // Async ops not finished yet (the background thread drives while there are any).
  int pending_async() const { return pending_async_.load(); }
  bool publish_pending() const { return publish_pending_.load(std::memory_order_relaxed); }
  Doorbell bell() const { return bell_; }

 private:
  void settle_locked(Done& done, const c10::intrusive_ptr<Work>& w, std::exception_ptr e);
  // `skip`: members not to tell (indexed by rank; null: tell every live member).
  void fail_front_locked(GroupState& g, std::exception_ptr e, Done& done, bool tell_peers,
                         const std::vector<char>* skip = nullptr);
  // Best effort: an abort notice of op `p` with `e`'s message to the group's live members.
  void tell_peers_locked(const GroupState& g, const Pending& p, std::exception_ptr e,
                         const std::vector<char>* skip = nullptr);
  // Drops the groups whose queues emptied, keeping the others in the order they became busy:
  // passes step them in that order, the order their peers' messages come in, so a pass does
  // not set aside (stash) the messages of groups it has yet to reach.
  void drop_idle_locked();
  bool pass_once_locked(Done& done);  // pass_locked's pass
  void idle_port_locked(size_t i);  // drops busy_ports_[i], with no receive waiting
  void enqueue_locked(GroupState& g, Pending p);
  // The pass a post runs at once, and a second one when the first may have left work for it.
  void eager_pass_locked(Done& done);
  // Binds the port's waiting receives, front first, to the channels their messages came on;
  // stops at an any-source one no member has sent to yet. True if any was bound.
  bool match_locked(RecvPort& port);
  // The port's any-source receives fail with `msg` (the specific ones go on to their channels).
  void fail_any_source_locked(RecvPort& port, const std::string& msg, Done& done);
  std::string port_prefix(const RecvPort& port, const Pending& p) const;
  std::string failure_prefix(const GroupState& g, const Pending& p) const;
  // "rank 1 (pid 7) has exited" (a transport's reason, if any, after the pid), naming every
  // member of `ranks` known dead ("" if none): when several exit, which one a rank notices
  // first is a race, so none is singled out.
  std::string exited_locked(const std::vector<int>& ranks) const;

  std::mutex& mu_;
  const int rank_;
  const std::vector<int64_t> pids_;
  TransportSet& tr_;
  MessageRouter& router_;
  const std::function<void()> wake_background_;
  const Doorbell bell_;

  std::vector<GroupState*> busy_;  // groups with queued ops
  std::vector<RecvPort*> busy_ports_;  // ports with waiting receives
  std::vector<char> dead_;         // peers known to have exited
  int n_dead_ = 0;                 // how many: while 0, posts and steps skip the per-member look
  Works publish_q_;                // settled Works whose Futures await completion
  bool publishing_ = false;        // a thread is completing publish_q_'s Futures
  bool posting_batch_ = false;     // the eager pass of a post() of several ops is running
  std::atomic<bool> publish_pending_{false};
  std::atomic<bool> rerun_{false};  // seq_cst: see Driver::drive
  std::atomic<int> pending_async_{0};
  std::atomic<bool> stopped_{false};
};

}  // namespace fastcomm
