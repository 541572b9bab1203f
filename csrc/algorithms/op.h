#pragma once
// An op is a non-blocking state machine: the engine calls step() whenever something may have
// changed (a message arrived, ring space freed) and the op moves as far as it can without
// waiting, then returns. It owns references to its tensors for as long as it lives.
#include <ATen/core/Tensor.h>

#include <functional>
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
  // Tensors handed to the user's Future when the op completes, appended to `out` (a batch
  // gathers its ops' into one list without a list per op).
  virtual void append_outputs(std::vector<at::Tensor>& out) const = 0;
  std::vector<at::Tensor> outputs() const {
    std::vector<at::Tensor> out;
    append_outputs(out);
    return out;
  }
  // A persistent plan's ops run again and again: restart() readies a completed op to run
  // from the start, on its tensors' contents then.
  virtual bool restartable() const { return false; }
  virtual void restart() {}
  // Appends the group ranks this unfinished op waits for (a message not yet come, or a ring
  // they do not read), where it can tell: a timeout's message names them.
  virtual void awaiting(std::vector<int>& group_ranks) const {}
  const OpDesc& desc() const { return desc_; }

 protected:
  OpDesc desc_;
};

// What a queue entry holds: an op it owns, or (not owned) one a persistent plan owns and
// restarts. Converts from std::unique_ptr<Op>, which it then owns.
struct OpRelease {
  bool owned = true;
  OpRelease() = default;
  template <typename T>
  OpRelease(std::default_delete<T>) {}  // NOLINT: implicit, from an owning unique_ptr
  explicit OpRelease(bool o) : owned(o) {}
  void operator()(Op* p) const {
    if (owned) delete p;
  }
};
using OpPtr = std::unique_ptr<Op, OpRelease>;

// Where a group's members live, for the hierarchical collectives: given only for a group that
// spans hosts and has several members on at least one of them (otherwise null: flat). Every
// member computes it from the same rendezvous data, so all of them pick the same algorithm.
struct HostLayout {
  std::vector<int> leader;   // by group rank: the group rank that leads that member's host
                             // (the host's lowest group rank)
  std::vector<int> leaders;  // the leaders, ascending
};

}  // namespace fastcomm
