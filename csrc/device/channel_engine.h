#pragma once
// The device engine of device/engine.h, one class over a few files, each one job:
//   engine.cpp     issue (the caller's side): post, waits, plan captures, test hooks, shutdown
//   engine_thread.cpp the engine thread: its loop, ops admitted, chained in their group's order
//                  and made ready, one pass over channels, group communicators and health
//   op_end.cpp     the rest of an op's life: launched, its end work, finished, settled
//   channel.cpp    a pair's channel: the agreement frames, launches in agreed order, harvest,
//                  faults
//   group_comm.cpp large ops of groups of 3+ on the group's own communicator
//   health.cpp     deadlines, peers gone, teardown
//   ipc_channel.cpp a same-host pair's channel over CUDA IPC (device/ipc_link.h) instead of NCCL
//   graph.cpp      a plan captured into a CUDA graph (device/graph.h), on the caller's thread
//   any_source.cpp recvs bound to their sender when posted without one (device/recv_ports.h)
// Every runtime call on a communicator or an engine stream is made by the engine thread, so an
// abort never races another call on the same communicator.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "device/agreement.h"
#include "device/engine.h"
#include "device/ipc_link.h"
#include "device/ops.h"
#include "device/publisher.h"
#include "device/recv_ports.h"

namespace fastcomm {
namespace device {

class PlanGraph;

// What holds one of the device's kernel slots (FASTCOMM_DEVICE_MAX_KERNELS) while its kernels
// may be on its stream: a pair's NCCL channel or a group's communicator (docs/design.md,
// "Kernels in flight").
struct SlotUser {
  virtual ~SlotUser() = default;
  // Whether a slot granted now would be used (a queue entry that no longer would is skipped).
  virtual bool wants_slot() const = 0;
  bool slot = false;
  bool slot_queued = false;
};

// This rank's side of the pair with `peer`: a two-rank communicator on a stream of its own,
// made at the pair's first op. The lower rank leads: it proposes each op once it is ready; the
// other commits the proposals it has a matching ready op for, in whatever order they become
// ready, and both launch in commit order. So the channel's order is one both sides agreed on,
// and no op waits behind one its peer has not issued.
struct Channel final : SlotUser {
  explicit Channel(int p, bool lead) : peer(p), leader(lead), agree(lead) {}
  int peer = -1;
  bool leader = false;
  Comm comm = nullptr;  // this epoch's (an NCCL communicator or an IpcLink); null until its first proposal
  bool id_sent = false;
  UniqueId id;
  Stream stream = nullptr;
  std::exception_ptr failed;  // set: the peer is gone or its control path failed; every op fails
  // The peer looks gone (the host says so, a control message failed) or the communicator
  // failed: transfers already done on the device are still harvested until `doomed_at`, then
  // the channel is failed (or reset) with `doomed_why`.
  std::string doomed_why;
  Clock::time_point doomed_at;
  bool doomed_for_good = true;  // else a reset follows
  PairAgreement agree;          // which parts run, in which order (device/agreement.h)
  std::deque<Part*> committed;  // agreed, not yet launched
  std::vector<Part*> launching;  // launched (over IPC: some chunks may still be held back); no event yet
  std::deque<Part*> in_flight;   // launched and recorded, not yet seen done
  std::string reset_why;         // why the last reset cancelled what it did
  std::vector<Comm> retired;     // released by the leader; destroyed once nothing here runs on them
  Clock::time_point last_used = Clock::now();  // a launch or a harvest
  c10::intrusive_ptr<Work> rx;
  at::Tensor rx_buf;
  std::deque<std::pair<c10::intrusive_ptr<Work>, at::Tensor>> tx;  // frames out, and their buffers
  bool wants_comm = false;  // single-stream scheme: parts wait for the communicator
  // The kernel bound (FASTCOMM_DEVICE_MAX_KERNELS): an NCCL channel with work committed or on
  // its stream holds one of the device's slots. The follower sends its commits only once it
  // holds one (`held`: commit frames waiting for it), so a leader's launch always meets a peer
  // kernel that is, or will be, launched without waiting for anything else.
  std::vector<Frame> held;
  bool wants_slot() const override { return !failed && !committed.empty(); }
  bool busy() const {
    return agree.holding() || agree.has_proposals_to_send() || !committed.empty() || !launching.empty() ||
           !in_flight.empty();
  }
};

// A large op of a group of three or more (FASTCOMM_RSAG_THRESHOLD bytes and up) runs as one
// NCCL collective on a communicator of the group's own, made at its first such op: no member
// moves (n - 1)x its data. The group's rank 0 proposes the op to every member over their pair
// channels; once all have committed it tells each to go (or, after a mismatch, refuses), so no
// member launches a collective another will not join. Ops reach the communicator in the
// group's issue order (an op is ready once the previous one is enqueued).
// Under the kernel bound its kernels hold a slot: the members take theirs one after another,
// highest rank first (rank 0 proposes to the next lower member once the one above committed,
// and a member commits once its group holds a slot), then rank 0 takes its own before its go.
struct GroupComm final : SlotUser {
  std::vector<int> ranks;
  int me = 0;
  Comm comm = nullptr;
  Stream stream = nullptr;
  UniqueId id;
  bool id_sent = false;
  std::exception_ptr failed;
  std::string doomed_why;  // as Channel's: a member looks gone, collectives that ran are harvested first
  Clock::time_point doomed_at;
  std::deque<DevOp*> queued;  // agreed, waiting for the communicator
  DevOp* launching = nullptr;  // launched; its end not yet recorded (a non-blocking launch)
  std::deque<std::pair<DevOp*, EventPtr>> in_flight;
  UniqueId next_id;              // member: the communicator the leader's last kGo brought
  bool has_next = false;
  bool release_pending = false;  // member: the leader released the group's communicator
  Clock::time_point last_used = Clock::now();
  // The kernel bound. Member: commits (and their epoch on the channel to rank 0) held until
  // the group holds a slot, and ops committed that await rank 0's decision. Rank 0: agreed ops
  // whose go waits for the slot.
  std::vector<std::pair<Entry, uint32_t>> held;
  int awaiting = 0;
  std::deque<DevOp*> to_go;
  bool busy() const { return !queued.empty() || launching != nullptr || !in_flight.empty(); }
  bool wants_slot() const override { return !failed && (!held.empty() || !to_go.empty()); }
};

class ChannelEngine final : public DeviceEngine, public WorkOwner, public std::enable_shared_from_this<ChannelEngine> {
 public:
  ChannelEngine(const EngineOptions& opts, HostLink& host, std::unique_ptr<Runtime> rt);
  ~ChannelEngine() override { shutdown(); }

