#include "engine/engine.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "algorithms/reduce.h"
#include "common/errors.h"

namespace fastcomm {

struct Engine::Pending {
  std::unique_ptr<Op> op;
  c10::intrusive_ptr<Work> work;
  uint64_t seq = 0;
  Clock::time_point deadline;
  bool async = false;
};

struct GroupState {
  uint64_t engine = 0;  // serial of the engine that made it: handles do not outlive shutdown()
  uint64_t id = 0;
  std::vector<int> ranks;
  int rank = -1;
  std::string label;
  uint64_t next_seq = 0;  // seq of the next op posted
  uint64_t head_seq = 0;  // seq of the oldest unfinished op; older messages are stale
  std::deque<Engine::Pending> queue;
  bool busy = false;
  // Set when the group spans hosts with several members on one of them: all_reduce and
  // barrier then run hierarchically (algorithms/collectives.cpp).
  std::shared_ptr<const HostLayout> hosts;
};

namespace {

// Engines are numbered so that a group handle made before shutdown() is told apart from one
// of a later init() even when the new engine happens to live at the same address.
std::atomic<uint64_t> g_engine_serial{0};

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::string ranks_label(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  os << "]";
  return os.str();
}

int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return 1;
}

}  // namespace

std::string GroupHandle::label() const { return ranks_label(ranks); }

// ---------------------------------------------------------------------------------------------
// The group-scoped view handed to algorithms.

namespace {
class OpComm final : public Comm {
 public:
  OpComm(Engine& e, GroupState& g, Engine::Pending& p) : e_(e), g_(g), p_(p) {}
  int rank() const override { return g_.rank; }
  int size() const override { return (int)g_.ranks.size(); }
  size_t max_payload() const override { return e_.max_payload(); }
  bool send(int to, uint64_t offset, uint32_t tag, const void* data, uint32_t len) override {
    return e_.send_for(g_, p_, g_.ranks[to], header(offset, tag, len), data);
  }
  size_t bulk_min(int to) override {
    const int peer = g_.ranks[to];
    return e_.transport_for(peer)->bulk_min(peer, e_.more_ops_in_flight());
  }
  std::shared_ptr<Bulk> send_bulk(int to, uint32_t tag, at::Tensor bytes) override {
    const int peer = g_.ranks[to];
    Transport* tr = e_.transport_for(peer);
    BulkOffer offer;
    offer.bytes = (uint64_t)bytes.numel();
    auto b = tr->send_bulk(peer, std::move(bytes));
    TORCH_INTERNAL_ASSERT(b, "send_bulk on a transport without bulk transfers");
    offer.slot = b->slot;
    Header h = header(0, tag, sizeof(offer));
    h.flags = kMsgBulk;
    // Transports with bulk transfers never run out of room for a message.
    TORCH_INTERNAL_ASSERT(e_.send_for(g_, p_, peer, h, &offer), "no room for a bulk offer");
    return b;
  }
  std::shared_ptr<Bulk> recv_bulk(int from, const Message& m, at::Tensor bytes, Bulk* with) override {
    const int peer = g_.ranks[from];
    BulkOffer offer;
    if (m.hdr.len != sizeof(offer)) throw_comm_error("fastcomm: malformed bulk offer from rank " + std::to_string(peer));
    std::memcpy(&offer, m.data, sizeof(offer));
    if (offer.bytes != (uint64_t)bytes.numel())
      throw_comm_error("fastcomm: rank " + std::to_string(peer) + " offered " +
                       std::to_string(offer.bytes) + " bytes for op #" + std::to_string(p_.seq) +
                       " of group " + g_.label + ", this rank expects " +
                       std::to_string(bytes.numel()));
    auto b = e_.transport_for(peer)->recv_bulk(peer, offer.slot, std::move(bytes), with);
    TORCH_INTERNAL_ASSERT(b, "bulk offer from a peer whose transport has no bulk transfers");
    return b;
  }
  void flush() override { e_.flush_sends(); }
  const Message* peek(int from) override {
    const int peer = g_.ranks[from];
    return checked(peer, e_.peek_for(g_, p_, peer));
  }
  void check_abort(int from) override {
    const int peer = g_.ranks[from];
    checked(peer, e_.peek_for(g_, p_, peer, /*scan=*/false));
  }
  void pop(int from) override { e_.pop_for(g_, p_, g_.ranks[from]); }

 private:
  // `m` (this op's next message from `peer`, or null) if it agrees with this op; otherwise the
  // op's error, the message dropped (an offer in it drained).
  const Message* checked(int peer, const Message* m) {
    if (m == nullptr) return nullptr;
    const OpDesc& d = p_.op->desc();
    const Header& h = m->hdr;
    std::string err;
    if (h.flags & kMsgAbort) {
      err = "op #" + std::to_string(p_.seq) + " (" + describe(d) + ") failed on rank " +
            std::to_string(peer) + ": " + std::string(reinterpret_cast<const char*>(m->data), h.len);
    } else if (h.kind != (uint8_t)d.kind || h.dtype != (uint8_t)d.dtype || h.numel != d.numel ||
               h.redop != (uint8_t)d.redop || h.root != d.root) {
      OpDesc theirs{(OpKind)h.kind, (c10::ScalarType)h.dtype,
                    (c10d::ReduceOp::RedOpType)h.redop, h.numel, h.root};
      err = "mismatched collectives at op #" + std::to_string(p_.seq) + ": this rank issued " +
            describe(d) + ", rank " + std::to_string(peer) + " issued " + describe(theirs);
    } else {
      return m;
    }
    e_.pop_for(g_, p_, peer, /*discard=*/true);
    throw_comm_error("fastcomm: rank " + std::to_string(g_.ranks[g_.rank]) + ", group " + g_.label +
                     ": " + err);
  }

  Header header(uint64_t offset, uint32_t tag, uint32_t len) const {
    const OpDesc& d = p_.op->desc();
    Header h;
    h.group = g_.id;
    h.seq = p_.seq;
    h.numel = d.numel;
    h.offset = offset;
    h.len = len;
    h.tag = tag;
    h.root = d.root;
    h.kind = (uint8_t)d.kind;
    h.dtype = (uint8_t)d.dtype;
    h.redop = (uint8_t)d.redop;
    return h;
  }

