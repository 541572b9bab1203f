#include "engine/engine.h"

#include <algorithm>

#include "algorithms/reduce.h"
#include "common/errors.h"
#include "device/runtime.h"

namespace fastcomm {

namespace {

// Engines are numbered so that a group handle made before shutdown() is told apart from one
// of a later init() even when the new engine happens to live at the same address.
std::atomic<uint64_t> g_engine_serial{0};

const EngineOptions& checked(const EngineOptions& o) {
  TORCH_CHECK_VALUE(o.world_size >= 1 && o.rank >= 0 && o.rank < o.world_size, "fastcomm: invalid rank ", o.rank,
                    " for world size ", o.world_size);
  TORCH_CHECK_VALUE((int)o.host_of.size() == o.world_size && (int)o.pids.size() == o.world_size,
                    "fastcomm: rendezvous data does not cover the world");
  select_reduce_kernels(o.settings.baseline_kernels);
  return o;
}

int local_ranks(const EngineOptions& o) {
  return (int)std::count(o.host_of.begin(), o.host_of.end(), o.host_of[o.rank]);
}

// What changed in a plan's tensor since it was recorded, for the start's refusal.
std::string moved_how(const PlanTensor& r) {
  if (r.t.scalar_type() != r.dtype) return "has another dtype";
  if (PlanTensor::at_data(r.t) != r.data) return "was moved (resize_ or set_?)";
  return "was laid out anew (a smaller resize_, or an in-place view change such as t_() or as_strided_())";
}

}  // namespace

Engine::Engine(EngineOptions opts)
    : opts_(checked(opts)),
      transports_(opts_.rank, opts_.token, opts_.host_of, opts_.pids, opts_.settings.ring_bytes,
                  opts_.settings.shm_stream_stores),
      groups_(++g_engine_serial, opts_.rank, opts_.host_of, opts_.settings.hierarchical),
      router_(transports_, groups_),
      progress_(mu_, opts_.rank, opts_.pids, transports_, router_,
                [this] { driver_.wake_background(); }),
      driver_(progress_, opts_.rank, local_ranks(opts_), opts_.settings.spin_ns, opts_.settings.yield_ns) {
  control_group_.id = 0x6663646576637472ULL;
  control_group_.state = std::make_shared<GroupState>();
  control_group_.state->label = "device control";
  control_group_.state->timeout = std::chrono::hours(24 * 365);
  // (Called from the background thread only, once the engine is owned by a shared_ptr.)
  driver_.set_owner([this]() -> std::shared_ptr<void> { return weak_from_this().lock(); });
}

Engine::~Engine() { shutdown(); }

void Engine::attach_peers() {
  std::lock_guard<std::mutex> lk(mu_);
  transports_.attach_peers();
}

void Engine::unlink_segment() {
  std::lock_guard<std::mutex> lk(mu_);
  transports_.unlink_own();
}

void Engine::abandon_init() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    transports_.unlink_local_segments();
  }
  shutdown();
}

void Engine::start_gloo() {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": start_gloo after shutdown()");
  TORCH_CHECK(!transports_.spans_hosts(), "fastcomm: rank ", opts_.rank, ": the Gloo transport is already set");
  driver_.prefer_sleep();
  transports_.attach_gloo(opts_.rank, std::chrono::milliseconds(opts_.timeout_ms), opts_.settings.gloo_bulk_bytes);
  // The transport thread that sees a transfer end runs the pass that uses it: waking a sleeping
  // driver for that would cost a context switch per op. The driver is woken once its Work is.
  transports_.set_delivery_hook([this] { return progress_.from_transport(); });
  transports_.set_close_gate([this](int peer) { return progress_.busy_with(peer); });
}

// The Gloo transport lives until the engine does, and is set once before the connector
// starts: these read it without the engine lock.
GlooWants Engine::gloo_wanted(int64_t timeout_ms) { return transports_.gloo_wanted(timeout_ms); }

void Engine::gloo_connect(int peer) { transports_.gloo_connect(peer); }

bool Engine::gloo_attach(int peer, c10::intrusive_ptr<c10d::Backend> pg, int peer_rank) {
  return transports_.gloo_attach(peer, std::move(pg), peer_rank);
}

