#pragma once
// The engine: one per process. It knows every peer once (from the rendezvous the Python layer
// runs through the c10d Store), owns the transports, the groups and their op queues, and
// drives progress.
//
// Groups are plain records (id, ranks, sequence counters): creating one touches nothing
// shared, so thousands cost no threads, connections or memory beyond the record. Ops of one
// group run one after another in issue order; ops of different groups progress independently
// in the same loop, so no group ever waits on another.
//
// Threading: all engine state (groups, queues, transports, stash) is guarded by mu_. Progress
// is driven by whichever thread waits (Work::wait, blocking calls), and by one background
// thread, started on the first async op, that steps in only while async ops are pending and no
// foreground thread is driving. Blocking bindings release the GIL before they get here.
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "algorithms/op.h"
#include "common/doorbell.h"
#include "engine/work.h"
#include "transport/gloo/transport.h"
#include "transport/shm/transport.h"

namespace fastcomm {

using Clock = std::chrono::steady_clock;

struct GroupState;

// What Python holds for a group. `state` is null on a rank that is not a member.
struct GroupHandle {
  std::vector<int> ranks;  // sorted global ranks; group rank i is ranks[i]
  int rank = -1;           // this process's group rank, -1 if not a member
  uint64_t id = 0;
  std::shared_ptr<GroupState> state;
  std::string label() const;
};

struct EngineOptions {
  int rank = 0;
  int world_size = 1;
  std::string token;            // random per job, from the store
  std::vector<int> host_of;     // host index per global rank
  std::vector<int64_t> pids;    // pid per global rank
  size_t ring_bytes = 1 << 20;  // shared-memory ring per peer and direction
  int64_t timeout_ms = 300000;  // an op not finished by then fails
  int64_t spin_ns = -1;         // waiting policy; -1 picks by oversubscription
  int64_t yield_ns = -1;
};

// A subsystem made on first use and shut down with the engine (the CUDA/NCCL path,
// engine/cuda_ops.h). Type-erased so that the engine builds the same with and without CUDA,
// and so the CPU path never looks at it.
class EngineExtension {
 public:
  virtual ~EngineExtension() = default;
  virtual void shutdown() = 0;
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  explicit Engine(EngineOptions opts);
  ~Engine();

  // Init steps; between them the Python layer synchronises the ranks through the store.
  void attach_peers();
  void unlink_segment();
  // A failed init: removes the names of every same-host rank's segment (a rank that died
  // mid-init cannot remove its own) and shuts down.
  void abandon_init();
  // Hands over the world-level Gloo process group that reaches ranks on other hosts (made by
  // the Python layer when the job spans hosts); without it, cross-host groups are refused.
  void set_gloo(c10::intrusive_ptr<c10d::Backend> pg);

  GroupHandle new_group(std::vector<int> ranks);
  std::vector<GroupHandle> new_groups(const std::vector<std::vector<int>>& lists);

  // A validated op, not yet issued. Collectives are prepared (all argument checks happen
  // here, before anything is sent) and then posted, alone or as one batch.
  struct Prepared {
    GroupHandle group;
    std::unique_ptr<Op> op;
    c10d::OpType type;
  };
  using RedOp = c10d::ReduceOp::RedOpType;
  Prepared prepare_all_reduce(const GroupHandle& g, const at::Tensor& t, RedOp op);
  Prepared prepare_broadcast(const GroupHandle& g, const at::Tensor& t, int src);
  Prepared prepare_all_gather(const GroupHandle& g, const std::vector<at::Tensor>& outs,
                              const at::Tensor& in);
  Prepared prepare_all_gather_into_tensor(const GroupHandle& g, const at::Tensor& out,
                                          const at::Tensor& in);
  Prepared prepare_reduce_scatter(const GroupHandle& g, const at::Tensor& out,
                                  const std::vector<at::Tensor>& ins, RedOp op);
  Prepared prepare_reduce_scatter_tensor(const GroupHandle& g, const at::Tensor& out,
                                         const at::Tensor& in, RedOp op);
  Prepared prepare_barrier(const GroupHandle& g);
  Prepared prepare_p2p(const GroupHandle& g, const at::Tensor& t, int peer, int tag, bool sending);