  Engine& e_;
  GroupState& g_;
  Engine::Pending& p_;
};
}  // namespace

// ---------------------------------------------------------------------------------------------

Engine::Engine(EngineOptions opts) : opts_(std::move(opts)), serial_(++g_engine_serial) {
  const int R = opts_.rank, W = opts_.world_size;
  TORCH_CHECK_VALUE(W >= 1 && R >= 0 && R < W, "fastcomm: invalid rank ", R, " for world size ", W);
  TORCH_CHECK_VALUE((int)opts_.host_of.size() == W && (int)opts_.pids.size() == W,
                    "fastcomm: rendezvous data does not cover the world");
  std::vector<int> local;
  for (int r = 0; r < W; ++r)
    if (opts_.host_of[r] == opts_.host_of[R]) local.push_back(r);
  select_reduce_kernels();
  shm_ = std::make_unique<ShmTransport>(R, W, opts_.token, local, opts_.pids, opts_.ring_bytes);
  bell_ = shm_->doorbell();
  dead_.assign(W, 0);
  // Spinning only pays when every local rank has a core to itself; otherwise it steals the
  // time slice the peer needs to answer, so back off to yield and sleep almost at once.
  const bool oversubscribed = (int)local.size() > usable_cpus();
  spin_ns_ = opts_.spin_ns >= 0 ? opts_.spin_ns : (oversubscribed ? 2000 : 200000);
  yield_ns_ = opts_.yield_ns >= 0 ? opts_.yield_ns : (oversubscribed ? 20000 : 2000000);
  // Must be the same on every rank (members would otherwise run different algorithms; the op
  // fails then, see collectives.cpp).
  const char* hier = std::getenv("FASTCOMM_HIERARCHICAL");
  hierarchical_ = !(hier && std::string(hier) == "0");
}

Engine::~Engine() {
  shutdown();
}

void Engine::attach_peers() {
  std::lock_guard<std::mutex> lk(mu_);
  shm_->attach_peers();
}

void Engine::unlink_segment() {
  std::lock_guard<std::mutex> lk(mu_);
  if (shm_) shm_->unlink_own();
}

void Engine::abandon_init() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shm_) shm_->unlink_local_segments();
  }
  shutdown();
}

void Engine::set_gloo(c10::intrusive_ptr<c10d::Backend> pg) {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": set_gloo after shutdown()");
  TORCH_CHECK(!gloo_, "fastcomm: rank ", opts_.rank, ": the Gloo transport is already set");
  // Waits on a peer behind Gloo last tens of microseconds at best, and the message is
  // delivered by Gloo's and the transport's threads, which a spinning or yielding waiter
  // starves of CPU. So once the job spans hosts, a waiter goes to sleep on the doorbell almost
  // at once (the receiver thread rings it), unless the user chose the policy.
  if (opts_.spin_ns < 0) spin_ns_ = 0;
  if (opts_.yield_ns < 0) yield_ns_ = 0;
  std::vector<char> remote(opts_.world_size, 0);
  for (int r = 0; r < opts_.world_size; ++r) remote[r] = !shm_->is_local(r);
  gloo_ = std::make_unique<GlooTransport>(std::move(pg), opts_.rank, opts_.world_size,
                                          std::move(remote), shm_->max_payload(), bell_,
                                          std::chrono::milliseconds(opts_.timeout_ms));
  // The thread that saw a bulk transfer end runs the pass that uses it: waking a sleeping
  // driver for that would cost a context switch per op, which on a busy core is most of what a
  // large op costs beyond the copies. The driver is woken (finish()) once its Work is done.
  gloo_->set_bulk_hook([this] { return progress_from_transport(); });
}

Engine::GlooCounters Engine::gloo_counters() {
  std::lock_guard<std::mutex> lk(mu_);
  GlooCounters c;
  if (gloo_) {
    c.frames_sent = gloo_->frames_sent();
    c.closes_sent = gloo_->closes_sent();
    c.bulk_started = gloo_->bulk_started();
    c.bulk_live = gloo_->bulk_live();
    c.frames_unreaped = gloo_->frames_unreaped();
  }
  return c;
}

Transport* Engine::transport_for(int peer) {
  if (gloo_ && !shm_->is_local(peer)) return gloo_.get();
  return shm_.get();
}

// ---------------------------------------------------------------------------------------------
// Groups

GroupHandle Engine::new_group(std::vector<int> ranks) {
  return new_groups({std::move(ranks)}).at(0);
}

std::vector<GroupHandle> Engine::new_groups(const std::vector<std::vector<int>>& lists) {
  const int me = opts_.rank, W = opts_.world_size;
  std::vector<GroupHandle> out;
  out.reserve(lists.size());
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(!shut_down_, "fastcomm: rank ", me, ": new_group after shutdown()");
  for (const auto& given : lists) {
    std::vector<int> ranks = given;
    std::sort(ranks.begin(), ranks.end());
    const std::string label = ranks_label(given);
    TORCH_CHECK_VALUE(!ranks.empty(), "fastcomm.new_group: rank ", me, ": argument 'ranks' is empty");
    for (size_t i = 0; i < ranks.size(); ++i) {
      TORCH_CHECK_VALUE(ranks[i] >= 0 && ranks[i] < W, "fastcomm.new_group: rank ", me,
                        ": argument 'ranks' ", label, " holds rank ", ranks[i],
                        ", outside the world of size ", W);
      TORCH_CHECK_VALUE(i == 0 || ranks[i] != ranks[i - 1], "fastcomm.new_group: rank ", me,
                        ": argument 'ranks' ", label, " lists rank ", ranks[i], " twice");
    }
    GroupHandle h;
    h.ranks = ranks;
    auto it = std::find(ranks.begin(), ranks.end(), me);
    if (it == ranks.end()) {
      out.push_back(std::move(h));  // not a member: nothing to create
      continue;
    }
    for (int r : ranks) {
      TORCH_CHECK(gloo_ || shm_->is_local(r), "fastcomm.new_group: rank ", me, ": group ",
                  ranks_label(ranks), " spans hosts (rank ", r,
                  " is on another host) but this engine has no Gloo transport");
    }
    // Receivers for the group's members on other hosts start now, not at the first message:
    // Gloo sends a frame only once its receiver has posted a receive, and the reaper waits on
    // frames in order, so a member slow to issue its first op would otherwise hold back the
    // reaping (and recycling) of frames to every other peer. Not for a group of the whole
    // world: every job has one (init's, torch's default group), and it says nothing about
    // which peers this rank talks to; a receiver per remote rank of the job would cost a thread
    // and a window of posted buffers each. Started before the group is registered, so that a
    // failure to start one (no thread to be had) leaves no half-made group behind.
    if (gloo_ && (int)ranks.size() < W)
      for (int r : ranks)
        if (r != me && !shm_->is_local(r)) gloo_->connect(r);
    // Members agree on the id without talking: it is a function of the rank list and of how
    // many groups over that same list this process made before (members make them in the
    // same order, as with torch.distributed.new_group).
    const uint32_t instance = instances_[ranks]++;
    uint64_t id = mix64(0x66636f6dULL ^ ranks.size());
    for (int r : ranks) id = mix64(id ^ (uint64_t)r);
    id = mix64(id ^ ((uint64_t)instance << 32));
    TORCH_INTERNAL_ASSERT(groups_.count(id) == 0, "group id collision");
    auto st = std::make_shared<GroupState>();
    st->engine = serial_;
    st->id = id;
    st->ranks = ranks;
    st->rank = (int)(it - ranks.begin());
    st->label = ranks_label(ranks);
    st->hosts = host_layout(ranks);
    groups_[id] = st;
    h.rank = st->rank;
    h.id = id;
    h.state = st;
    out.push_back(std::move(h));
  }
  return out;
}