void Engine::gloo_attach_failed(int peer, const std::string& why) { transports_.gloo_attach_failed(peer, why); }

std::map<std::string, uint64_t> Engine::counters() {
  std::lock_guard<std::mutex> lk(mu_);
  return transports_.counters();
}

// ---------------------------------------------------------------------------------------------
// Groups

GroupHandle Engine::new_group(std::vector<int> ranks, int64_t timeout_ms) {
  return new_groups({std::move(ranks)}, timeout_ms).at(0);
}

std::vector<GroupHandle> Engine::new_groups(const std::vector<std::vector<int>>& lists, int64_t timeout_ms) {
  TORCH_CHECK_VALUE(timeout_ms >= 0, "fastcomm.new_group: rank ", opts_.rank, ": argument 'timeout' must not be ",
                    "negative, got ", timeout_ms, " ms");
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": new_group after shutdown()");
  return groups_.create(lists, transports_, std::chrono::milliseconds(timeout_ms ? timeout_ms : opts_.timeout_ms));
}

void Engine::check_member(const GroupHandle& g, OpKind k) const {
  const char* api = op_kind_name(k);
  TORCH_CHECK(!shut_down_, "fastcomm.", api, ": rank ", opts_.rank,
              ": fastcomm was shut down; call fastcomm.init() again first");
  TORCH_CHECK_VALUE(g.state != nullptr, "fastcomm.", api, ": rank ", opts_.rank, " is not a member of group ",
                    g.label(), " (argument 'group')");
  TORCH_CHECK_VALUE(groups_.owns(*g.state), "fastcomm.", api, ": rank ", opts_.rank, ": argument 'group' ",
                    g.label(), " was created before fastcomm.shutdown(); create it again with new_group()");
}

// ---------------------------------------------------------------------------------------------
// Ops

Engine::Prepared Engine::prepare(OpRequest req, const GroupHandle& g) {
  // A sparse COO tensor's all_reduce has an algorithm of its own, whichever entry it came by.
  if (req.kind == OpKind::kAllReduce && req.tensor.defined() && req.tensor.layout() == c10::kSparse)
    req.kind = OpKind::kSparseAllReduce;
  check_member(g, req.kind);
  const size_t rsag = opts_.settings.rsag_threshold;
  check_request(req, view_of(*g.state, opts_.rank, rsag));
  const RealViews complex = view_complex_as_real(req);
  const CollectiveSpec& spec = collective_spec(req.kind);
  Prepared p;
  p.device = request_device(req);
  p.on_device = !p.device.is_cpu() || (opts_.settings.fake_device && device_runs(req.kind));
  p.type = op_kind_type(req.kind);
  if (spec.p2p) {
    const bool sending = req.kind == OpKind::kSend;
    if (!sending && !p.on_device) {
      p.recv = true;
      p.recv_group = g.id;
      p.tag = req.tag;
    }
    // On the device path, a pair's any-source recv can only be from the other member.
    if (!sending && req.peer == kAnySource && p.on_device && g.ranks.size() == 2)
      req.peer = g.ranks[0] == opts_.rank ? g.ranks[1] : g.ranks[0];
    if (!sending && req.peer == kAnySource && p.on_device) {
      // Bound by the device engine to the first member whose message is ready there, on its
      // (group, tag)'s receive port (device/recv_ports.h): every other member's channel to this one.
      p.type = c10d::OpType::RECVANYSOURCE;
      p.group = g.state;
      p.recv_group = g.id;
      p.tag = req.tag;
      std::lock_guard<std::mutex> lk(mu_);
      for (size_t i = 0; i < g.ranks.size(); ++i)
        if (g.ranks[i] != opts_.rank)
          p.from.push_back({g.ranks[i], (int)i, groups_.channel(g, g.ranks[i], opts_.rank, req.tag).state->id});
      p.req = std::move(req);
      return p;
    }
    if (!sending && req.peer == kAnySource) {
      // The channel, and so the op, is known once a member's message is matched to it.
      p.type = c10d::OpType::RECVANYSOURCE;
      p.group = g.state;
      p.op = std::make_unique<UnboundRecv>(std::move(req));
      return p;
    }
    if (!sending) p.source = (int)(std::find(g.ranks.begin(), g.ranks.end(), req.peer) - g.ranks.begin());
    const int src = sending ? opts_.rank : req.peer, dst = sending ? req.peer : opts_.rank;
    std::lock_guard<std::mutex> lk(mu_);
    p.group = groups_.channel(g, src, dst, req.tag).state;
    if (!sending && p.on_device) {
      // Behind a recv from any source of its (group, tag), it waits for that one's binding.
      p.recv_group = g.id;
      p.tag = req.tag;
      p.from.push_back({req.peer, p.source, p.group->id});
    }
  } else {
    p.group = g.state;
  }
  if (!p.on_device) {
    const GroupState& pg = *p.group;
    // A pair on this host whose payload fits one ring record below the direct path's sizes.
    size_t pair_max = 0;
    if (pg.ranks.size() == 2 && transports_.is_local(pg.ranks[0]) && transports_.is_local(pg.ranks[1]))
      pair_max = std::min(transports_.max_payload(), opts_.settings.shm_direct_bytes - 1);
    p.op = spec.make(req, view_of(pg, opts_.rank, rsag, opts_.settings.shm_direct_bytes, pair_max));
    // The Work's future holds complex tensors as the caller gave them, not their real views.
    if (!complex.empty()) {
      p.outputs = p.op->outputs();
      restore_complex(p.outputs, complex);
    }
  }
  p.req = std::move(req);
  return p;
}