  // Issues the ops together: one progress pass, one coalesced write and wake-up per peer, and
  // one Work that completes when all of them have (its error is the first op's error).
  c10::intrusive_ptr<Work> post(std::vector<Prepared> ops, bool async_op);

  // Blocks until `w` completes (or the user timeout passes, which throws), driving progress.
  void wait(Work& w, std::chrono::milliseconds timeout);
  // One non-blocking progress attempt (for is_completed polling).
  void poll();
  // Fails every pending op, stops the background thread and unmaps the transport.
  void shutdown();
  bool is_shut_down() const { return shut_down_.load(); }
  // What tests check the Gloo transport by (all 0 on a one-host job): frames sent, peers that
  // shutdown asked to confirm they had read our last frames, bulk transfers started, and bulk
  // transfers not over yet.
  struct GlooCounters {
    uint64_t frames_sent = 0, closes_sent = 0, bulk_started = 0, bulk_live = 0, frames_unreaped = 0;
  };
  GlooCounters gloo_counters();
  // Sleeps of a driver that ran their whole slice with nobody ringing, after which there was
  // work to do: wake-ups the protocol lost (each costs up to a slice, 5 ms), but also work
  // that came just before the slice ended, its ring still on the way (a peer's death or an
  // op's deadline, which nobody rings for, is noticed by the health check, not counted here).
  // A diagnostic: timing makes it nonzero now and then, so no test asserts on it.
  uint64_t stalled_sleeps() const { return stalled_sleeps_.load(std::memory_order_relaxed); }

  // The job's store (set by the Python layer after the rendezvous) and the CUDA path made
  // lazily at the first CUDA op: both only matter off the CPU hot path.
  void set_store(c10::intrusive_ptr<c10d::Store> s) { store_ = std::move(s); }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  std::mutex& extension_mutex() { return ext_mu_; }
  std::shared_ptr<EngineExtension>& cuda_extension() { return cuda_ext_; }  // under extension_mutex()
  const EngineOptions& options() const { return opts_; }

  int rank() const { return opts_.rank; }
  int world_size() const { return opts_.world_size; }
  int64_t timeout_ms() const { return opts_.timeout_ms; }

  // Used by the group-scoped Comm view (engine.cpp).
  struct Pending;
  // `scan`: read past other ops' messages (stashing them) to find this op's; without it, only
  // the stash and the head of the peer's stream are looked at.
  const Message* peek_for(GroupState& g, Pending& p, int peer, bool scan = true);
  // `discard`: the message is dropped unused (an offer in it is drained).
  void pop_for(GroupState& g, Pending& p, int peer, bool discard = false);
  bool send_for(GroupState& g, Pending& p, int peer, const Header& h, const void* data);
  Transport* transport_for(int peer);
  // The progress pass a Gloo thread runs when bulk transfers end or a frame arrives
  // (set_gloo); false if another thread holds the lock (the caller rings the doorbell then).
  bool progress_from_transport();
  // Whether other ops run alongside the one being stepped (a batch being posted, or several
  // async ops pending): the transports' hint that a link will be busy (Transport::bulk_min).
  bool more_ops_in_flight() const { return posting_batch_ || pending_async_.load() > 1; }
  void flush_sends() {
    shm_->flush();
    if (gloo_) gloo_->flush();
  }
  size_t max_payload() const { return shm_ ? shm_->max_payload() : 0; }

 private:
  using Works = std::vector<c10::intrusive_ptr<Work>>;
  // What a progress pass finished. The Works' Futures are completed after the lock drops; the
  // ops themselves are destroyed only then too (when `Done` goes out of scope, outside mu_):
  // an op may hold the last C++ reference to a tensor Python still sees, and dropping that
  // takes the GIL, which a thread waiting for mu_ may hold (new_group, say).
  struct Done {
    Works works;
    std::vector<Pending> gone;
    bool empty() const { return works.empty(); }
  };