std::shared_ptr<const HostLayout> Engine::host_layout(const std::vector<int>& ranks) const {
  if (!hierarchical_) return nullptr;
  auto L = std::make_shared<HostLayout>();
  L->leader.resize(ranks.size());
  std::unordered_map<int, int> leader_of_host;  // host index -> its lowest group rank
  for (int i = 0; i < (int)ranks.size(); ++i) {
    auto it = leader_of_host.emplace(opts_.host_of[ranks[i]], i).first;
    L->leader[i] = it->second;
    if (it->second == i) L->leaders.push_back(i);
  }
  // One host: no Gloo at all; a member per host: nothing to gather first, the flat exchange is
  // already one message per pair of hosts.
  if (L->leaders.size() < 2 || L->leaders.size() == ranks.size()) return nullptr;
  return L;
}

void Engine::check_member(const GroupHandle& g, const char* api) const {
  TORCH_CHECK(!shut_down_, "fastcomm.", api, ": rank ", opts_.rank,
              ": fastcomm was shut down; call fastcomm.init() again first");
  TORCH_CHECK_VALUE(g.state != nullptr, "fastcomm.", api, ": rank ", opts_.rank,
                    " is not a member of group ", g.label(), " (argument 'group')");
  TORCH_CHECK_VALUE(g.state->engine == serial_, "fastcomm.", api, ": rank ", opts_.rank,
                    ": argument 'group' ", g.label(),
                    " was created before fastcomm.shutdown(); create it again with new_group()");
}

// ---------------------------------------------------------------------------------------------
// Collectives: validate everything locally, before anything is sent.

namespace {
// Messages are built only on failure: TORCH_CHECK evaluates its message arguments lazily, so
// the group label is formatted there and not on every call.
void check_tensor(const at::Tensor& t, int rank, const GroupHandle& g, const char* api,
                  const char* arg) {
  TORCH_CHECK_VALUE(t.defined(), "fastcomm.", api, ": rank ", rank, ", group ", g.label(),
                    ": argument '", arg, "' is undefined");
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, "fastcomm.", api, ": rank ", rank, ", group ",
                    g.label(), ": argument '", arg, "' must be a dense tensor, got layout ", t.layout());
  TORCH_CHECK_VALUE(t.device().is_cpu(), "fastcomm.", api, ": rank ", rank, ", group ", g.label(),
                    ": argument '", arg, "' is on ", t.device(),
                    "; only CPU tensors are supported for now");
  TORCH_CHECK_VALUE(t.is_contiguous(), "fastcomm.", api, ": rank ", rank, ", group ", g.label(),
                    ": argument '", arg, "' must be contiguous");
  TORCH_CHECK_TYPE(dtype_supported(t.scalar_type()), "fastcomm.", api, ": rank ", rank, ", group ",
                   g.label(), ": argument '", arg, "' has unsupported dtype ", t.scalar_type());
}
}  // namespace

void Engine::check_reduce_op(const GroupHandle& g, const char* api, RedOp op,
                             c10::ScalarType dt) const {
  using R = c10d::ReduceOp;
  TORCH_CHECK_VALUE(op == R::SUM || op == R::AVG || op == R::PRODUCT || op == R::MIN || op == R::MAX,
                    "fastcomm.", api, ": rank ", opts_.rank, ", group ", g.label(), ": argument 'op' ",
                    redop_name(op), " is not supported (SUM, AVG, PRODUCT, MIN, MAX are)");
  TORCH_CHECK_VALUE(op != R::AVG || c10::isFloatingType(dt), "fastcomm.", api, ": rank ", opts_.rank,
                    ", group ", g.label(), ": argument 'op' AVG needs a floating dtype, got ", dt);
}

int Engine::group_rank_of(const GroupHandle& g, int global, const char* api, const char* arg) const {
  auto it = std::find(g.ranks.begin(), g.ranks.end(), global);
  TORCH_CHECK_VALUE(it != g.ranks.end(), "fastcomm.", api, ": rank ", opts_.rank, ", group ", g.label(),
                    ": argument '", arg, "' is rank ", global, ", which is not in the group");
  return (int)(it - g.ranks.begin());
}

namespace {
void check_same(const at::Tensor& a, const at::Tensor& ref, int64_t numel, int rank,
                const GroupHandle& g, const char* api, const std::string& arg) {
  check_tensor(a, rank, g, api, arg.c_str());
  TORCH_CHECK_TYPE(a.scalar_type() == ref.scalar_type(), "fastcomm.", api, ": rank ", rank, ", group ",
                   g.label(), ": argument '", arg, "' has dtype ", a.scalar_type(), ", expected ",
                   ref.scalar_type());
  TORCH_CHECK_VALUE(a.numel() == numel, "fastcomm.", api, ": rank ", rank, ", group ", g.label(),
                    ": argument '", arg, "' has ", a.numel(), " elements, expected ", numel);
}
}  // namespace

