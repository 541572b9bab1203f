// What the engine asks of the Python layer's connector (fastcomm/_connect.py) next.
#pragma once

#include <vector>

namespace fastcomm {

struct GlooWants {
  std::vector<int> peers;  // connections the engine asks for
  bool look = false;       // an op waits long: read the list of requests now (look_for_asks)
  bool stopping = false;   // the transport stopped: no more connections
};

}  // namespace fastcomm
