// The device engine (device/engine.h, device/channel_engine.h): its making, issue on the
// caller's thread (stream semantics), waits, plan captures, test hooks and shutdown.
#include <algorithm>

#include "common/errors.h"
#include "device/channel_engine.h"
#include "device/graph.h"

namespace fastcomm {
namespace device {

namespace {
// The first device op may come while a user captures a graph in the global mode (from this
// thread or another): the probe's allocation and registration then run relaxed, so they are
// not refused (which would keep this process off IPC links while its peers use them, and
// lower ops of 3+ otherwise than they do) and do not invalidate that capture.
bool probe_ipc(Runtime& rt) {
  RelaxedCapture relaxed(rt);
  return rt.ipc_supported();
}
}  // namespace

ChannelEngine::ChannelEngine(const EngineOptions& opts, HostLink& host, std::unique_ptr<Runtime> rt)
    : rank_(opts.rank),
      single_(opts.settings.device_single_stream),
      host_(host),
      rt_(std::move(rt)),
      ipc_on_(!single_ &&
              (opts.settings.device_ipc == 1 || (opts.settings.device_ipc < 0 && std::string(rt_->name()) != "fake")) &&
              probe_ipc(*rt_)),  // last: on CUDA it tries a link's calls once
      ipc_ring_bytes_(opts.settings.device_ipc_ring_bytes),
      ipc_fuse_bytes_(opts.settings.device_ipc_fuse_bytes),
      ipc_group_max_(opts.settings.device_ipc_group_max),
      host_of_(opts.host_of),
      idle_release_(opts.settings.device_idle_ms),
      max_comms_((size_t)opts.settings.device_max_comms),
      max_kernels_(opts.settings.device_max_kernels),
      group_comm_bytes_(opts.settings.rsag_threshold) {
  events_ = std::make_shared<EventPool>(*rt_);
  ipc_ = std::make_unique<IpcLinks>(*rt_);
  ipc_->set_fuse_bytes(ipc_fuse_bytes_);
  ipc_->set_offload([this](std::function<void()> f) { aborter_.push(std::move(f)); });
  RelaxedCapture relaxed(*rt_);
  alloc_ = rt_->new_stream();
  if (single_) shared_ = rt_->new_stream();
  thread_ = std::thread([this] { main(); });
}

// ---------------------------------------------------------------------------------------------
// Issue (caller's thread)

c10::intrusive_ptr<Work> ChannelEngine::post(std::vector<DeviceOp> dops, bool async_op, bool rethrow) {
  const Stream caller = rt_->current_stream();
  if (rt_->capturing(caller)) throw_capture_refusal(dops);
  {
    // An error of a group's earlier blocking op that came after the call returned.
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) std::rethrow_exception(broken_);
    for (const DeviceOp& d : dops) {
      auto it = deferred_.find(d.id);
      if (it == deferred_.end()) continue;
      const std::string why = std::move(it->second);
      deferred_.erase(it);
      throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ", group " + d.label +
                       ": an earlier op of this group failed after its blocking call returned: " + why);
    }
  }
  auto batch = std::make_shared<Batch>();
  batch->nested = Publisher::on_callback_thread();
  std::vector<std::unique_ptr<DevOp>> ops;
  std::vector<at::Tensor> outputs;
  c10d::OpType type = dops.size() == 1 ? op_kind_type(dops[0].req.kind) : c10d::OpType::COALESCED;
  // Per request: how many ops it was lowered into, and how many keys of its group it takes.
  std::vector<std::pair<size_t, size_t>> shape;
  for (auto& d : dops) {
    TORCH_CHECK_VALUE(!single_ || !d.recv_port || d.req.peer != kAnySource, "fastcomm.recv: rank ", rank_, ", group ",
                      d.label, ": a recv from any source needs the agreed channels (not FASTCOMM_DEVICE_SCHEME=single-stream)");
    Lowering how{*rt_, alloc_, rank_, !single_, group_comm_bytes_};
    how.links = links_only(d);
    std::unique_ptr<DevOp> second;
    ops.push_back(lower(d, batch, how, &second));
    const size_t lowered = second ? 2 : 1;
    if (second) ops.push_back(std::move(second));
    // A group linked over IPC takes two keys per op, whether it was lowered into two or not, so
    // members that chose differently (a mismatch, raised) still agree on the ops after it.
    shape.emplace_back(lowered, how.links && !d.recv_port ? 2 : 1);
    const OpRequest& r = d.req;
    // What the future holds, as on the host path: the output list where there is one (empty on
    // a gather's other members), else the output tensor.
    if (r.kind == OpKind::kAllGather || r.kind == OpKind::kAllToAll || r.kind == OpKind::kGather)
      outputs.insert(outputs.end(), r.list.begin(), r.list.end());
    else outputs.push_back(r.output.defined() ? r.output : r.tensor);
    batch->groups.push_back(d.id);
  }
  // The transfers start where the caller's stream is now: the inputs are ready there.
  EventPtr input = events_->record(caller);
  batch->work = c10::make_intrusive<DeviceWork>(shared_from_this(), rank_, type, std::move(outputs), 1, async_op);
  batch->left = batch->unlaunched = (int)ops.size();
  batch->one_op = dops.size() == 1;
  const auto now = Clock::now();
  auto work = batch->work;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) std::rethrow_exception(broken_);
    for (size_t i = 0, k = 0; i < dops.size(); k += shape[i].first, ++i) {
      for (size_t j = 0; j < shape[i].second; ++j) {
        DevOp* op = j < shape[i].first ? ops[k + j].get() : nullptr;
        Key key;
        // A recv from any source, and any recv of its (group, tag) posted while one waits, take
        // their receive numbers when bound, in posting order (device/recv_ports.h).
        const bool bound = numbers_.take(dops[i].id, op != nullptr && op->recv_port ? &op->port : nullptr,
                                         op != nullptr && op->any_source, key);
        if (op == nullptr) continue;
        op->key = key;
        op->unbound = !bound;
        op->input = input;
        op->deadline = now + op->timeout;
      }
      for (size_t j = 0; j < shape[i].first; ++j) incoming_.push_back(std::move(ops[k + j]));
    }
    if (ops.empty()) {
      work->set_launched({});
      work->settle(nullptr, true);
    }
  }
  cv_.notify_all();
  if (!async_op && rethrow) {
    // Returns once the ops are enqueued, the caller's stream ordered after them; the device
    // runs them later.
    wait_until(*work, true, std::chrono::milliseconds(0));
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!work->done()) batch->returned = true;
    }
    if (!work->done()) work->order_after(caller);
    else work->rethrow_if_failed();
  }
  return work;
}