Engine::Prepared Engine::prepare_all_reduce(const GroupHandle& g, const at::Tensor& t, RedOp op) {
  check_member(g, "all_reduce");
  check_tensor(t, opts_.rank, g, "all_reduce", "tensor");
  check_reduce_op(g, "all_reduce", op, t.scalar_type());
  return {g, make_all_reduce(t, op, g.rank, (int)g.ranks.size(), g.state->hosts), c10d::OpType::ALLREDUCE};
}

Engine::Prepared Engine::prepare_broadcast(const GroupHandle& g, const at::Tensor& t, int src) {
  check_member(g, "broadcast");
  check_tensor(t, opts_.rank, g, "broadcast", "tensor");
  const int root = group_rank_of(g, src, "broadcast", "src");
  return {g, make_broadcast(t, root, g.rank, (int)g.ranks.size()), c10d::OpType::BROADCAST};
}

Engine::Prepared Engine::prepare_all_gather(const GroupHandle& g, const std::vector<at::Tensor>& outs,
                                            const at::Tensor& in) {
  check_member(g, "all_gather");
  check_tensor(in, opts_.rank, g, "all_gather", "tensor");
  TORCH_CHECK_VALUE(outs.size() == g.ranks.size(), "fastcomm.all_gather: rank ", opts_.rank, ", group ",
                    g.label(), ": argument 'tensor_list' has ", outs.size(), " tensors, expected ",
                    g.ranks.size());
  for (size_t i = 0; i < outs.size(); ++i)
    check_same(outs[i], in, in.numel(), opts_.rank, g, "all_gather",
               "tensor_list[" + std::to_string(i) + "]");
  return {g, make_all_gather(outs, in, g.rank, (int)g.ranks.size()), c10d::OpType::ALLGATHER};
}

Engine::Prepared Engine::prepare_all_gather_into_tensor(const GroupHandle& g, const at::Tensor& out,
                                                        const at::Tensor& in) {
  const char* api = "all_gather_into_tensor";
  check_member(g, api);
  check_tensor(in, opts_.rank, g, api, "input_tensor");
  const int64_t k = (int64_t)g.ranks.size();
  check_same(out, in, in.numel() * k, opts_.rank, g, api, "output_tensor");
  return {g, make_all_gather(out.reshape({-1}).chunk(k), in, g.rank, (int)k), c10d::OpType::_ALLGATHER_BASE};
}

Engine::Prepared Engine::prepare_reduce_scatter(const GroupHandle& g, const at::Tensor& out,
                                                const std::vector<at::Tensor>& ins, RedOp op) {
  const char* api = "reduce_scatter";
  check_member(g, api);
  check_tensor(out, opts_.rank, g, api, "output");
  check_reduce_op(g, api, op, out.scalar_type());
  TORCH_CHECK_VALUE(ins.size() == g.ranks.size(), "fastcomm.reduce_scatter: rank ", opts_.rank,
                    ", group ", g.label(), ": argument 'input_list' has ", ins.size(),
                    " tensors, expected ", g.ranks.size());
  for (size_t i = 0; i < ins.size(); ++i)
    check_same(ins[i], out, out.numel(), opts_.rank, g, api, "input_list[" + std::to_string(i) + "]");
  return {g, make_reduce_scatter(out, ins, op, g.rank, (int)g.ranks.size()), c10d::OpType::REDUCE_SCATTER};
}

Engine::Prepared Engine::prepare_reduce_scatter_tensor(const GroupHandle& g, const at::Tensor& out,
                                                       const at::Tensor& in, RedOp op) {
  const char* api = "reduce_scatter_tensor";
  check_member(g, api);
  check_tensor(out, opts_.rank, g, api, "output");
  check_reduce_op(g, api, op, out.scalar_type());
  const int64_t k = (int64_t)g.ranks.size();
  check_same(in, out, out.numel() * k, opts_.rank, g, api, "input");
  auto parts = in.reshape({-1}).chunk(k);
  if (out.numel() == 0) parts.assign(k, in.reshape({-1}));  // chunk() of an empty tensor yields one
  return {g, make_reduce_scatter(out, parts, op, g.rank, (int)k), c10d::OpType::_REDUCE_SCATTER_BASE};
}

Engine::Prepared Engine::prepare_barrier(const GroupHandle& g) {
  check_member(g, "barrier");
  return {g, make_barrier(g.rank, (int)g.ranks.size(), g.state->hosts), c10d::OpType::BARRIER};
}

Engine::Prepared Engine::prepare_p2p(const GroupHandle& g, const at::Tensor& t, int peer, int tag,
                                     bool sending) {
  const char* api = sending ? "send" : "recv";
  const char* arg = sending ? "dst" : "src";
  check_member(g, api);
  check_tensor(t, opts_.rank, g, api, "tensor");
  group_rank_of(g, peer, api, arg);
  TORCH_CHECK_VALUE(peer != opts_.rank, "fastcomm.", api, ": rank ", opts_.rank, ", group ", g.label(),
                    ": argument '", arg, "' is this rank itself");
  GroupHandle ch = sending ? p2p_channel(g, opts_.rank, peer, tag) : p2p_channel(g, peer, opts_.rank, tag);
  const int peer_rank = ch.ranks[0] == peer ? 0 : 1;
  return {ch, make_p2p(t, sending, peer_rank, ch.rank), sending ? c10d::OpType::SEND : c10d::OpType::RECV};
}

