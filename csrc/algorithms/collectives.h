// The collectives as algorithms over Exchanges (collectives.cpp), for the lowering of requests
// (lowering.cpp). Every maker's choice depends only on what all members agree on.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "algorithms/exchange.h"
#include "algorithms/op.h"
#include "algorithms/request.h"

namespace fastcomm {

inline uint8_t* bytes(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }
inline size_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

std::unique_ptr<Op> make_all_reduce(const OpRequest& r, const GroupView& g);
std::unique_ptr<Op> make_broadcast(const at::Tensor& t, int root, int rank, int size);
// `outs`: member q's block; `reported`: what the op hands the caller's future.
std::unique_ptr<Op> make_all_gather(const std::vector<at::Tensor>& outs, const at::Tensor& in, int rank, int size,
                                    std::vector<at::Tensor> reported);
// `ins`: member q's block (sizes may differ); `label` ("fastcomm.<api>: rank R, group [..]")
// names this side when a pair disagrees on them.
std::unique_ptr<Op> make_reduce_scatter(const at::Tensor& out, const std::vector<at::Tensor>& ins, RedOp op,
                                        int rank, int size, std::string label);
std::unique_ptr<Op> make_barrier(const OpRequest&, const GroupView& g);
std::unique_ptr<Op> make_p2p(const at::Tensor& t, bool sending, int peer_rank, int rank);
std::unique_ptr<Op> make_reduce(const at::Tensor& t, int root, RedOp op, int rank, int size);
// gather (to the root) and scatter: the root's block q is group rank q's `t`.
std::unique_ptr<Op> make_rooted_copy(OpKind kind, const at::Tensor& t, const std::vector<at::Tensor>& blocks,
                                     int root, int rank, int size);
std::unique_ptr<Op> make_all_to_all(std::vector<Span> send, std::vector<Span> recv, std::vector<at::Tensor> outputs,
                                    std::vector<at::Tensor> keep, c10::ScalarType dtype, size_t es, const GroupView& g,
                                    OpKind api);
// all_reduce (SUM) of a sparse COO tensor, in place (algorithms/sparse.cpp).
std::unique_ptr<Op> make_sparse_all_reduce(const at::Tensor& t, const GroupView& g);

}  // namespace fastcomm