namespace {

// A request for a device engine; a recv (`from`: its sender, or the candidates) on the receive
// port of (port_group, tag).
DeviceOp device_op(const GroupState& g, OpRequest req, const std::vector<DeviceOp::Sender>& from,
                   uint64_t port_group, int tag) {
  DeviceOp d{std::move(req), g.ranks, g.rank, g.id, g.timeout, ranks_label(g.ranks)};
  if (!from.empty()) {
    d.recv_port = true;
    d.port_group = port_group;
    d.port_tag = tag;
    d.from = from;
  }
  return d;
}

// For a batch that mixes devices: what one of its ops runs on.
std::string runs_on(const Engine::Prepared& p) {
  if (p.on_device) return "ops on " + p.device.str();
  return std::string("an op on the host (") + op_kind_name(p.req.kind) + (p.req.kind == OpKind::kBarrier ? ", which has no device form)" : ")");
}

}  // namespace

c10::intrusive_ptr<Work> Engine::post(PreparedOps& ops, bool async_op, bool hidden) {
  if (!ops.empty() && ops[0].on_device) {
    const c10::Device dev = ops[0].device;
    std::vector<DeviceOp> dops;
    dops.reserve(ops.size());
    for (auto& p : ops) {
      TORCH_CHECK_VALUE(p.device == dev && p.on_device, "fastcomm.batch: rank ", opts_.rank,
                        ": a batch runs on one device; it holds ", runs_on(ops[0]), " and ", runs_on(p));
      dops.push_back(device_op(*p.group, std::move(p.req), p.from, p.recv_group, p.tag));
    }
    const int source = ops.size() == 1 ? ops[0].source : -1;
    // A blocking op the caller gets no Work of (`hidden`: the native API) raises its own error.
    auto work = device_engine(dev)->post(std::move(dops), async_op, /*rethrow=*/hidden);
    if (source >= 0) work->set_source(source);  // Work.source_rank() of a recv
    return work;
  }
  std::vector<at::Tensor> outputs;
  if (!hidden) outputs.reserve(ops.size());
  for (auto& p : ops) {
    TORCH_CHECK_VALUE(!p.on_device, "fastcomm.batch: rank ", opts_.rank, ": a batch runs on one device; it holds ",
                      runs_on(ops[0]), " and ", runs_on(p));
    if (hidden) continue;
    if (p.outputs.empty()) p.op->append_outputs(outputs);
    else outputs.insert(outputs.end(), p.outputs.begin(), p.outputs.end());
  }
  const c10d::OpType type = ops.size() == 1 ? ops[0].type : c10d::OpType::COALESCED;
  auto work = c10::make_intrusive<Work>(shared_from_this(), opts_.rank, type, std::move(outputs), (int)ops.size(),
                                        async_op);
  if (ops.empty()) {
    work->settle(nullptr, true);
    return work;
  }
  Progress::PostedOps queued;
  queued.reserve(ops.size());
  for (auto& p : ops) {
    queued.emplace_back();
    queued.back().group = p.group.get();
    queued.back().op = std::move(p.op);
    queued.back().any_source = p.type == c10d::OpType::RECVANYSOURCE;
    queued.back().timeout = p.req.timeout;
    if (p.source >= 0) work->set_source(p.source);
  }
  Progress::Done done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": fastcomm was shut down");
    // Ports are looked up here, under the lock, so a recv is ordered against every other
    // receive by the time it is posted, whichever thread posts first.
    for (size_t i = 0; i < ops.size(); ++i) {
      if (!ops[i].recv) continue;
      queued[i].port = queued[i].any_source ? groups_.port(ops[i].group, ops[i].tag)
                                            : groups_.find_port(ops[i].recv_group, ops[i].tag);
    }
    progress_.post_locked(std::move(queued), work, done);
  }
  progress_.finish(done);
  if (async_op && !work->done()) driver_.ensure_background();
  return work;
}