// A send/recv channel is a two-member pseudo-group, made on first use by each side alone; the
// k-th send from src to dst with a tag matches the k-th recv at dst from src with that tag.
GroupHandle Engine::p2p_channel(const GroupHandle& g, int src, int dst, int tag) {
  std::lock_guard<std::mutex> lk(mu_);
  auto key = std::make_tuple(g.id, src, dst, tag);
  auto it = p2p_.find(key);
  if (it != p2p_.end()) return it->second;
  auto st = std::make_shared<GroupState>();
  st->engine = serial_;
  st->ranks = {std::min(src, dst), std::max(src, dst)};
  st->rank = st->ranks[0] == opts_.rank ? 0 : 1;
  st->label = g.label() + " (" + std::to_string(src) + "->" + std::to_string(dst) + ", tag " +
              std::to_string(tag) + ")";
  st->id = mix64(mix64(mix64(mix64(g.id ^ 0x7032705ULL) ^ (uint64_t)src) ^ (uint64_t)dst) ^ (uint64_t)(uint32_t)tag);
  groups_[st->id] = st;
  GroupHandle h;
  h.ranks = st->ranks;
  h.rank = st->rank;
  h.id = st->id;
  h.state = st;
  p2p_[key] = h;
  return h;
}

c10::intrusive_ptr<Work> Engine::post(std::vector<Prepared> ops, bool async_op) {
  std::vector<at::Tensor> outputs;
  for (auto& p : ops)
    for (auto& t : p.op->outputs()) outputs.push_back(t);
  const c10d::OpType type = ops.size() == 1 ? ops[0].type : c10d::OpType::COALESCED;
  auto work = c10::make_intrusive<Work>(shared_from_this(), opts_.rank, type, std::move(outputs),
                                        (int)ops.size(), async_op);
  if (ops.empty()) {
    work->settle(nullptr, true);
    return work;
  }
  Done done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": fastcomm was shut down");
    if (async_op) pending_async_.fetch_add(1);
    const auto deadline = Clock::now() + std::chrono::milliseconds(opts_.timeout_ms);
    for (auto& prep : ops) {
      GroupState& g = *prep.group.state;
      int dead = -1;
      for (int r : g.ranks)
        if (dead_[r]) dead = r;
      if (dead >= 0) {
        // Known-dead member: fail now instead of after a timeout, and send nothing.
        settle_locked(done, work, std::make_exception_ptr(c10::DistBackendError(
            {__func__, __FILE__, (uint32_t)__LINE__},
            "fastcomm: rank " + std::to_string(opts_.rank) + ", group " + g.label + ": " +
                describe(prep.op->desc()) + " cannot run: rank " + std::to_string(dead) +
                " has exited")));
        continue;
      }
      Pending p;
      p.op = std::move(prep.op);
      p.work = work;
      p.seq = g.next_seq++;
      p.deadline = deadline;
      p.async = async_op;
      g.queue.push_back(std::move(p));
      if (!g.busy) {
        g.busy = true;
        busy_.push_back(&g);
      }
    }
    // Eager first step: small ops' sends leave now, before the caller even waits.
    posting_batch_ = ops.size() > 1;
    const size_t stashed = stash_msgs_;
    progress_locked(done);
    posting_batch_ = false;
    // Once more if a transport thread was refused meanwhile, or if the pass stashed messages
    // (maybe of an op it had already stepped: left there, a driver asleep for it would not
    // know; see progress_from_transport).
    if (rerun_.load() || stash_msgs_ > stashed) progress_locked(done);
  }
  finish(done);
  if (async_op && !work->done()) ensure_bg_thread();
  return work;
}

// ---------------------------------------------------------------------------------------------
// Message routing

const Message* Engine::peek_for(GroupState& g, Pending& p, int peer, bool scan) {
  if (stash_msgs_) {
    auto it = stash_.find(StashKey{g.id, p.seq, peer});
    if (it != stash_.end() && !it->second.empty()) return &it->second.front().msg;
  }
  Transport* tr = transport_for(peer);
  while (const Message* m = tr->peek(peer)) {
    if (m->hdr.group == g.id && m->hdr.seq == p.seq) return m;
    if (!scan) return nullptr;
    auto git = groups_.find(m->hdr.group);
    if (git != groups_.end() && m->hdr.seq < git->second->head_seq) {
      discard_locked(tr, peer, *m);  // left over from an op that already finished or failed here
      continue;
    }
    // Another op's message in front of ours: keep a copy and read on.
    auto& q = stash_[StashKey{m->hdr.group, m->hdr.seq, peer}];
    q.emplace_back();
    Stashed& s = q.back();
    s.bytes.assign(m->data, m->data + m->hdr.len);
    s.msg.hdr = m->hdr;
    s.msg.data = s.bytes.data();
    ++stash_msgs_;
    tr->pop(peer);
  }
  return nullptr;
}

void Engine::discard_locked(Transport* tr, int peer, const Message& m) {
  // An offer nobody will take: its sender's transfer waits for a receive (Gloo cannot cancel
  // it), holding the sender's memory and a thread, so it is received into nothing.
  if (m.hdr.flags & kMsgBulk) tr->drain_bulk(peer, m);
  tr->pop(peer);
}

void Engine::purge_stash_locked(GroupState& g, uint64_t seq) {
  if (!stash_msgs_) return;
  for (int r : g.ranks) {
    auto it = stash_.find(StashKey{g.id, seq, r});
    if (it == stash_.end()) continue;
    for (auto& s : it->second)
      if (s.msg.hdr.flags & kMsgBulk) transport_for(r)->drain_bulk(r, s.msg);
    stash_msgs_ -= it->second.size();
    stash_.erase(it);
  }
}

void Engine::pop_for(GroupState& g, Pending& p, int peer, bool discard) {
  if (stash_msgs_) {
    auto it = stash_.find(StashKey{g.id, p.seq, peer});
    if (it != stash_.end() && !it->second.empty()) {
      if (discard && (it->second.front().msg.hdr.flags & kMsgBulk))
        transport_for(peer)->drain_bulk(peer, it->second.front().msg);
      it->second.pop_front();
      if (it->second.empty()) stash_.erase(it);
      --stash_msgs_;
      return;
    }
  }
  Transport* tr = transport_for(peer);
  if (discard) {
    if (const Message* m = tr->peek(peer)) discard_locked(tr, peer, *m);
    return;
  }
  tr->pop(peer);
}

bool Engine::send_for(GroupState& g, Pending& p, int peer, const Header& h, const void* data) {
  return transport_for(peer)->try_send(peer, h, data);
}

// ---------------------------------------------------------------------------------------------
// Progress

