#pragma once
// Groups: plain records made by their members alone. Creating one touches nothing shared, so
// thousands cost no threads, connections or memory beyond the record. Ops of one group run
// one after another in issue order (the group's queue); different groups never wait on each
// other.
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "algorithms/op.h"
#include "algorithms/request.h"
#include "engine/work.h"

namespace fastcomm {

class TransportSet;
using Clock = std::chrono::steady_clock;

// An op posted on a group, queued there until it finishes.
struct Pending {
  OpPtr op;
  std::shared_ptr<const void> keep;  // a plan's op: the plan, kept until the entry is dropped
  c10::intrusive_ptr<Work> work;
  uint64_t seq = 0;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};  // > 0: the op's own (the deadline's), not its group's
};

// Guarded by the engine lock, except the fields fixed at creation.
struct GroupState {
  uint64_t engine = 0;  // serial of the engine that made it: handles do not outlive shutdown()
  uint64_t id = 0;
  std::vector<int> ranks;
  int rank = -1;
  std::string label;
  std::shared_ptr<const HostLayout> hosts;  // set: all_reduce and barrier run hierarchically
  std::chrono::milliseconds timeout{0};     // how long one of its ops may take
  uint64_t next_seq = 0;  // seq of the next op posted
  uint64_t head_seq = 0;  // seq of the oldest unfinished op; older messages are stale
  std::deque<Pending> queue;
  bool busy = false;  // in the progress pass's list of groups with queued ops
};

// A receive waiting in a RecvPort to be matched to a sender: its Pending (seq unset until it
// is bound to a channel) and, for a specific-source receive, that channel (null: any source).
struct WaitingRecv {
  Pending p;
  GroupState* channel = nullptr;
};

// The receives of one (group, tag) on this rank that must be matched in posting order, as MPI
// does: a message goes to the earliest posted receive that accepts its sender. Every
// any-source receive waits here, and so does a specific one posted while an any-source one is
// still waiting (it could otherwise take a message meant for that one); a specific receive
// posted while none waits goes straight to its channel. Made at the group's first any-source
// receive with that tag, with the channels from every other member. Under the engine lock.
struct RecvPort {
  std::shared_ptr<GroupState> group;  // the group the receives were posted on
  int tag = 0;
  std::vector<GroupState*> from;  // by group rank: the channel from that member (null: this rank)
  std::deque<WaitingRecv> waiting;
  size_t next_try = 0;  // the member tried first at the next match (fairness among senders)
  bool busy = false;    // in the progress pass's list of ports with waiting receives
};

// The op of an any-source receive until it is matched: it holds the request (its tensor) for
// the receive op made once the sender is known, and is never stepped.
class UnboundRecv final : public Op {
 public:
  explicit UnboundRecv(OpRequest r)
      : Op(OpDesc{OpKind::kSend, r.tensor.scalar_type(), c10d::ReduceOp::SUM, (uint64_t)r.tensor.numel(), -1}),
        req_(std::move(r)) {}
  bool step(Comm&) override { return false; }
  bool done() const override { return false; }
  void append_outputs(std::vector<at::Tensor>& out) const override { out.push_back(req_.tensor); }
  const OpRequest& request() const { return req_; }

 private:
  OpRequest req_;
};

// What Python holds for a group. `state` is null on a rank that is not a member.
struct GroupHandle {
  std::vector<int> ranks;  // sorted global ranks; group rank i is ranks[i]
  int rank = -1;           // this process's group rank, -1 if not a member
  uint64_t id = 0;
  std::shared_ptr<GroupState> state;
  std::string label() const;  // ranks_label(ranks)
};

// "[0, 1, 2]": how messages name a group.
std::string ranks_label(const std::vector<int>& ranks);

// Every group this process is a member of, by id. Under the engine lock.
class GroupRegistry {
 public:
  GroupRegistry(uint64_t engine_serial, int rank, std::vector<int> host_of, bool hierarchical);

  // Members agree on a group's id without talking: it is a function of the rank list and of how
  // many groups over that list this process made before (members make them in the same order,
  // as with torch.distributed.new_group). Ranks must be reachable through `tr`. Every group
  // made here gets `timeout` for its ops.
  std::vector<GroupHandle> create(const std::vector<std::vector<int>>& lists, TransportSet& tr,
                                  std::chrono::milliseconds timeout);
  // A send/recv channel: a two-member pseudo-group per (group, src, dst, tag), made on first use
  // by each side alone; the k-th send from src to dst with a tag matches the k-th recv. It
  // times out as its group does.
  GroupHandle channel(const GroupHandle& g, int src, int dst, int tag);
  // The receive port of (group, tag), made with its channels on first use.
  RecvPort* port(const std::shared_ptr<GroupState>& g, int tag);
  // The port of (group id, tag) if one was made, else null.
  RecvPort* find_port(uint64_t group, int tag) const {
    if (ports_.empty()) return nullptr;
    auto it = ports_.find({group, tag});
    return it == ports_.end() ? nullptr : it->second.get();
  }
  GroupState* find(uint64_t id) const {
    auto it = groups_.find(id);
    return it == groups_.end() ? nullptr : it->second.get();
  }
  // Whether `g` was made by this registry's engine (not one from before a shutdown).
  bool owns(const GroupState& g) const { return g.engine == serial_; }
  void clear();

 private:
  std::shared_ptr<const HostLayout> host_layout(const std::vector<int>& ranks) const;

  const uint64_t serial_;
  const int rank_;
  const std::vector<int> host_of_;
  const bool hierarchical_;
  std::unordered_map<uint64_t, std::shared_ptr<GroupState>> groups_;
  std::map<std::vector<int>, uint32_t> instances_;  // how many groups over each rank list
  std::map<std::tuple<uint64_t, int, int, int>, GroupHandle> channels_;
  std::map<std::pair<uint64_t, int>, std::unique_ptr<RecvPort>> ports_;
};

// What checks and algorithms see of a member's group.
inline GroupView view_of(const GroupState& g, int global_rank, size_t rsag_threshold,
                        size_t direct_min = SIZE_MAX, size_t pair_message_max = 0) {
  return GroupView{g.ranks, g.rank, global_rank, g.hosts, rsag_threshold, direct_min, pair_message_max};
}

}  // namespace fastcomm
