#pragma once
// An op is a non-blocking state machine: the engine calls step() whenever something may have
// changed (a message arrived, ring space freed) and the op moves as far as it can without
// waiting, then returns. It owns references to its tensors for as long as it lives.
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "algorithms/comm.h"

namespace fastcomm {

class Op {
 public:
  explicit Op(OpDesc desc) : desc_(desc) {}
  virtual ~Op() = default;
  // Returns true if it made any progress. May throw CommError (mismatch, protocol).
  virtual bool step(Comm& comm) = 0;
  virtual bool done() const = 0;
  // Tensors handed to the user's Future when the op completes.
  virtual std::vector<at::Tensor> outputs() const = 0;
  const OpDesc& desc() const { return desc_; }

 protected:
  OpDesc desc_;
};

// all_reduce of `t` in place over a group of `size` ranks where this process is `rank`.
std::unique_ptr<Op> make_all_reduce(const at::Tensor& t, c10d::ReduceOp::RedOpType op, int rank,
                                    int size);

}  // namespace fastcomm