bool Engine::progress_locked(Done& done) {
  if (shut_down_) return false;
  // This pass sees whatever a refused transport thread had delivered. (Read first: a store on
  // every pass would be a locked instruction on the hot path for a flag that is rarely set.)
  if (rerun_.load()) rerun_.store(false);
  bool any = false;
  for (size_t i = 0; i < busy_.size();) {
    GroupState& g = *busy_[i];
    Pending& p = g.queue.front();
    bool finished = false;
    std::exception_ptr err;
    bool stepped = false;
    try {
      OpComm comm(*this, g, p);
      stepped = p.op->step(comm);
      finished = p.op->done();
    } catch (...) {
      err = std::current_exception();
    }
    any |= stepped;
    // What was dropped may have hidden a message this op (already stepped) can use now: that
    // counts as progress, so the caller runs another pass instead of sleeping.
    if (!stepped && !finished && !err) any |= drop_stale_locked(g);
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
    if (g.queue.empty()) {
      g.busy = false;
      busy_[i] = busy_.back();
      busy_.pop_back();
    }
    // else: the group's next op is now at the front; step it at the same index.
  }
  flush_sends();
  return any;
}

// A failed op leaves pieces in flight: peers may have written chunks of it into our rings
// before they learnt of the failure. Normally the group's next op drops them when it peeks that
// peer, but an op that must send first can be stuck behind a full ring whose owner is stuck the
// same way, each waiting for the other to read. So a group whose front op cannot move also
// drops whatever stale messages sit at the head of its peers' rings.
bool Engine::drop_stale_locked(GroupState& g) {
  bool any = false;
  for (int r : g.ranks) {
    if (r == opts_.rank) continue;
    Transport* tr = transport_for(r);
    while (const Message* m = tr->peek(r)) {
      auto git = groups_.find(m->hdr.group);
      if (git == groups_.end() || m->hdr.seq >= git->second->head_seq) break;
      discard_locked(tr, r, *m);
      any = true;
    }
  }
  return any;
}

void Engine::fail_front_locked(GroupState& g, std::exception_ptr e, Done& done, bool tell_peers) {
  Pending& p = g.queue.front();
  if (tell_peers && shm_) {
    // Best effort: tell the other members so they fail this op too instead of waiting for
    // data that will not come. A full ring just means the peer learns by its own timeout.
    std::string why;
    try {
      std::rethrow_exception(e);
    } catch (const c10::Error& ex) {
      why = ex.what_without_backtrace();
    } catch (const std::exception& ex) {
      why = ex.what();
    }
    why.resize(std::min(why.size(), max_payload()));
    const OpDesc& d = p.op->desc();
    for (int r : g.ranks) {
      if (r == opts_.rank || dead_[r]) continue;
      Header h;
      h.group = g.id;
      h.seq = p.seq;
      h.numel = d.numel;
      h.len = (uint32_t)why.size();
      h.root = d.root;
      h.kind = (uint8_t)d.kind;
      h.dtype = (uint8_t)d.dtype;
      h.redop = (uint8_t)d.redop;
      h.flags = kMsgAbort;
      transport_for(r)->try_send(r, h, why.data());
    }
  }
  settle_locked(done, p.work, e);
  purge_stash_locked(g, p.seq);  // what peers sent for it and it never read
  done.gone.push_back(std::move(p));
  g.queue.pop_front();
  ++g.head_seq;
}

// Slow path, run while waiting: peers that exited and ops past their deadline.
//
// A peer may exit right after sending what our ops still need (its last op done, it shuts
// down), and its death can become visible before a progress pass has used those messages. So
// deaths are noted first; then, since a transport publishes a peer's messages before it
// reports the peer gone, everything the peer sent is visible and progress passes use it; only
// then is the peer's memory released and are the ops that still wait on it failed. Using the
// messages can take several passes (an op's messages may sit behind another op's, stashed by
// a group stepped later in the pass); the cap only bounds a streak fed by live peers.
void Engine::health_locked(Done& done) {
  if (shut_down_) return;
  std::vector<int> newly_dead;
  for (GroupState* g : busy_)
    for (int r : g->ranks) {
      if (r == opts_.rank || dead_[r]) continue;
      // A remote peer's death shows as a failed receive, so it needs a receiver even when this
      // rank's ops never read from it (a hierarchical op's member, or leader, on another host).
      if (gloo_ && !shm_->is_local(r)) gloo_->connect(r);
      if (!transport_for(r)->peer_alive(r)) {
        dead_[r] = 1;
        newly_dead.push_back(r);
      }
    }
  if (!newly_dead.empty()) {
    for (int pass = 0; pass < 256 && progress_locked(done); ++pass) {
    }
    for (int r : newly_dead) shm_->release_peer(r);
  }
  const auto now = Clock::now();
  for (size_t i = 0; i < busy_.size();) {
    GroupState& g = *busy_[i];
    int dead = -1;
    for (int r : g.ranks) {
      if (r != opts_.rank && dead_[r]) {
        dead = r;
        break;
      }
    }
    Pending& p = g.queue.front();
    std::string msg;
    if (dead >= 0) {
      msg = "fastcomm: rank " + std::to_string(opts_.rank) + ", group " + g.label + ": " +
            describe(p.op->desc()) + " (op #" + std::to_string(p.seq) + ") failed: rank " +
            std::to_string(dead) + " (pid " + std::to_string(opts_.pids[dead]) + ") has exited";
      if (gloo_ && !shm_->is_local(dead)) msg += " (" + gloo_->death_reason(dead) + ")";
    } else if (now >= p.deadline) {
      msg = "fastcomm: rank " + std::to_string(opts_.rank) + ", group " + g.label + ": " +
            describe(p.op->desc()) + " (op #" + std::to_string(p.seq) + ") timed out after " +
            std::to_string(opts_.timeout_ms) +
            " ms; a member stalled or issued this group's collectives in a different order";
    }
    if (msg.empty()) {
      ++i;
      continue;
    }
    auto e = std::make_exception_ptr(
        c10::DistBackendError({__func__, __FILE__, (uint32_t)__LINE__}, msg));
    // A dead member dooms every queued op of the group; a timeout only the one that stalled.
    // Other members are not told of a death: each finds out itself (the look above covers
    // every member of a busy group), and a notice could reach one before its own look did.
    do {
      fail_front_locked(g, e, done, dead < 0);
    } while (dead >= 0 && !g.queue.empty());
    if (g.queue.empty()) {
      g.busy = false;
      busy_[i] = busy_.back();
      busy_.pop_back();
    } else {
      ++i;
    }
  }
  flush_sends();  // abort notices
}

