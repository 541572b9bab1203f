#include "algorithms/comm.h"

#include <sstream>

namespace fastcomm {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSend: return "send/recv";
    case OpKind::kRecv: return "recv";
  }
  return "unknown op";
}

const char* redop_name(uint8_t op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNKNOWN";
  }
}

std::string describe(const OpDesc& d) {
  std::ostringstream os;
  os << op_kind_name(d.kind) << "(dtype=" << c10::toString(d.dtype) << ", numel=" << d.numel;
  if (d.kind == OpKind::kAllReduce || d.kind == OpKind::kReduceScatter) os << ", op=" << redop_name(d.redop);
  if (d.root >= 0) os << ", root=" << d.root;
  os << ")";
  return os.str();
}

}  // namespace fastcomm
