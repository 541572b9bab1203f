#include "engine/engine.h"

#include <algorithm>

#include "algorithms/reduce.h"
#include "common/errors.h"

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

}  // namespace

Engine::Engine(EngineOptions opts)
    : opts_(checked(opts)),
      transports_(opts_.rank, opts_.token, opts_.host_of, opts_.pids, opts_.settings.ring_bytes),
      groups_(++g_engine_serial, opts_.rank, opts_.host_of, opts_.settings.hierarchical),
      router_(transports_, groups_),
      progress_(mu_, opts_.rank, opts_.pids, transports_, router_,
                [this] { driver_.wake_background(); }),
      driver_(progress_, opts_.rank, local_ranks(opts_), opts_.settings.spin_ns, opts_.settings.yield_ns) {}

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

void Engine::set_gloo(c10::intrusive_ptr<c10d::Backend> pg) {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": set_gloo after shutdown()");
  TORCH_CHECK(!transports_.spans_hosts(), "fastcomm: rank ", opts_.rank, ": the Gloo transport is already set");
  driver_.prefer_sleep();
  transports_.attach_gloo(std::move(pg), opts_.rank, std::chrono::milliseconds(opts_.timeout_ms),
                          opts_.settings.gloo_bulk_bytes);
  // The transport thread that sees a transfer end runs the pass that uses it: waking a sleeping
  // driver for that would cost a context switch per op. The driver is woken once its Work is.
  transports_.set_delivery_hook([this] { return progress_.from_transport(); });
}

void Engine::set_store(c10::intrusive_ptr<c10d::Store> s) {
  std::lock_guard<std::mutex> lk(device_mu_);
  store_ = std::move(s);
}

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
  check_member(g, req.kind);
  const size_t rsag = opts_.settings.rsag_threshold;
  check_request(req, view_of(*g.state, opts_.rank, rsag));
  const RealViews complex = view_complex_as_real(req);
  const CollectiveSpec& spec = collective_spec(req.kind);
  Prepared p;
  p.device = request_device(req);
  p.type = op_kind_type(req.kind);
  if (spec.p2p) {
    const bool sending = req.kind == OpKind::kSend;
    const int src = sending ? opts_.rank : req.peer, dst = sending ? req.peer : opts_.rank;
    std::lock_guard<std::mutex> lk(mu_);
    p.group = groups_.channel(g, src, dst, req.tag);
  } else {
    p.group = g;
  }
  if (p.device.is_cpu()) {
    p.op = spec.make(req, view_of(*p.group.state, opts_.rank, rsag));
    p.outputs = p.op->outputs();
    restore_complex(p.outputs, complex);
  } else {
    p.req = std::move(req);
  }
  return p;
}

c10::intrusive_ptr<Work> Engine::post(std::vector<Prepared> ops, bool async_op) {
  if (!ops.empty() && !ops[0].device.is_cpu()) {
    const c10::Device dev = ops[0].device;
    std::vector<DeviceOp> dops;
    dops.reserve(ops.size());
    for (auto& p : ops) {
      TORCH_CHECK_VALUE(p.device == dev, "fastcomm.batch: rank ", opts_.rank, ": a batch runs on one device; it holds ",
                        "ops on ", dev, " and on ", p.device);
      dops.push_back(DeviceOp{std::move(p.req), p.group.ranks, p.group.rank, p.group.label()});
    }
    return device_engine(dev)->post(std::move(dops), async_op);
  }
  std::vector<at::Tensor> outputs;
  for (auto& p : ops) {
    TORCH_CHECK_VALUE(p.device.is_cpu(), "fastcomm.batch: rank ", opts_.rank,
                      ": a batch runs on one device; it holds ops on cpu and on ", p.device);
    for (auto& t : p.outputs) outputs.push_back(t);
  }
  const c10d::OpType type = ops.size() == 1 ? ops[0].type : c10d::OpType::COALESCED;
  auto work = c10::make_intrusive<Work>(shared_from_this(), opts_.rank, type, std::move(outputs), (int)ops.size(),
                                        async_op);
  if (ops.empty()) {
    work->settle(nullptr, true);
    return work;
  }
  std::vector<std::pair<GroupState*, std::unique_ptr<Op>>> queued;
  queued.reserve(ops.size());
  for (auto& p : ops) queued.emplace_back(p.group.state.get(), std::move(p.op));
  Progress::Done done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": fastcomm was shut down");
    progress_.post_locked(std::move(queued), work, done);
  }
  progress_.finish(done);
  if (async_op && !work->done()) driver_.ensure_background();
  return work;
}

c10::intrusive_ptr<Work> Engine::run(std::vector<Prepared> ops, bool async_op, bool rethrow) {
  auto w = post(std::move(ops), async_op);
  if (!async_op && !w->on_device()) {
    driver_.wait(*w, std::chrono::milliseconds(0));
    if (rethrow) w->rethrow_if_failed();
  }
  return w;
}

// ---------------------------------------------------------------------------------------------
// Device engines

std::shared_ptr<DeviceEngine> Engine::device_engine(c10::Device device) {
  TORCH_CHECK(!shut_down_, "fastcomm: rank ", opts_.rank, ": fastcomm was shut down; call fastcomm.init() again first");
  std::lock_guard<std::mutex> lk(device_mu_);
  auto& e = devices_[device.type()];
  if (!e) {
    const DeviceEngineFactory* make = device_engine_factory(device.type());
    TORCH_CHECK(make != nullptr, "fastcomm: rank ", opts_.rank, ": this build of fastcomm has no path for ",
                device.type(), " tensors (for CUDA: torch was not a CUDA build, or NCCL was not found, when it ",
                "was compiled)");
    TORCH_CHECK(store_, "fastcomm: rank ", opts_.rank, ": no store for the ", device.type(),
                " rendezvous (engine made outside fastcomm.init)");
    e = (*make)(opts_, *store_, device.has_index() ? device.index() : 0);
  }
  return e;
}

void Engine::init_device(c10::Device device) { device_engine(device); }

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