// Under mu_: records that `w`'s op finished. Works become done here, in the order the progress
// passes finish ops, never later from another thread's list.
void Engine::settle_locked(Done& done, const c10::intrusive_ptr<Work>& w, std::exception_ptr e) {
  bool has_future = false;
  if (!w->settle(e, false, &has_future)) return;
  if (w->is_async()) pending_async_.fetch_sub(1);
  done.works.push_back(w);
  if (has_future) {
    publish_q_.push_back(w);
    publish_pending_.store(true, std::memory_order_relaxed);
  }
}

// Outside mu_, after a pass that finished ops: wakes sleepers, then completes Futures. Futures
// are completed in settle order by one thread at a time (whoever finds none publishing takes
// the whole queue, again until it is empty), so callbacks of a group's ops run in issue order
// even when several threads drive; a thread stuck in a callback delays later callbacks but
// never the Works themselves, whose state was settled under the lock.
void Engine::finish(Done& done, bool may_block) {
  if (!done.empty()) {
    bell_.ring_if_sleeping();  // another thread of this process may be asleep waiting for these
    done.works.clear();
  }
  done.gone.clear();
  // A caller that must not wait for mu_ leaves the Futures to a driver: the background thread,
  // woken here if it is ticking (it is while async ops were pending).
  if (!publish_pending_.load(std::memory_order_relaxed)) return;
  if (!may_block) {
    bg_cv_.notify_one();
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
    batch.clear();  // (a Work may be the last holder of its outputs: dropped without mu_)
    lk.lock();
  }
  publishing_ = false;
}

bool Engine::try_progress(bool may_block, bool wait_lock) {
  Done done;
  bool any;
  {
    std::unique_lock<std::mutex> lk(mu_, std::defer_lock);
    if (wait_lock) lk.lock();
    else if (!lk.try_lock()) return false;
    any = progress_locked(done);
  }
  finish(done, may_block);
  return any;
}

// Work.is_completed() comes here with the GIL held (torch binds it so): nothing in it may block
// on mu_, so it leaves Futures to a driver.
void Engine::poll() { try_progress(/*may_block=*/false); }

bool Engine::progress_from_transport() {
  Done done;
  {
    std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
    if (!lk.owns_lock()) {
      // The holder may be a thread that runs no pass (new_group) or whose pass has already
      // looked at this peer: a driver woken by the caller's ring could then find the lock
      // taken and go back to sleep with the delivery unused. The flag keeps drivers to short
      // sleeps, and this thread's own next pass from ending, until a pass has run since.
      rerun_.store(true);
      return false;
    }
    if (shut_down_) return false;
    // Passes repeat while a thread was refused meanwhile (rerun_), and while they make
    // progress or stash messages: a pass can leave work for the next one (an op stepped late
    // in the pass reads past, and stashes, a message of an op stepped earlier), and nobody
    // rings for that, so a driver asleep would wait out its slice. Bounded: a peer streaming
    // frames could keep refusing other threads forever, and this one holds the lock meanwhile
    // (post() and new_group wait on it). Past the bound, the ring leaves the rest to a driver
    // (which, with rerun_ set, sleeps only short slices).
    bool more = false;
    for (int pass = 0; pass < 8; ++pass) {
      const size_t stashed = stash_msgs_;
      more = progress_locked(done) || stash_msgs_ > stashed || rerun_.load();
      if (!more || shut_down_) break;
    }
    if (more) bell_.ring();
  }
  if (done.empty()) return true;
  // Wakes the threads waiting for these Works. Their Futures are completed by a driver (the
  // waiting thread on its way out, or the background thread), never here: a Future's callback
  // runs user code, which must not run on a transport thread (it could shut fastcomm down,
  // and with it this thread's transport).
  bell_.ring_if_sleeping();
  if (publish_pending_.load(std::memory_order_relaxed)) {
    bell_.ring();
    bg_cv_.notify_one();
  }
  return true;
}

// The waiting policy: poll (spin), then yield, then sleep on the doorbell. Peers ring it when
// they send to us or free ring space we asked for; sleeping is in short slices so deadlines
// and dead peers are noticed without anyone ringing.
void Engine::drive(Work* w, Clock::time_point user_deadline, bool has_deadline) {
  auto idle_since = Clock::now();
  auto last_health = idle_since;
  uint32_t idle = 0;
  bool ran_out = false;  // the last sleep lasted its whole slice, nobody rang meanwhile
  uint32_t slept_on = 0;  // ... on this token
  for (;;) {
    if (w ? w->done() : (shut_down_ || pending_async_.load() == 0 || fg_drivers_.load() > 0)) {
      // A pass on a Gloo waiter thread (progress_from_transport) may have settled Works
      // whose Futures it leaves to a driver to complete.
      Done none;
      finish(none);
      return;
    }
    const bool stalled = ran_out;
    ran_out = false;
    if (try_progress()) {
      // Work that nobody rang for, not even since the sleep ended: a lost wake-up, or work
      // that came as the slice ended (see stalled_sleeps()).
      if (stalled && bell_.token() == slept_on) stalled_sleeps_.fetch_add(1, std::memory_order_relaxed);
      idle = 0;
      continue;
    }
    if (idle++ == 0) idle_since = Clock::now();
    if ((idle & 63) != 0 && idle < 4096) {
      cpu_relax();
      continue;
    }
    const auto now = Clock::now();
    const int64_t idle_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - idle_since).count();
    if (idle_ns < spin_ns_) {
      cpu_relax();
      continue;
    }
    if (now - last_health >= std::chrono::milliseconds(20)) {
      last_health = now;
      Done done;
      {
        std::lock_guard<std::mutex> lk(mu_);
        health_locked(done);
      }
      finish(done);
      if (w && w->done()) return;
    }
    if (has_deadline && now >= user_deadline) {
      throw_comm_error("fastcomm: rank " + std::to_string(opts_.rank) +
                       ": Work.wait timed out (the op is still pending)");
    }
    if (idle_ns < spin_ns_ + yield_ns_) {
      sched_yield();
      continue;
    }
    if (shut_down_) {
      // shutdown() fails every pending op in the critical section that sets shut_down_, which
      // this thread may have seen before that section ended: taking the lock once waits it
      // out, so `w` is settled (failed) before the caller looks at it.
      if (w) std::lock_guard<std::mutex> lk(mu_);
      return;
    }
    bell_.begin_sleep();
    const uint32_t tok = bell_.token();
    // The last look before sleeping waits for the lock instead of giving up when another
    // thread holds it: that thread (a Gloo thread's pass, say) may have looked at the rings
    // before the event this thread was just woken for (a peer freed ring space: nobody rings
    // again for it), so skipping the pass here slept a whole slice with work to do; seen as
    // 5 ms stalls per op when a host's leader streamed 1 MB to a member on the same CPU.
    const bool progressed = try_progress(/*may_block=*/true, /*wait_lock=*/true);
    // rerun_ is read after the token: a transport thread sets it before it rings, so either it
    // is seen here or the ring changes the token and the sleep returns at once. While it is
    // set, a delivery may be waiting for a pass that the lock holder will not run: sleep only
    // a short slice then (not a spin: on a busy core that would take the holder's time).
    const bool rerun = rerun_.load();
    if (!progressed && !(w && w->done())) {
      const int64_t slice = rerun ? 50000 : 5000000;
      const auto t0 = Clock::now();
      bell_.sleep(tok, slice);
      // (A short slice, taken while rerun_ was set, is expected to end with work waiting.)
      ran_out = !rerun && bell_.token() == tok && Clock::now() - t0 >= std::chrono::nanoseconds(slice);
      slept_on = tok;
    }
    bell_.end_sleep();
    if (progressed) idle = 0;
  }
}

