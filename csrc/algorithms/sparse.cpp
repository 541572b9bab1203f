// all_reduce of sparse COO tensors (SUM), as torch's Gloo backend defines it: every member
// gathers every other member's coalesced indices and values, adds the members' tensors up in
// group-rank order with the same ATen calls as Gloo and coalesces, so all members hold the same
// tensor, bit for bit Gloo's (the union of the indices; an index whose values cancel stays,
// with zeros). Three exchanges in one op: each member's shape and nnz, then the indices, then
// the values, whose sizes the first one gave.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "algorithms/collectives.h"
#include "algorithms/exchange.h"
#include "algorithms/reduce.h"
#include "common/errors.h"

namespace fastcomm {
namespace {

constexpr uint32_t kSparseTag = 0x200;  // + phase
constexpr int kShapes = 0, kIndices = 1, kValues = 2, kPhases = 3;

std::string sizes_str(const int64_t* s, int64_t n) {
  std::string out = "[";
  for (int64_t i = 0; i < n; ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

class SparseAllReduce final : public Op {
 public:
  SparseAllReduce(OpDesc d, at::Tensor t, const GroupView& g)
      : Op(d), tensor_(std::move(t)), rank_(g.rank), size_(g.size()), global_rank_(g.global_rank),
        label_(g.label()) {}

  bool step(Comm& c) override {
    bool any = false;
    while (phase_ < kPhases) {
      if (!started_) {
        start(c);
        started_ = true;
        any = true;
      }
      any |= ex_.step(c);
      if (!ex_.done()) return any;
      if (phase_ == kShapes) check_shapes();
      if (++phase_ == kPhases) add_up();
      started_ = false;
    }
    return any;
  }
  bool done() const override { return phase_ == kPhases; }
  void append_outputs(std::vector<at::Tensor>& out) const override { out.push_back(tensor_); }
  // Each run reads the tensor as it is then: its nnz may change between runs.
  bool restartable() const override { return true; }
  void restart() override {
    phase_ = 0;
    started_ = false;
  }

 private:
  // Row q of shapes_: member q's sparse_dim, nnz and sizes (desc().numel is the tensor's
  // dimension count, agreed on through every message's header).
  int64_t* row(int q) { return shapes_.data_ptr<int64_t>() + q * (2 + dims()); }
  int64_t dims() const { return (int64_t)desc_.numel; }

  void start(Comm& c) {
    ExchangePlan p;
    p.send.resize(size_);
    p.recv.resize(size_);
    p.tag = kSparseTag + phase_;
    std::vector<at::Tensor> owners;
    size_t es = 1;
    auto all = [&](const at::Tensor& own, const std::vector<at::Tensor>& theirs) {
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        p.send[q] = Span::of(own.data_ptr(), own.nbytes());
        p.recv[q] = Span::of(theirs[q].data_ptr(), theirs[q].nbytes());
      }
      owners = theirs;
      owners.push_back(own);
      es = own.element_size();
    };
    at::AutoDispatchBelowAutograd below;  // the caller's tensors, whatever their grad mode
    if (phase_ == kShapes) {
      // A plan's run: the header's dimension count is the recorded tensor's.
      if (tensor_.dim() != dims())
        throw_comm_error("fastcomm: rank " + std::to_string(global_rank_) + ", group " + label_ +
                         ": a plan's sparse all_reduce: the tensor has " + std::to_string(tensor_.dim()) +
                         " dimensions, it had " + std::to_string(dims()) +
                         " when the plan was recorded; record the plan again");
      input_ = tensor_.coalesce();
      shapes_ = at::empty({size_, 2 + dims()}, at::kLong);
      int64_t* mine = row(rank_);
      mine[0] = input_.sparse_dim();
      mine[1] = input_._nnz();
      for (int64_t i = 0; i < dims(); ++i) mine[2 + i] = input_.size(i);
      std::vector<at::Tensor> rows;
      for (int q = 0; q < size_; ++q) rows.push_back(shapes_[q]);
      all(rows[rank_], rows);
    } else if (phase_ == kIndices) {
      indices_.assign(size_, at::Tensor());
      for (int q = 0; q < size_; ++q)
        indices_[q] = q == rank_ ? input_._indices().contiguous()
                                 : at::empty({row(q)[0], row(q)[1]}, at::kLong);
      all(indices_[rank_], indices_);
    } else {
      values_.assign(size_, at::Tensor());
      const at::Tensor own = input_._values().contiguous();
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) {
          values_[q] = own;
          continue;
        }
        std::vector<int64_t> shape = own.sizes().vec();
        shape[0] = row(q)[1];
        values_[q] = at::empty(shape, own.options());
      }
      all(own, values_);
    }
    ex_.start(std::move(p), rank_, size_, es, c, owners);
  }

  // Every member checks every other's shape against its own, so all of them fail on a
  // difference, each naming the member it differs from.
  void check_shapes() {
    const int64_t* mine = row(rank_);
    for (int q = 0; q < size_; ++q) {
      const int64_t* theirs = row(q);
      bool same = true;
      for (int64_t i = 0; i < 2 + dims(); ++i) same &= i == 1 || theirs[i] == mine[i];
      if (same) continue;
      throw_comm_error("fastcomm: rank " + std::to_string(global_rank_) + ", group " + label_ +
                       ": all_reduce of sparse tensors of different shapes: this rank's has sizes " +
                       sizes_str(mine + 2, dims()) + " (sparse_dim " + std::to_string(mine[0]) +
                       "), group rank " + std::to_string(q) + "'s " + sizes_str(theirs + 2, dims()) +
                       " (sparse_dim " + std::to_string(theirs[0]) + ")");
    }
  }

  // Member by member in group-rank order, then coalesced: Gloo's sequence, whose rounding
  // (coalescing sorts, and a concatenation of all members at once would add an index's values
  // in another order) every member then shares with Gloo's result.
  void add_up() {
    at::AutoDispatchBelowAutograd below;
    at::Tensor sum = at::sparse_coo_tensor(indices_[0], values_[0], input_.sizes(), input_.options());
    for (int q = 1; q < size_; ++q)
      sum.add_(at::sparse_coo_tensor(indices_[q], values_[q], input_.sizes(), input_.options()));
    tensor_.copy_(sum.coalesce());
    input_ = at::Tensor();
    indices_.clear();
    values_.clear();
  }

  at::Tensor tensor_;  // the caller's, which receives the result
  at::Tensor input_;   // its coalesced form, as the run found it
  at::Tensor shapes_;
  std::vector<at::Tensor> indices_, values_;  // by group rank
  int rank_, size_, global_rank_;
  std::string label_;
  Exchange ex_;
  int phase_ = 0;
  bool started_ = false;
};

}  // namespace

std::unique_ptr<Op> make_sparse_all_reduce(const at::Tensor& t, const GroupView& g) {
  OpDesc d{OpKind::kSparseAllReduce, t.scalar_type(), RedOp::SUM, (uint64_t)t.dim(), -1};
  return std::make_unique<SparseAllReduce>(d, t, g);
}

}  // namespace fastcomm
