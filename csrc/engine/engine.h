#pragma once
// The engine: one per process, owning the parts below and what ties them together. It knows
// every peer once (the rendezvous the Python layer runs through the c10d Store), and every op,
// whatever its device, enters through prepare() (one set of checks) and post().
//
//   TransportSet   rank -> transport (shared memory, Gloo)        transport/transport_set.h
//   GroupRegistry  groups and send/recv channels by id            engine/group.h
//   MessageRouter  incoming messages to their ops (the stash)     engine/router.h
//   Progress       passes, health, settling Works                 engine/progress.h
//   Driver         waiting policy, background thread              engine/driver.h
//   DeviceEngine   ops on CUDA tensors, made at the first one     engine/device.h
//
// Threading: the state of the parts is guarded by one lock (mu_). Progress is driven by
// whichever thread waits, and by the Driver's background thread for async ops nobody waits on.
// Blocking bindings release the GIL before they get here, and nothing here takes it.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algorithms/request.h"
#include "engine/device.h"
#include "engine/driver.h"
#include "engine/group.h"
#include "engine/options.h"
#include "engine/progress.h"
#include "engine/router.h"
#include "engine/work.h"
#include "transport/transport_set.h"

namespace fastcomm {

class Engine;

// A tensor as a plan recorded it (Plan::Entry::tensors).
struct PlanTensor {
  at::Tensor t;
  const void* data;
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  explicit PlanTensor(const at::Tensor& x)
      : t(x), data(at_data(x)), sizes(x.sizes().vec()), strides(strides_of(x)), dtype(x.scalar_type()) {}
  static const void* at_data(const at::Tensor& x) { return x.has_storage() ? x.data_ptr() : nullptr; }
  static std::vector<int64_t> strides_of(const at::Tensor& x) {
    return x.layout() == c10::kStrided ? x.strides().vec() : std::vector<int64_t>();
  }
  // (A sparse tensor's size and values may change between starts: its op reads them anew and
  // agrees a changed dimension count with its peers itself; its dtype is the plan's.)
  bool unchanged() const {
    if (t.layout() != c10::kStrided) return t.scalar_type() == dtype;
    return at_data(t) == data && t.sizes() == c10::IntArrayRef(sizes) && t.scalar_type() == dtype &&
           t.strides() == c10::IntArrayRef(strides);
  }
};

// A persistent plan (fastcomm.plan): host ops checked and built once, queued again at every
// start. Each start's queue entries hold the plan, so dropping it while a start runs is safe.
class Plan {
 public:
  size_t size() const { return ops_.size(); }
  Engine& engine() const { return *engine_; }

 private:
  friend class Engine;
  struct Entry {
    std::shared_ptr<GroupState> group;  // for send/recv, the pair's channel
    std::unique_ptr<Op> op;
    OpKind kind = OpKind::kNone;
    bool recv = false;  // a recv from a known source, matched after any-source receives
    uint64_t recv_group = 0;  // posted before it (Engine::Prepared)
    int tag = 0;
    std::vector<DeviceOp::Sender> from;  // a device recv: its sender, for its port (as `recv`)
    // Every tensor the op touches, as it was at recording: the algorithm holds raw pointers
    // into that memory and its layout, so a tensor moved (resize_, set_) or laid out anew since
    // (t_(), a smaller resize_, another dtype) must not run.
    c10::SmallVector<PlanTensor, 2> tensors;
    // A device op: its checked request, posted anew to the device engine at every start (whose
    // ops are agreed and launched per post).
    bool on_device = false;
    c10::Device device = c10::Device(c10::kCPU);
    OpRequest req;
  };
  std::shared_ptr<Engine> engine_;
  std::vector<Entry> ops_;
  // Every op's outputs, in order: what each async start's Work shares.
  std::shared_ptr<const std::vector<at::Tensor>> outputs_;
  c10::intrusive_ptr<Work> last_;  // the latest start; the engine lock
};

class Engine final : public Waiter, public HostLink, public std::enable_shared_from_this<Engine> {
 public:
  explicit Engine(EngineOptions opts);
  ~Engine() override;

  // Init steps; between them the Python layer synchronises the ranks through the store.
  void attach_peers();
  void unlink_segment();
  // A failed init: removes the names of every same-host rank's segment (a rank that died
  // mid-init cannot remove its own) and shuts down.
  void abandon_init();
  // Reaches ranks on other hosts through Gloo (called by the Python layer when the job spans
  // hosts); without it, groups spanning hosts are refused. Connections are made per peer when
  // first needed, by the Python layer's connector through the gloo_* calls below.
  void start_gloo();
  // The connector's calls (no engine lock; blocking ones are bound without the GIL):
  // gloo_wanted() blocks until peers need a connection, the engine asks the connector to read
  // its requests, the transport stops, or timeout_ms passes (< 0: no bound).
  GlooWants gloo_wanted(int64_t timeout_ms);
  // `peer` asked this rank for a connection (it has something to send it): want one too.
  void gloo_connect(int peer);
  // Hands over the two-rank process group with `peer` (`peer_rank`: its rank there); false if
  // the engine stopped meanwhile.
  bool gloo_attach(int peer, c10::intrusive_ptr<c10d::Backend> pg, int peer_rank);
  void gloo_attach_failed(int peer, const std::string& why);

  // timeout_ms: how long each op of the groups may take; 0 = the engine's (init's) timeout.
  GroupHandle new_group(std::vector<int> ranks, int64_t timeout_ms = 0);
  std::vector<GroupHandle> new_groups(const std::vector<std::vector<int>>& lists, int64_t timeout_ms = 0);