void Engine::wait(Work& w, std::chrono::milliseconds timeout) {
  if (w.done()) return;
  fg_drivers_.fetch_add(1);
  struct Leave {
    Engine* e;
    ~Leave() {
      // Async ops left pending: the background thread, ticking, takes over within kBgTick.
      e->fg_drivers_.fetch_sub(1);
    }
  } leave{this};
  const bool has_deadline = timeout.count() > 0;
  drive(&w, Clock::now() + timeout, has_deadline);
  TORCH_INTERNAL_ASSERT(w.done(), "fastcomm: rank ", opts_.rank, ": wait returned with the op pending");
}

// ---------------------------------------------------------------------------------------------
// Background progress for async ops
//
// The background thread exists so that async ops nobody waits on still finish (overlap with
// compute, Future callbacks). Waking it on every async post would cost a futex wake and, with
// more ranks than cores, a context switch per op, which the caller almost always makes moot by
// waiting at once. So while async ops come and go it does not sleep for good but ticks every
// kBgTick and drives only when ops are pending and no foreground thread is driving; only after
// kBgIdle without any async op does it sleep until the next post rings it.

namespace {
constexpr auto kBgTick = std::chrono::microseconds(500);
constexpr auto kBgIdle = std::chrono::milliseconds(100);
}  // namespace

void Engine::ensure_bg_thread() {
  if (bg_started_.load(std::memory_order_acquire) && !bg_deep_.load(std::memory_order_seq_cst))
    return;  // ticking: it will look within kBgTick
  std::lock_guard<std::mutex> lk(bg_mu_);
  if (!bg_.joinable() && !bg_stop_) {
    bg_ = std::thread([this] { bg_main(); });
    bg_started_.store(true, std::memory_order_release);
  }
  bg_cv_.notify_one();
}

void Engine::bg_main() {
  std::unique_lock<std::mutex> lk(bg_mu_);
  auto last_busy = Clock::now();
  while (!bg_stop_) {
    if (Clock::now() - last_busy > kBgIdle) {
      // A post that saw bg_deep_ false before this store finds pending_async_ raised here.
      bg_deep_.store(true, std::memory_order_seq_cst);
      bg_cv_.wait(lk, [&] { return bg_stop_ || pending_async_.load(std::memory_order_seq_cst) > 0; });
      bg_deep_.store(false, std::memory_order_seq_cst);
    } else {
      bg_cv_.wait_for(lk, kBgTick);
    }
    if (bg_stop_) break;
    if (pending_async_.load() == 0) {
      if (publish_pending_.load()) {  // (see drive())
        lk.unlock();
        Done none;
        finish(none);
        lk.lock();
      }
      continue;
    }
    last_busy = Clock::now();
    if (fg_drivers_.load() > 0) continue;
    lk.unlock();
    try {
      drive(nullptr, Clock::time_point{}, false);
    } catch (...) {
      // drive() without a Work has no user deadline; errors are delivered through Works.
    }
    lk.lock();
    last_busy = Clock::now();
  }
}

void Engine::shutdown() {
  std::shared_ptr<EngineExtension> ext;
  {
    std::lock_guard<std::mutex> lk(ext_mu_);
    ext = cuda_ext_;
  }
  if (ext) ext->shutdown();
  Done done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shut_down_) return;
    shut_down_ = true;
    auto e = std::make_exception_ptr(c10::DistBackendError(
        {__func__, __FILE__, (uint32_t)__LINE__},
        "fastcomm: rank " + std::to_string(opts_.rank) + ": fastcomm was shut down with this op pending"));
    for (GroupState* g : busy_) {
      while (!g->queue.empty()) fail_front_locked(*g, e, done, false);
      g->busy = false;
    }
    busy_.clear();
  }
  finish(done);
  {
    std::lock_guard<std::mutex> lk(bg_mu_);
    bg_stop_ = true;
  }
  bg_cv_.notify_all();
  if (bg_.joinable()) {
    if (bg_.get_id() == std::this_thread::get_id()) bg_.detach();
    else bg_.join();
  }
  // No progress pass touches the transports once shut_down_ is set, so the Gloo threads can be
  // stopped without the lock (stopping may wait a little for sends in flight).
  if (gloo_) gloo_->stop();
  std::lock_guard<std::mutex> lk(mu_);
  stash_.clear();
  stash_msgs_ = 0;
  groups_.clear();
  // The mapping itself stays until the engine is destroyed: a thread still inside drive()
  // may touch the doorbell. The name is gone already (or goes now, if init stopped early).
  if (shm_) shm_->unlink_own();
}

}  // namespace fastcomm
