#include "algorithms/comm.h"

#include <sstream>

namespace fastcomm {

const char* op_kind_name(OpKind k) {
  switch (k) {
#define FASTCOMM_OP_KIND_NAME(kind, name, type) \
  case OpKind::kind:                            \
    return name;
    FASTCOMM_OP_KINDS(FASTCOMM_OP_KIND_NAME)
#undef FASTCOMM_OP_KIND_NAME
    default:
      return "unknown op";
  }
}

c10d::OpType op_kind_type(OpKind k) {
  switch (k) {
#define FASTCOMM_OP_KIND_TYPE(kind, name, type) \
  case OpKind::kind:                            \
    return c10d::OpType::type;
    FASTCOMM_OP_KINDS(FASTCOMM_OP_KIND_TYPE)
#undef FASTCOMM_OP_KIND_TYPE
    default:
      return c10d::OpType::UNKNOWN;
  }
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
  // Both sides of a send/recv pair describe it as a send.
  os << (d.kind == OpKind::kSend ? "send/recv" : op_kind_name(d.kind));
  os << "(dtype=" << c10::toString(d.dtype);
  // all_to_all's sizes are per pair; its header holds none.
  // A sparse all_reduce's header holds the tensor's dimension count (its nnz may differ).
  if (d.kind == OpKind::kSparseAllReduce) os << ", dims=" << d.numel;
  else if (d.kind != OpKind::kAllToAll) os << ", numel=" << d.numel;
  if (d.kind == OpKind::kAllReduce || d.kind == OpKind::kReduceScatter || d.kind == OpKind::kReduce)
    os << ", op=" << redop_name(d.redop);
  if (d.root >= 0) os << ", root=" << d.root;
  os << ")";
  return os.str();
}

}  // namespace fastcomm