  // A checked op, not yet issued: the host algorithm, or the request for a device engine.
  struct Prepared {
    // For send/recv, the pair's channel; for a recv from any source, the group.
    std::shared_ptr<GroupState> group;
    c10::Device device = c10::Device(c10::kCPU);
    // Runs on a device engine: a non-CPU device, or any op the device path takes when
    // FASTCOMM_FAKE_DEVICE routes CPU tensors through the fake device runtime (tests).
    bool on_device = false;
    c10d::OpType type = c10d::OpType::UNKNOWN;
    std::unique_ptr<Op> op;  // host ops
    // Host ops with complex tensors: what the Work's future holds (the tensors as the caller
    // gave them, not their real views); empty: the op's own outputs.
    std::vector<at::Tensor> outputs;
    OpRequest req;           // a device op's input; for a host op, its tensors (plans check them)
    // A host recv: the (group, tag) whose port, if any, it is matched on in posting order
    // (engine/group.h, RecvPort), and its sender's group rank (-1: any source, not known yet).
    bool recv = false;
    uint64_t recv_group = 0;
    int tag = 0;
    int source = -1;
    std::vector<DeviceOp::Sender> from;  // a device recv: its candidate senders (device/recv_ports.h)
  };
  // Every argument check, before anything is sent. Takes the lock for send/recv (channels).
  Prepared prepare(OpRequest req, const GroupHandle& g);
  // Ops posted together; one inline (a blocking call's) costs no allocation.
  using PreparedOps = c10::SmallVector<Prepared, 1>;
  // Issues the ops together (one pass, one write and wake-up per peer) as one Work that
  // completes when all have (its error is the first op's). All on one device.
  // `hidden`: the Work reaches no caller, so it keeps no outputs for result() or its Future.
  // Takes each op's algorithm (or device request); the rest of `ops` stays with the caller,
  // who chooses where its tensor references are dropped (bindings: with the GIL held).
  c10::intrusive_ptr<Work> post(PreparedOps& ops, bool async_op, bool hidden = false);
  // post, and for a blocking host op, waits for it; `rethrow`: raise its error here (the torch
  // backend leaves it in the Work, which torch waits on next). A blocking single host op (not
  // a recv, which is matched in posting order on ports) whose group has nothing queued is
  // stepped before it is queued (Progress::step_alone_locked); when that finishes it, a caller
  // that raises its own error gets a null Work, and nothing was queued or waited for.
  c10::intrusive_ptr<Work> run(PreparedOps& ops, bool async_op, bool rethrow);
  // A persistent plan of host ops (a batch recorded once), and one run of all its ops. A plan
  // runs one start at a time; a blocking start raises its error here.
  std::shared_ptr<Plan> make_plan(PreparedOps ops);
  c10::intrusive_ptr<Work> start(const std::shared_ptr<Plan>& plan, bool async_op);
  // A device plan captured into a CUDA graph (DeviceEngine::capture).
  std::shared_ptr<DeviceGraph> capture(const std::shared_ptr<Plan>& plan, bool naive);
  // Makes the device engine for `device` now rather than at its first op.
  void init_device(c10::Device device);
  // The device engine of `device` (made if need be): see DeviceEngine::synchronize and debug.
  void device_synchronize(c10::Device device);
  int64_t device_debug(c10::Device device, const std::string& what, int64_t arg);

  // HostLink: the device engines' control messages, on a tag and channels of their own that
  // never time out (a device engine keeps a receive posted while it waits for a peer, and
  // applies its ops' deadlines itself).
  c10::intrusive_ptr<Work> control_send(int peer, at::Tensor bytes, int lane = 0) override;
  c10::intrusive_ptr<Work> control_recv(int peer, at::Tensor bytes, int lane = 0) override;
  std::string peer_gone_how(int peer) override;
  bool peer_alive(int peer) override;

  // Waiter: blocks until `w` is done, driving progress; poll: one non-blocking attempt.
  void wait(Work& w, std::chrono::milliseconds timeout) override { driver_.wait(w, timeout); }
  void poll() override { driver_.poll(); }
  void hurry() override { driver_.hurry(); }

  // Fails every pending op, stops the threads and releases the shared memory.
  void shutdown();
  bool is_shut_down() const { return shut_down_.load(); }

  // Diagnostics: the transports' counters ("gloo.frames_sent", ...) and the driver's.
  std::map<std::string, uint64_t> counters();
  uint64_t stalled_sleeps() const { return driver_.stalled_sleeps(); }

  const EngineOptions& options() const { return opts_; }
  int rank() const { return opts_.rank; }
  int world_size() const { return opts_.world_size; }
  int64_t timeout_ms() const { return opts_.timeout_ms; }

 private:
  void check_member(const GroupHandle& g, OpKind k) const;
  c10::intrusive_ptr<Work> run_alone(Prepared& p, bool hidden);
  c10::intrusive_ptr<Work> start_on_device(Plan& plan, bool async_op);
  std::shared_ptr<DeviceEngine> device_engine(c10::Device device);
  c10::intrusive_ptr<Work> control(OpKind kind, int peer, at::Tensor bytes, int lane);

  const EngineOptions opts_;
  std::mutex mu_;
  TransportSet transports_;
  GroupRegistry groups_;
  MessageRouter router_;
  Progress progress_;
  Driver driver_;
  std::atomic<bool> shut_down_{false};
  // The device engines' control messages travel on channels of this group, which no user group
  // can be (its id is no function of a rank list); their ops never time out.
  static constexpr int kControlTag = -0x7ffffffe;
  static constexpr int kGraphTag = -0x7ffffffd;  // control lane 1: graph captures' agreement
  GroupHandle control_group_;
  std::mutex device_mu_;  // guards devices_ (made without mu_: a device engine posts control ops)
  std::map<c10::DeviceType, std::shared_ptr<DeviceEngine>> devices_;
};

}  // namespace fastcomm