  c10::intrusive_ptr<Work> post(std::vector<DeviceOp> ops, bool async_op, bool rethrow) override;
  // A plan captured into a CUDA graph (device/graph.h), on the caller's thread.
  std::shared_ptr<DeviceGraph> capture(std::vector<DeviceOp> ops, bool naive) override;
  void shutdown() override;
  void synchronize() override;
  int64_t debug(const std::string& what, int64_t arg) override;

  // WorkOwner
  Runtime& runtime() override { return *rt_; }
  std::exception_ptr broken() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return broken_;
  }
  void wait(Work& w, std::chrono::milliseconds timeout) override { wait_until(w, false, timeout); }
  void wait_launched(Work& w, std::chrono::milliseconds timeout) override { wait_until(w, true, timeout); }
  void mark_returned(DeviceWork& w) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (!w.done()) w.returned = true;
  }
  void poll() override {}
  // Makes the engine thread run a pass now (a control frame arrived).
  void wake() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      woken_ = true;
    }
    cv_.notify_one();
  }

 private:
  void wait_until(Work& w, bool launched_enough, std::chrono::milliseconds timeout);
  // Ops issued on a stream under CUDA graph capture: refused, naming the plan route.
  [[noreturn]] void throw_capture_refusal(const std::vector<DeviceOp>& dops) const;

  // ---- the engine thread (engine_thread.cpp)
  void main();
  bool pass();
  void admit(std::unique_ptr<DevOp> op);
  void chain(DevOp* op);
  void make_ready(DevOp* op);
  void ready_part(Part* p);

  // ---- the rest of an op's life (op_end.cpp)
  void part_launched(Part* p);
  void part_done(Part* p);
  // Ops whose parts are all enqueued: their end work, their end event, their group's next op.
  void flush_ends();
  void end_on(Stream s, const std::vector<DevOp*>& list, std::vector<FoldJob>& jobs, std::vector<Event>& waited);
  void ended(DevOp* op, Stream s, const EventPtr& end);
  // An op that will never be launched (it failed before): launched and finished as it is.
  void abandon(DevOp* op);
  void op_finished(DevOp* op);
  bool settle_ended();
  void settle(Batch& b, std::exception_ptr e);
  void fail_op(DevOp* op, std::exception_ptr e);
  Stream join_stream(uint64_t group);
  // Join streams of groups with nothing live go back to a pool.
  void recycle_joins();

  // ---- channels (channel.cpp)
  Channel& channel(int peer);
  // A channel's launch, NCCL or IPC: its stream first waits for each committed part's inputs
  // and its group's previous op; once enqueued, c.launching is in flight behind one event.
  void wait_inputs(Channel& c);
  // The first `n` parts of c.launching (all by default) go in flight behind one event.
  void on_stream(Channel& c, size_t n = SIZE_MAX);
  bool pump(Channel& c);
  bool exchange(Channel& c);
  void handle_frame(Channel& c, const uint8_t* data);
  // Acts on what the agreement produced; `go_id`: a group communicator's id a kGo carried.
  void apply(Channel& c, PairAgreement::Out& out, const UniqueId* go_id = nullptr);
  // `id`: a communicator id the frame carries (the pair's, or with kGo the group's), or null.
  void send_frame(Channel& c, FrameType type, const std::vector<Entry>& entries, const UniqueId* id);
  bool launch(Channel& c);
  bool launch_single();
  // The kernel bound: whether `c`'s launches count (an NCCL channel of the channels scheme),
  // take a slot (or queue for one, FIFO), give one back once nothing is committed or on the
  // stream (the next queued channel that still wants one gets it).
  bool counts_kernels(const Channel& c);
  bool take_slot(SlotUser& u);
  void drop_slot(SlotUser& u);
  void grant_slots();
  void send_held(Channel& c);
  // An op on the channel timed out: what it holds fails, the peer is told, and the next op
  // starts a new epoch on a new communicator; other groups over the pair go on.
  void reset(Channel& c, const std::string& why);
  // Rank 0 of a group, its channel with c.peer reset: the group-communicator ops whose member
  // c.peer had answered and that are not decided yet fail (the member dropped its side in the
  // reset), so decide() refuses them on every member instead of sending a go one never takes.
  void cancel_undecided(Channel& c, const std::string& why);
  // Drops the epoch's communicator and fails what was launched on it (`why`).
  void drop_epoch(Channel& c, const std::exception_ptr& why);
  // The peer is gone (or the control path failed): the channel fails for good.
  void fault(Channel& c, const std::string& why);
  // Harvests what already ran for a while, then fails the channel (`for_good`) or resets it.
  void doom(Channel& c, const std::string& why, bool for_good = true);
  void fail_part(Part* p, std::exception_ptr e);
  // Channel communicators made and ended here, counted (debug "live_comms").
  Comm new_comm(const UniqueId& id, int nranks, int rank);
  void end_comm(Comm c, bool abort);
  // A communicator (a channel's or a group's) aborted if asked, then destroyed, on the aborter.
  void retire_comm(Comm c, bool abort);
  // Idle channels' communicators released: past FASTCOMM_DEVICE_IDLE_MS, or the oldest idle
  // ones past FASTCOMM_DEVICE_MAX_COMMS (leaders only, device/agreement.h).
  void release_idle(Clock::time_point now);

  // ---- same-host channels over IPC (ipc_channel.cpp)
  // Whether the channel to `peer` is made over IPC (the leader decides, at each epoch's first
  // proposal; the follower follows the id it gets).
  bool use_ipc(int peer) const;
  // Whether the op's group (3 to FASTCOMM_DEVICE_IPC_GROUP_MAX members) is linked over IPC
  // member to member: its large ops stay on the pair channels (ops.h, Lowering::links).
  bool links_only(const DeviceOp& d) const;
  // A new epoch's link: the leader's (`leader_id` null), or the follower's for the leader's id.
  // Sets c.id to this side's id, to go to the peer.
  Comm new_link(Channel& c, const UniqueId* leader_id);
  bool launch_ipc(Channel& c, IpcLink& l);
  void drain_link(Channel& c);  // before its IPC link is retired (ipc_channel.cpp)
  // The follower's id reached the leader: maps its ring, first moving this side's to host
  // memory (and sending it again) where the follower asks; the follower maps the moved one.
  void leader_opens(Channel& c, IpcLink& l, const UniqueId& id);
  void follower_reopens(Channel& c, const UniqueId& id, uint32_t epoch);

  // ---- group communicators (group_comm.cpp)
  // Whether group communicators' kernels take slots (the kernel bound is on).
  bool group_slots() const { return max_kernels_ > 0 && !single_; }
  // Rank 0 under the bound: the members take their slots one after another, highest rank
  // first; the next lower one is proposed to once the one above has answered (part_done).
  bool propose_in_turn(DevOp* op);
  void agreed(DevOp* op);
  // Rank 0: go (or refuse) for an agreed op; the op joins the group's queue.
  void decide(DevOp* op);
  // Member: takes the group commits out of a commit frame to rank 0; they go once the group
  // holds a slot. Returns whether the frame has nothing left.
  bool hold_group_commits(Frame& f);
  void send_group_held(GroupComm& g);
  // Sends what waited for the group's slot, and gives the slot back once nothing needs it.
  bool group_slot(GroupComm& g);
  bool pump_group(GroupComm& g);
  void fault_group(GroupComm& g, const std::string& why);
  // Group communicators made and ended here, counted (debug "group_comms").
  Comm new_group_comm(GroupComm& g, const UniqueId& id);
  void end_group_comm(GroupComm& g, bool abort);
  // The group's rank 0 releases a group communicator idle past FASTCOMM_DEVICE_IDLE_MS and tells
  // the members (kGroupRelease); the next op brings a new one with its kGo.
  void release_idle_groups(Clock::time_point now);

  // ---- receives from any source (recv_ports.cpp's RecvPorts, driven in any_source.cpp)
  // Binds unbound recvs whose sender is known (and fails those that cannot be), in posting order.
  bool bind_receives();

  // ---- health and teardown (health.cpp)
  bool check_health();
  std::string waited_for(const Part& p, Channel& c, Clock::time_point now);
  void teardown();
  // A plan's ended links and the memory their runs used, from any thread (no runtime call):
  // the engine thread frees the rings in time (IpcLinks) and drops `rest`.
  void retire_links(std::vector<std::unique_ptr<IpcLink>> links, std::shared_ptr<void> rest);

  const int rank_;
  // The scheme this engine replaced, kept to show the fake runtime is faithful (tests): every
  // channel on one stream, parts launched in issue order with no agreement.
  const bool single_;
  Stream shared_ = nullptr;
  std::deque<Part*> single_queue_;  // its parts in issue order, launched strictly in that order
  HostLink& host_;
  std::unique_ptr<Runtime> rt_;
  std::shared_ptr<EventPool> events_;
  std::unique_ptr<IpcLinks> ipc_;  // same-host channels' links, live and ending
  const bool ipc_on_;              // FASTCOMM_DEVICE_IPC, and the runtime can
  const size_t ipc_ring_bytes_;
  const size_t ipc_fuse_bytes_;
  const int64_t ipc_group_max_;    // FASTCOMM_DEVICE_IPC_GROUP_MAX
  std::unordered_set<int> host_rings_;  // peers whose links' rings are in host memory (engine thread)
  const std::vector<int> host_of_;
  Stream alloc_ = nullptr;  // the stream scratch is allocated on (freed only once its ops settled)

  mutable std::mutex mu_;  // guards the fields up to the thread's own state below
  std::condition_variable cv_;       // wakes the engine thread
  std::condition_variable done_cv_;  // wakes waiters
  std::vector<std::unique_ptr<DevOp>> incoming_;
  RecvNumbers numbers_;  // receive numbers taken at post, and the ports whose recvs queue
  // A blocking call returns once its op is enqueued; an error found after that is raised by the
  // group's next op.
  std::unordered_map<uint64_t, std::string> deferred_;
  std::exception_ptr broken_;
  std::unordered_set<int> failed_peers_;  // peers whose channel was aborted (test hook)
  bool stop_ = false;
  bool shut_down_ = false;  // shutdown() ran (stop_ alone may be the engine thread's own, on a failure)
  bool woken_ = false;
  std::vector<std::unique_ptr<IpcLink>> retired_links_;  // plans' links, for ipc_ to free
  std::vector<std::shared_ptr<void>> retired_rest_;       // ... and what their runs used
  std::thread thread_;

  // The engine thread's own state.
  std::unordered_map<uint64_t, DevOp*> tail_;  // last op of each group id
  std::vector<std::unique_ptr<DevOp>> live_;
  std::unordered_map<int, std::unique_ptr<Channel>> channels_;
  std::unordered_map<uint64_t, std::unique_ptr<GroupComm>> groups_;
  RecvPorts ports_;                // unbound recvs, per (group, tag)
  std::vector<DevOp*> unbound_;    // ... their ops (deadlines)
  std::unordered_map<uint64_t, Stream> joins_;  // the end work of ops of 3+ on channels, per group
  std::vector<Stream> free_joins_;
  const std::chrono::milliseconds idle_release_;
  const size_t max_comms_;
  const int64_t max_kernels_;     // FASTCOMM_DEVICE_MAX_KERNELS (0: unbounded)
  int64_t kernels_ = 0;           // slots held
  std::deque<SlotUser*> slot_queue_;  // channels and groups waiting for a slot, in request order
  std::atomic<int64_t> slot_waits_{0};  // requests that had to queue (debug "kernel_waits")
  std::atomic<int64_t> slots_held_{0};  // kernels_, readable from any thread (debug "kernels")
  std::atomic<int64_t> live_comms_{0};
  std::atomic<int64_t> ended_comms_{0};
  std::atomic<int64_t> group_comms_{0};
  std::atomic<int64_t> join_streams_{0};
  std::atomic<int64_t> ring_fold_bytes_{0};  // folded straight from IPC rings (debug "ipc_ring_fold_bytes")
  std::vector<Channel*> pass_channels_;  // pass()'s snapshots, kept to reuse their memory
  std::vector<GroupComm*> pass_groups_;
  std::vector<DevOp*> to_end_;  // launched on every channel, end work not enqueued yet
  std::vector<at::Tensor> frame_pool_;  // control frame buffers whose send completed
  const size_t group_comm_bytes_;
  std::vector<std::shared_ptr<Batch>> ending_;  // every op finished, ends not yet seen run
  // The end of the last launched op of each group id, while it may not have run: the group's
  // next op waits for it even when the op itself is gone.
  std::unordered_map<uint64_t, std::pair<Stream, EventPtr>> last_end_;
  Publisher publisher_{[this](const std::function<void()>& f) { rt_->on_idle_stream(f); }};
  Aborter aborter_;  // joined in teardown, before the runtime goes
  Clock::time_point last_health_ = Clock::now();
  std::atomic<int64_t> plan_links_{0};  // plans' links made (debug "plan_ipc_links")
  std::atomic<int64_t> plan_serial_{0};  // plans whose pairs all went on one stream (debug "plan_serial")
  std::atomic<int64_t> plan_releasing_{0};  // graphs dropped, waiting for their runs
  std::atomic<bool> torn_down_{false};  // debug "engine_torn_down": the engine thread ended its teardown
  // Group communicators the leader released, and new ones its go brought (debug
  // "group_releases_heard", "group_next_ids"): members swap them once nothing runs on the old.
  std::atomic<int64_t> group_releases_heard_{0}, group_next_ids_{0};
  // Group ops committed here and awaiting rank 0's go, as of the last pass (debug
  // "awaiting_decision"; counted only once that was asked, off the hot path otherwise).
  std::atomic<int64_t> awaiting_decision_{0};
  std::atomic<bool> awaiting_wanted_{false};
  std::mutex graphs_mu_;
  std::vector<std::weak_ptr<PlanGraph>> graphs_;  // aborted at shutdown
};

}  // namespace device
}  // namespace fastcomm