c10::intrusive_ptr<Work> Engine::run(PreparedOps& ops, bool async_op, bool rethrow) {
  // A blocking call that raises its own error hands no Work to anyone (the native API).
  const bool hidden = !async_op && rethrow;
  if (!async_op && ops.size() == 1 && !ops[0].on_device && !ops[0].recv) return run_alone(ops[0], hidden);
  auto w = post(ops, async_op, hidden);
  if (!async_op && !w->on_device()) {
    driver_.wait(*w, std::chrono::milliseconds(0));
    if (rethrow) w->rethrow_if_failed();
  }
  return w;
}

c10::intrusive_ptr<Work> Engine::run_alone(Prepared& p, bool hidden) {
  c10::intrusive_ptr<Work> work;
  std::exception_ptr err;
  Progress::Done done;
  auto make_work = [&] {
    std::vector<at::Tensor> outputs;
    if (!hidden) outputs = p.outputs.empty() ? p.op->outputs() : p.outputs;
    return c10::make_intrusive<Work>(shared_from_this(), opts_.rank, p.type, std::move(outputs), 1, false);
  };
  bool queued = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": fastcomm was shut down");
    // Queued (if at all) in this same section: no other thread's op can take its seq.
    if (progress_.step_alone_locked(*p.group, *p.op, driver_.alone_spins(), done, err) == Progress::Alone::kQueue) {
      work = make_work();
      Progress::PostedOps q;
      q.emplace_back();
      q.back().group = p.group.get();
      q.back().op = std::move(p.op);
      q.back().timeout = p.req.timeout;
      progress_.post_locked(std::move(q), work, done);
      queued = true;
    }
  }
  progress_.finish(done);
  if (queued) {
    driver_.wait(*work, std::chrono::milliseconds(0));
    if (hidden) work->rethrow_if_failed();
    return work;
  }
  if (hidden) {
    if (err) std::rethrow_exception(err);
    return work;  // null: nobody takes it
  }
  work = make_work();
  work->settle(err, true);
  return work;
}

// ---------------------------------------------------------------------------------------------
// Persistent plans

