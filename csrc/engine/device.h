#pragma once
// Ops whose tensors live on another device (CUDA) run on that device's engine, made at the
// first such op from a factory that the device's path registers (csrc/cuda). The host engine
// hands it requests that passed the common checks (algorithms/request.h) and the Works it
// returns; it never looks inside.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "algorithms/request.h"
#include "engine/options.h"
#include "engine/work.h"

namespace fastcomm {

// A checked request and the group it runs on.
struct DeviceOp {
  OpRequest req;
  std::vector<int> ranks;  // sorted global ranks; group rank i is ranks[i]
  int rank = -1;           // this member's group rank
  uint64_t id = 0;         // the group's id (send/recv: the pair channel's), equal on all members
  std::chrono::milliseconds timeout{0};  // the group's op timeout
  std::string label;
  // A recv: matched on its (group, tag)'s receive port in posting order, with its candidate
  // senders (one, or every other member for a recv from any source).
  struct Sender {
    int rank;        // global
    int group_rank;  // Work.source_rank()
    uint64_t id;     // the channel (group, sender -> this rank, tag)
  };
  bool recv_port = false;
  uint64_t port_group = 0;
  int port_tag = 0;
  std::vector<Sender> from;
};

// A plan's ops captured into a CUDA graph (device/graph.h): every member captured the same
// plan, and replays its graph the same number of times, in the same order as its other graphs
// over a shared pair.
class DeviceGraph {
 public:
  virtual ~DeviceGraph() = default;
  // Enqueues one run on the caller's current stream (ordered after the work before it, the work
  // after it ordered after the run); no host agreement. Under a capture of the caller's stream,
  // records the plan's work into that capture instead (every replay of the caller's graph runs
  // it). Raises DistBackendError, naming the peer, where an earlier run met a fault (the graph is
  // then dead: capture the plan again).
  virtual void replay() = 0;
  // Host-blocks until every run enqueued so far has run on the device (once recorded into a
  // caller's graph: also the work enqueued so far on the caller's current stream); raises as
  // replay() does, and where a run is not done within the plan's timeout (0: the groups' own).
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  virtual int64_t replays() const = 0;
  // Times replay() recorded the plan into a capture of the caller's (torch.cuda.graph), and the
  // runs of those user graphs that have started on the device.
  virtual int64_t recorded() const { return 0; }
  virtual int64_t user_runs() const { return 0; }
};

class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;
  // Issues the ops together; one Work for all of them. A blocking call (async_op false)
  // returns once they have run (raising their error), or, for the torch backend (`rethrow`
  // false) and inside a CUDA graph capture, with the caller's current stream ordered after them.
  virtual c10::intrusive_ptr<Work> post(std::vector<DeviceOp> ops, bool async_op, bool rethrow) = 0;
  // Fails what is pending; later posts raise. Never blocks on a peer.
  virtual void shutdown() = 0;
  // Host-blocks until the work enqueued so far on the caller's current stream has run (as
  // torch.cuda.synchronize() does for one stream).
  virtual void synchronize() = 0;
  // Captures the ops (a plan's, in the plan's order) into a CUDA graph: the members agree on
  // their order and matching, make the plan's communicators and allocate its memory first, over
  // the host; the capture then holds the device work only. Blocks until every peer of the plan
  // has done the same (raising DistBackendError naming a peer that fails, mismatches or times
  // out). `naive` (tests): allocates under the capture, as a careless design would.
  virtual std::shared_ptr<DeviceGraph> capture(std::vector<DeviceOp> ops, bool naive) = 0;
  // Test hooks of the runtime under the engine (the fake's; see device/runtime.h).
  virtual int64_t debug(const std::string& what, int64_t arg) = 0;
};

// What a device engine uses of the host engine: ordered control messages to any peer over the
// host transports (shared memory, Gloo), on a tag of their own. Each is a host Work that fails
// with DistBackendError naming the peer when it dies or the timeout passes.
class HostLink {
 public:
  virtual ~HostLink() = default;
  // `lane` 0: the device engine thread's frames; 1: a graph capture's agreement (the caller's
  // thread), on a tag of its own so the two never interleave.
  virtual c10::intrusive_ptr<Work> control_send(int peer, at::Tensor bytes, int lane = 0) = 0;
  virtual c10::intrusive_ptr<Work> control_recv(int peer, at::Tensor bytes, int lane = 0) = 0;
  // False once the host transports know the peer process is gone (or, on this host, that its
  // engine shut down).
  virtual bool peer_alive(int peer) = 0;
  // How a peer that is not alive went, for messages: "exited" or "shut fastcomm down".
  virtual std::string peer_gone_how(int /*peer*/) { return "exited"; }
};

// The kinds the device engine runs (device/ops.cpp); it refuses the others.
bool device_runs(OpKind k);

namespace device {
class Runtime;
}
// The device engine (device/engine.cpp) over a runtime: the real one (cuda/runtime.cpp) or the
// fake (FASTCOMM_FAKE_DEVICE=1 routes CPU tensors through it, for tests).
std::shared_ptr<DeviceEngine> make_device_engine(const EngineOptions& opts, HostLink& host,
                                                 std::unique_ptr<device::Runtime> runtime);

using DeviceEngineFactory =
    std::function<std::shared_ptr<DeviceEngine>(const EngineOptions& opts, HostLink& host, int index)>;
// Called once per device type, at static initialisation, by the device's path.
bool register_device_engine(c10::DeviceType type, DeviceEngineFactory factory);
const DeviceEngineFactory* device_engine_factory(c10::DeviceType type);

}  // namespace fastcomm