  void check_member(const GroupHandle& g, const char* api) const;
  // The group's layout over hosts when its all_reduce and barrier should run hierarchically,
  // else null.
  std::shared_ptr<const HostLayout> host_layout(const std::vector<int>& ranks) const;
  void discard_locked(Transport* tr, int peer, const Message& m);
  void purge_stash_locked(GroupState& g, uint64_t seq);
  void check_reduce_op(const GroupHandle& g, const char* api, RedOp op, c10::ScalarType dt) const;
  int group_rank_of(const GroupHandle& g, int global, const char* api, const char* arg) const;
  GroupHandle p2p_channel(const GroupHandle& g, int src, int dst, int tag);
  bool progress_locked(Done& done);
  // may_block false: for a caller holding the GIL (poll), which must not wait for mu_.
  // wait_lock: take mu_ even if another thread holds it (else give up at once).
  bool try_progress(bool may_block = true, bool wait_lock = false);
  void finish(Done& done, bool may_block = true);
  void settle_locked(Done& done, const c10::intrusive_ptr<Work>& w, std::exception_ptr e);
  void fail_front_locked(GroupState& g, std::exception_ptr e, Done& done, bool tell_peers);
  void health_locked(Done& done);
  // Drops messages of finished ops at the head of the group's peers' streams; true if any.
  bool drop_stale_locked(GroupState& g);
  void drive(Work* w, Clock::time_point user_deadline, bool has_deadline);
  void bg_main();
  void ensure_bg_thread();

  EngineOptions opts_;
  const uint64_t serial_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::mutex ext_mu_;
  std::shared_ptr<EngineExtension> cuda_ext_;
  std::mutex mu_;
  std::unique_ptr<ShmTransport> shm_;
  std::unique_ptr<GlooTransport> gloo_;  // peers on other hosts; null on a one-host job
  Doorbell bell_;
  std::unordered_map<uint64_t, std::shared_ptr<GroupState>> groups_;
  std::map<std::vector<int>, uint32_t> instances_;  // how many groups over each rank list
  std::vector<GroupState*> busy_;                   // groups with queued ops
  std::vector<char> dead_;                          // peers known to have exited
  Works publish_q_;                                 // settled Works whose Futures await completion
  bool publishing_ = false;                         // a thread is completing publish_q_'s Futures
  std::atomic<bool> publish_pending_{false};
  // A transport thread delivered something but found the lock taken (progress_from_transport);
  // cleared by the next pass to start. seq_cst: see drive().
  std::atomic<bool> rerun_{false};
  // send/recv channels: one ordered two-member pseudo-group per (group, src, dst, tag).
  std::map<std::tuple<uint64_t, int, int, int>, GroupHandle> p2p_;

  struct StashKey {
    uint64_t group, seq;
    int peer;
    bool operator==(const StashKey& o) const {
      return group == o.group && seq == o.seq && peer == o.peer;
    }
  };
  struct StashHash {
    size_t operator()(const StashKey& k) const {
      return std::hash<uint64_t>()(k.group * 0x9e3779b97f4a7c15ULL ^ k.seq * 31 ^ (uint64_t)k.peer);
    }
  };
  struct Stashed {
    Message msg;
    std::vector<uint8_t> bytes;
  };
  // Messages that arrived for an op this rank has not started yet (or for another group's op
  // while a different op was reading the same peer); replayed in arrival order.
  std::unordered_map<StashKey, std::deque<Stashed>, StashHash> stash_;
  size_t stash_msgs_ = 0;

  std::atomic<bool> shut_down_{false};
  std::atomic<int> pending_async_{0};
  bool posting_batch_ = false;  // the eager pass of a post() of several ops is running (mu_)
  std::atomic<int> fg_drivers_{0};
  std::mutex bg_mu_;
  std::condition_variable bg_cv_;
  std::thread bg_;
  bool bg_stop_ = false;
  std::atomic<bool> bg_started_{false};
  std::atomic<bool> bg_deep_{false};  // the background thread sleeps until rung, not ticking
  int64_t spin_ns_;
  int64_t yield_ns_;
  std::atomic<uint64_t> stalled_sleeps_{0};
  bool hierarchical_ = true;  // FASTCOMM_HIERARCHICAL=0 turns the hierarchical collectives off
};

}  // namespace fastcomm