std::shared_ptr<Plan> Engine::make_plan(PreparedOps ops) {
  auto plan = std::make_shared<Plan>();
  plan->engine_ = shared_from_this();
  plan->ops_.reserve(ops.size());
  for (auto& p : ops) {
    TORCH_CHECK_VALUE(p.on_device == ops[0].on_device && p.device == ops[0].device, "fastcomm.plan: rank ",
                      opts_.rank, ", group ", ranks_label(p.group->ranks), ": a plan runs on one device; it holds ",
                      runs_on(ops[0]), " and ", runs_on(p));
    TORCH_CHECK_VALUE(p.type != c10d::OpType::RECVANYSOURCE, "fastcomm.plan: rank ", opts_.rank, ", group ",
                      ranks_label(p.group->ranks),
                      ": a receive from any source cannot be part of a plan (its sender is matched anew each time)");
    Plan::Entry e;
    e.group = p.group;
    e.kind = p.req.kind;
    auto note = [&](const at::Tensor& t) {
      if (t.defined()) e.tensors.emplace_back(t);
    };
    note(p.req.tensor);
    note(p.req.output);
    for (const auto& t : p.req.list) note(t);
    for (const auto& t : p.req.inputs) note(t);
    if (p.on_device) {
      e.on_device = true;
      e.device = p.device;
      e.req = p.req;
      e.from = p.from;
      e.recv_group = p.recv_group;
      e.tag = p.tag;
      plan->ops_.push_back(std::move(e));
      continue;
    }
    TORCH_INTERNAL_ASSERT(p.op && p.op->restartable(), "fastcomm.plan: ", op_kind_name(p.req.kind),
                          " op cannot restart");
    e.op = std::move(p.op);
    e.recv = p.recv;
    e.recv_group = p.recv_group;
    e.tag = p.tag;
    e.req.timeout = p.req.timeout;  // a barrier's own (the rest of a host op's request is its op)
    plan->ops_.push_back(std::move(e));
  }
  auto outputs = std::make_shared<std::vector<at::Tensor>>();
  for (const auto& e : plan->ops_)
    if (e.op) e.op->append_outputs(*outputs);
  plan->outputs_ = std::move(outputs);
  return plan;
}

c10::intrusive_ptr<Work> Engine::start(const std::shared_ptr<Plan>& plan, bool async_op) {
  Plan& pl = *plan;
  TORCH_CHECK(pl.engine_.get() == this, "fastcomm.plan: rank ", opts_.rank, ": the plan belongs to another engine");
  for (size_t i = 0; i < pl.ops_.size(); ++i) {
    const Plan::Entry& e = pl.ops_[i];
    for (const auto& r : e.tensors)
      TORCH_CHECK_VALUE(r.unchanged(), "fastcomm.plan: rank ", opts_.rank, ", group ", ranks_label(e.group->ranks),
                        ": a tensor of op #", i, " (", op_kind_name(e.kind), ") ", moved_how(r),
                        " since the plan was recorded; record the plan again");
  }
  if (!pl.ops_.empty() && pl.ops_[0].on_device) return start_on_device(pl, async_op);
  // A CPU plan's ops are reused, so a start waits for the last one first (as a blocking call
  // waits for its own op): the same on every member, whatever the peers' speed.
  c10::intrusive_ptr<Work> last;
  {
    std::lock_guard<std::mutex> lk(mu_);  // (last_ is the engine lock's)
    last = pl.last_;
  }
  if (last && !last->done()) driver_.wait(*last, std::chrono::milliseconds(0));
  auto work = c10::make_intrusive<Work>(shared_from_this(), opts_.rank,
                                        pl.ops_.size() == 1 ? op_kind_type(pl.ops_[0].kind) : c10d::OpType::COALESCED,
                                        std::vector<at::Tensor>(), (int)pl.ops_.size(), async_op);
  if (async_op) work->share_outputs(pl.outputs_);
  Progress::Done done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(!shut_down_, "fastcomm.plan: rank ", opts_.rank,
                ": the plan was recorded before fastcomm.shutdown(); record it again after init()");
    for (const auto& e : pl.ops_)
      TORCH_CHECK(groups_.owns(*e.group), "fastcomm.plan: rank ", opts_.rank, ", group ", ranks_label(e.group->ranks),
                  ": the plan was recorded before fastcomm.shutdown(); record it again after init()");
    TORCH_CHECK(!pl.last_ || pl.last_->done(), "fastcomm.plan: rank ", opts_.rank,
                ": the plan is being started from two threads at once");
    pl.last_ = work;
    if (pl.ops_.empty()) {
      work->settle(nullptr, true);
    } else {
      // The last start is done, so no queue holds these ops: they can be rewound.
      Progress::PostedOps queued;
      queued.reserve(pl.ops_.size());
      for (auto& e : pl.ops_) {
        e.op->restart();
        queued.emplace_back();
        queued.back().group = e.group.get();
        queued.back().op = OpPtr(e.op.get(), OpRelease(false));
        queued.back().timeout = e.req.timeout;
        if (e.recv) queued.back().port = groups_.find_port(e.recv_group, e.tag);
      }
      progress_.post_locked(std::move(queued), work, done, plan);
    }
  }
  progress_.finish(done);
  if (async_op) {
    if (!work->done()) driver_.ensure_background();
  } else {
    driver_.wait(*work, std::chrono::milliseconds(0));
    work->rethrow_if_failed();
  }
  return work;
}

