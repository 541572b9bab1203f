#pragma once
// Ops whose tensors live on another device (CUDA) run on that device's engine, made at the
// first such op from a factory that the device's path registers (csrc/cuda). The host engine
// hands it requests that passed the common checks (algorithms/request.h) and the Works it
// returns; it never looks inside.
#include <torch/csrc/distributed/c10d/Store.hpp>

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
  std::string label;
};

class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;
  // Issues the ops together; one Work for all of them. A blocking call (async_op false)
  // returns with the caller's current stream ordered after them.
  virtual c10::intrusive_ptr<Work> post(std::vector<DeviceOp> ops, bool async_op) = 0;
  // Fails what is pending; later posts raise.
  virtual void shutdown() = 0;
};

using DeviceEngineFactory =
    std::function<std::shared_ptr<DeviceEngine>(const EngineOptions& opts, c10d::Store& store, int index)>;
// Called once per device type, at static initialisation, by the device's path.
bool register_device_engine(c10::DeviceType type, DeviceEngineFactory factory);
const DeviceEngineFactory* device_engine_factory(c10::DeviceType type);

}  // namespace fastcomm