void ChannelEngine::throw_capture_refusal(const std::vector<DeviceOp>& dops) const {
  const char* api = dops.empty() ? "batch" : op_kind_name(dops[0].req.kind);
  C10_THROW_ERROR(Error, c10::str("fastcomm.", api, ": rank ", rank_, dops.empty() ? "" : ", group ",
              dops.empty() ? "" : dops[0].label,
              ": issued while the caller's stream is being captured into a CUDA graph. fastcomm launches an op's "
              "transfers from its engine thread once the members have agreed on it, so an op issued under capture "
              "cannot be recorded into the graph; nothing was issued. Capture through a plan instead: record the ops "
              "once with `with fastcomm.plan() as p: ...`, then, outside any capture, `g = p.capture()` (the members "
              "agree on the order and matching once, there), and call `g.replay()` inside the capture (it records the "
              "plan's work into the graph) or outside it (docs/design.md, \"CUDA graphs\")"));
}

std::shared_ptr<DeviceGraph> ChannelEngine::capture(std::vector<DeviceOp> dops, bool naive) {
  TORCH_CHECK(!rt_->capturing(rt_->current_stream()), "fastcomm.plan.capture: rank ", rank_,
              ": called while the caller's stream is being captured; capture the plan outside any capture (it "
              "makes its own graph), then call `g.replay()` inside the capture (it records the plan's work into it)");
  TORCH_CHECK_VALUE(!single_, "fastcomm.plan.capture: rank ", rank_, ": not with FASTCOMM_DEVICE_SCHEME=single-stream");
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) std::rethrow_exception(broken_);
  }
  GraphLinks links;
  if (ipc_on_) {
    RelaxedCapture relaxed(*rt_);  // the probe captures a stream of its own
    links.on = rt_->ipc_graphs();
  }
  links.same_host = [this](int peer) { return use_ipc(peer); };
  links.ring_bytes = ipc_ring_bytes_;
  links.made = &plan_links_;
  links.serial = &plan_serial_;
  links.releasing = &plan_releasing_;
  std::weak_ptr<ChannelEngine> self = std::static_pointer_cast<ChannelEngine>(shared_from_this());
  links.retire = [self](std::vector<std::unique_ptr<IpcLink>> ls, std::shared_ptr<void> rest) {
    if (auto e = self.lock()) e->retire_links(std::move(ls), std::move(rest));
  };
  auto g = std::make_shared<PlanGraph>(shared_from_this(), *rt_, host_, rank_, alloc_, std::move(dops), naive, max_kernels_,
                                       std::move(links));
  bool stopped;
  {
    std::lock_guard<std::mutex> lk(graphs_mu_);
    graphs_.erase(std::remove_if(graphs_.begin(), graphs_.end(), [](const auto& w) { return w.expired(); }),
                  graphs_.end());
    graphs_.push_back(g);
    // shutdown() sets stop_ before it takes graphs_mu_ to abort the graphs: either it finds
    // this one there, or this sees stop_ (a graph shutdown missed would keep its communicators
    // and reach the host link after the engine is gone).
    std::lock_guard<std::mutex> l2(mu_);
    stopped = stop_;
  }
  if (stopped) g->abort("fastcomm was shut down");
  return g;
}