// A device plan's start posts its requests again: the device engine agrees and launches each
// post's ops itself, and the members start their plans in the same order, as for any op.
c10::intrusive_ptr<Work> Engine::start_on_device(Plan& pl, bool async_op) {
  std::vector<DeviceOp> dops;
  dops.reserve(pl.ops_.size());
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(!shut_down_, "fastcomm.plan: rank ", opts_.rank,
                ": the plan was recorded before fastcomm.shutdown(); record it again after init()");
    for (const auto& e : pl.ops_) {
      TORCH_CHECK(groups_.owns(*e.group), "fastcomm.plan: rank ", opts_.rank, ", group ", ranks_label(e.group->ranks),
                  ": the plan was recorded before fastcomm.shutdown(); record it again after init()");
      // A recv queues behind an unbound recv of its (group, tag), as a single op's does.
      dops.push_back(device_op(*e.group, e.req, e.from, e.recv_group, e.tag));
    }
  }
  return device_engine(pl.ops_[0].device)->post(std::move(dops), async_op, /*rethrow=*/true);
}

std::shared_ptr<DeviceGraph> Engine::capture(const std::shared_ptr<Plan>& plan, bool naive) {
  Plan& pl = *plan;
  TORCH_CHECK(pl.engine_.get() == this, "fastcomm.plan: rank ", opts_.rank, ": the plan belongs to another engine");
  TORCH_CHECK_VALUE(!pl.ops_.empty() && pl.ops_[0].on_device, "fastcomm.plan.capture: rank ", opts_.rank,
                    ": only a plan of device (CUDA) ops can be captured into a CUDA graph; this one ",
                    pl.ops_.empty() ? "is empty" : "runs on CPU tensors (start() it instead)");
  std::vector<DeviceOp> dops;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(!shut_down_, "fastcomm.plan: rank ", opts_.rank,
                ": the plan was recorded before fastcomm.shutdown(); record it again after init()");
    for (size_t i = 0; i < pl.ops_.size(); ++i) {
      const Plan::Entry& e = pl.ops_[i];
      TORCH_CHECK(groups_.owns(*e.group), "fastcomm.plan: rank ", opts_.rank, ", group ", ranks_label(e.group->ranks),
                  ": the plan was recorded before fastcomm.shutdown(); record it again after init()");
      for (const auto& r : e.tensors)
        TORCH_CHECK_VALUE(r.unchanged(), "fastcomm.plan: rank ", opts_.rank, ", group ", ranks_label(e.group->ranks),
                          ": a tensor of op #", i, " ", moved_how(r), " since the plan was recorded; record the plan "
                          "again");
      const GroupState& g = *e.group;
      dops.push_back(DeviceOp{e.req, g.ranks, g.rank, g.id, g.timeout, ranks_label(g.ranks)});
    }
  }
  return device_engine(pl.ops_[0].device)->capture(std::move(dops), naive);
}

// ---------------------------------------------------------------------------------------------
// Device engines

