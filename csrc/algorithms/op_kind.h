#pragma once
// Every operation fastcomm offers, in one list: its kind, the name users see, and torch's
// OpType for its Work. A message carries the kind of the algorithm that runs, so variants of
// one collective (all_gather into a list or into one tensor) match each other on the wire.
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>

#define FASTCOMM_OP_KINDS(X)                                           \
  X(kAllReduce, "all_reduce", ALLREDUCE)                               \
  X(kBroadcast, "broadcast", BROADCAST)                                \
  X(kAllGather, "all_gather", ALLGATHER)                               \
  X(kAllGatherIntoTensor, "all_gather_into_tensor", _ALLGATHER_BASE)   \
  X(kReduceScatter, "reduce_scatter", REDUCE_SCATTER)                  \
  X(kReduceScatterTensor, "reduce_scatter_tensor", _REDUCE_SCATTER_BASE) \
  X(kBarrier, "barrier", BARRIER)                                      \
  X(kSend, "send", SEND)                                               \
  X(kRecv, "recv", RECV)                                               \
  X(kReduce, "reduce", REDUCE)                                         \
  X(kGather, "gather", GATHER)                                         \
  X(kScatter, "scatter", SCATTER)                                      \
  X(kAllToAll, "all_to_all", ALLTOALL)                                 \
  X(kAllToAllSingle, "all_to_all_single", ALLTOALL_BASE)               \
  X(kSparseAllReduce, "all_reduce (sparse)", ALLREDUCE)

namespace fastcomm {

enum class OpKind : uint8_t {
  kNone = 0,  // never on the wire: a zeroed header is no op's
#define FASTCOMM_OP_KIND_ENUM(kind, name, type) kind,
  FASTCOMM_OP_KINDS(FASTCOMM_OP_KIND_ENUM)
#undef FASTCOMM_OP_KIND_ENUM
  kCount
};

const char* op_kind_name(OpKind k);
c10d::OpType op_kind_type(OpKind k);

}  // namespace fastcomm