void ChannelEngine::retire_links(std::vector<std::unique_ptr<IpcLink>> links, std::shared_ptr<void> rest) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stop_) {
    lk.unlock();
    // The engine thread is gone: a short wait for the peers to unmap the rings, as teardown's,
    // then they go here (after fastcomm.shutdown(), a user's graph dropped late may bring them
    // on a CUDA thread: a teardown's last resort).
    const auto until = Clock::now() + std::chrono::milliseconds(500);
    for (auto& l : links) {
      l->close_peer();
      while (l->peer_opened() && !l->peer_done() && Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      // (The host engine may be gone by now: a peer not seen to let go is taken as alive.)
      if (IpcLinks::still_read(*l, [](int) { return true; })) l->keep_own_ring();
    }
    links.clear();
    rest.reset();
    return;
  }
  for (auto& l : links) retired_links_.push_back(std::move(l));
  if (rest) retired_rest_.push_back(std::move(rest));
  woken_ = true;
  lk.unlock();
  cv_.notify_all();
}

void ChannelEngine::wait_until(Work& w, bool launched_enough, std::chrono::milliseconds timeout) {
  auto ready = [&] { return w.done() || (launched_enough && static_cast<DeviceWork&>(w).launched()); };
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout.count() <= 0) {
    done_cv_.wait(lk, ready);
  } else if (!done_cv_.wait_for(lk, timeout, ready)) {
    const bool launched = static_cast<DeviceWork&>(w).launched();
    throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": " + c10d::opTypeToString(w.retrieveOpType()) +
                     (launched ? " not finished on the device" : " not yet agreed by its members (not enqueued)") +
                     " after " + std::to_string(timeout.count()) + " ms (Work.wait timed out; the op goes on)");
  }
}

void ChannelEngine::synchronize() {
  EventPtr e = events_->record(rt_->current_stream());
  rt_->synchronize(e->ev);
}

int64_t ChannelEngine::debug(const std::string& what, int64_t arg) {
  if (what == "events_created") return (int64_t)events_->created();
  if (what == "live_comms") return live_comms_.load();
  if (what == "ended_comms") return ended_comms_.load();
  if (what == "group_comms") return group_comms_.load();
  if (what == "join_streams") return join_streams_.load();
  if (what == "kernels") return slots_held_.load();
  if (what == "kernel_waits") return slot_waits_.load();
  if (what == "ipc_links") return ipc_->blocks();
  if (what == "ipc_links_made") return ipc_->made();
  if (what == "ipc_kept_rings") return ipc_->kept();
  if (what == "ipc_ring_bytes") return ipc_->ring_bytes();
  if (what == "ipc_host_rings") return ipc_->host_rings();
  if (what == "ipc_ring_fold_bytes") return ring_fold_bytes_.load();
  if (what == "plan_ipc_links") return plan_links_.load();
  if (what == "plan_serial") return plan_serial_.load();
  if (what == "plan_releasing") return plan_releasing_.load();
  if (what == "engine_torn_down") return torn_down_.load() ? 1 : 0;
  if (what == "group_releases_heard") return group_releases_heard_.load();
  if (what == "group_next_ids") return group_next_ids_.load();
  if (what == "ipc_skip_waits") {  // links made from now on
    ipc_->set_skip_rx_waits(arg != 0);
    return 0;
  }
  if (what == "channel_failed") {
    std::lock_guard<std::mutex> lk(mu_);
    return failed_peers_.count((int)arg) ? 1 : 0;
  }
  if (what == "awaiting_decision") {  // counted from the engine's next pass on
    awaiting_wanted_.store(true);
    return awaiting_decision_.load();
  }
  if (what == "deferred_errors") {  // groups whose next op raises an earlier blocking call's error
    std::lock_guard<std::mutex> lk(mu_);
    return (int64_t)deferred_.size();
  }
  return rt_->debug(what, arg);
}

void ChannelEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shut_down_) return;
    shut_down_ = true;
    stop_ = true;  // (already, where the engine thread stopped on a failure of its own)
    if (!broken_) broken_ = comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ": fastcomm was shut down");
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    // The engine thread itself drops the last reference where teardown held it last (main()).
    if (thread_.get_id() == std::this_thread::get_id()) thread_.detach();
    else thread_.join();
  }
  std::vector<std::shared_ptr<PlanGraph>> graphs;
  {
    std::lock_guard<std::mutex> lk(graphs_mu_);
    for (auto& w : graphs_)
      if (auto g = w.lock()) graphs.push_back(std::move(g));
    graphs_.clear();
  }
  for (auto& g : graphs) g->abort("fastcomm was shut down");
}

}  // namespace device

std::shared_ptr<DeviceEngine> make_device_engine(const EngineOptions& opts, HostLink& host,
                                                 std::unique_ptr<device::Runtime> runtime) {
  return std::make_shared<device::ChannelEngine>(opts, host, std::move(runtime));
}

}  // namespace fastcomm
