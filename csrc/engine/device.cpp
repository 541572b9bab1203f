#include "engine/device.h"

#include <map>
#include <mutex>

namespace fastcomm {

namespace {
// Function-local: device paths register from static initialisers of other files.
std::map<c10::DeviceType, DeviceEngineFactory>& factories() {
  static std::map<c10::DeviceType, DeviceEngineFactory> m;
  return m;
}
}  // namespace

bool register_device_engine(c10::DeviceType type, DeviceEngineFactory factory) {
  factories()[type] = std::move(factory);
  return true;
}

const DeviceEngineFactory* device_engine_factory(c10::DeviceType type) {
  auto& m = factories();
  auto it = m.find(type);
  return it == m.end() ? nullptr : &it->second;
}

}  // namespace fastcomm