std::shared_ptr<DeviceEngine> Engine::device_engine(c10::Device device) {
  TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": fastcomm was shut down; call fastcomm.init() again first");
  std::lock_guard<std::mutex> lk(device_mu_);
  auto& e = devices_[device.type()];
  if (!e) {
    if (device.is_cpu()) {
      TORCH_INTERNAL_ASSERT(opts_.settings.fake_device, "host op routed to a device engine");
      e = make_device_engine(opts_, *this, device::make_fake_runtime(opts_.settings.device_pair_blocking));
    } else {
      // Both would share the device engines' control channels.
      TORCH_CHECK_VALUE(!opts_.settings.fake_device, "fastcomm: rank ", opts_.rank, ": FASTCOMM_FAKE_DEVICE=1 runs ",
                        "the device path on CPU tensors; ", device.type(), " tensors are refused under it");
      const DeviceEngineFactory* make = device_engine_factory(device.type());
      TORCH_CHECK(make != nullptr, "fastcomm: rank ", opts_.rank, ": this build of fastcomm has no path for ",
                  device.type(), " tensors (for CUDA: torch was not a CUDA build, or NCCL was not found, when it ",
                  "was compiled)");
      e = (*make)(opts_, *this, device.has_index() ? device.index() : 0);
    }
  }
  return e;
}

void Engine::init_device(c10::Device device) { device_engine(device); }

void Engine::device_synchronize(c10::Device device) { device_engine(device)->synchronize(); }

int64_t Engine::device_debug(c10::Device device, const std::string& what, int64_t arg) {
  return device_engine(device)->debug(what, arg);
}

c10::intrusive_ptr<Work> Engine::control_send(int peer, at::Tensor bytes, int lane) {
  return control(OpKind::kSend, peer, std::move(bytes), lane);
}

c10::intrusive_ptr<Work> Engine::control_recv(int peer, at::Tensor bytes, int lane) {
  return control(OpKind::kRecv, peer, std::move(bytes), lane);
}

c10::intrusive_ptr<Work> Engine::control(OpKind kind, int peer, at::Tensor bytes, int lane) {
  const bool sending = kind == OpKind::kSend;
  const int tag = lane == 0 ? kControlTag : kGraphTag;
  OpRequest req;
  req.kind = kind;
  req.tensor = std::move(bytes);
  req.peer = peer;
  req.tag = tag;
  PreparedOps ops;
  Prepared& p = ops.emplace_back();
  p.type = op_kind_type(kind);
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": fastcomm was shut down");
    GroupHandle g = control_group_;  // named by the pair in messages
    g.ranks = {std::min(opts_.rank, peer), std::max(opts_.rank, peer)};
    p.group = groups_.channel(g, sending ? opts_.rank : peer, sending ? peer : opts_.rank, tag).state;
  }
  p.op = collective_spec(kind).make(req, view_of(*p.group, opts_.rank, 0));
  if (!sending) {
    p.recv = true;
    p.recv_group = control_group_.id;
    p.tag = tag;
  }
  p.req = std::move(req);
  return post(ops, /*async_op=*/true);
}

bool Engine::peer_alive(int peer) {
  std::lock_guard<std::mutex> lk(mu_);
  Transport* t = transports_.of(peer);
  return t == nullptr || t->peer_alive(peer);
}

std::string Engine::peer_gone_how(int peer) {
  std::lock_guard<std::mutex> lk(mu_);
  Transport* t = transports_.of(peer);
  const std::string why = t == nullptr ? "" : t->death_reason(peer);
  return why == Transport::kShutDown ? why : "exited";
}

// ---------------------------------------------------------------------------------------------

void Engine::shutdown() {
  std::map<c10::DeviceType, std::shared_ptr<DeviceEngine>> devices;
  {
    std::lock_guard<std::mutex> lk(device_mu_);
    devices = devices_;
  }
  for (auto& [type, d] : devices) d->shutdown();
  Progress::Done done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shut_down_) return;
    shut_down_ = true;
    progress_.stop_locked(std::make_exception_ptr(c10::DistBackendError(
                              {__func__, __FILE__, (uint32_t)__LINE__},
                              "fastcomm: rank " + std::to_string(opts_.rank) +
                                  ": fastcomm was shut down with this op pending")),
                          done);
  }
  progress_.finish(done);
  driver_.stop();
  // No pass touches the transports once progress stopped, so their threads can be stopped
  // without the lock (stopping may wait a little for sends in flight).
  transports_.stop();
  std::lock_guard<std::mutex> lk(mu_);
  router_.clear();
  groups_.clear();
  // The mapping stays until the engine is destroyed (a thread still inside a wait may touch
  // the doorbell); the name is gone already, or goes now if init stopped early.
  transports_.unlink_own();
}

}  // namespace fastcomm
