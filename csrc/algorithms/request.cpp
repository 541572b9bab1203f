#include "algorithms/request.h"

#include <ATen/ops/view_as_real.h>

#include <algorithm>
#include <sstream>

#include "algorithms/reduce.h"

namespace fastcomm {

std::string GroupView::label() const {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  os << "]";
  return os.str();
}

// Messages are built only on failure: TORCH_CHECK evaluates its message arguments lazily, so
// labels are formatted there and not on every call.
int GroupView::group_rank_of(int global, const char* api, const char* arg) const {
  auto it = std::find(ranks.begin(), ranks.end(), global);
  TORCH_CHECK_VALUE(it != ranks.end(), "fastcomm.", api, ": rank ", global_rank, ", group ", label(),
                    ": argument '", arg, "' is rank ", global, ", which is not in the group");
  return (int)(it - ranks.begin());
}

std::ostream& operator<<(std::ostream& os, const ArgName& a) {
  os << a.name;
  if (a.index >= 0) os << "[" << a.index << "]";
  return os;
}

bool collective_dtype(c10::ScalarType dt) { return dtype_supported(dt) || c10::isComplexType(dt); }

void check_tensor(const at::Tensor& t, const GroupView& g, OpKind k, ArgName arg) {
  const char* api = op_kind_name(k);
  TORCH_CHECK_VALUE(t.defined(), "fastcomm.", api, ": rank ", g.global_rank, ", group ", g.label(),
                    ": argument '", arg, "' is undefined");
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, "fastcomm.", api, ": rank ", g.global_rank, ", group ",
                    g.label(), ": argument '", arg, "' must be a dense tensor, got layout ", t.layout());
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), "fastcomm.", api, ": rank ", g.global_rank,
                    ", group ", g.label(), ": argument '", arg, "' is on ", t.device(),
                    "; CPU and CUDA tensors are supported");
  TORCH_CHECK_VALUE(t.is_contiguous(), "fastcomm.", api, ": rank ", g.global_rank, ", group ", g.label(),
                    ": argument '", arg, "' must be contiguous");
  TORCH_CHECK_TYPE(collective_dtype(t.scalar_type()), "fastcomm.", api,
                   ": rank ", g.global_rank, ", group ", g.label(), ": argument '", arg, "' has unsupported dtype ",
                   t.scalar_type());
  // The bits say how to read the memory, which travels as is: a lazily conjugated or negated
  // view would be sent (and folded) as the tensor it was made from.
  TORCH_CHECK_VALUE(!t.is_conj(), "fastcomm.", api, ": rank ", g.global_rank, ", group ", g.label(), ": argument '",
                    arg, "' is a lazily conjugated view; call resolve_conj() on it first");
  TORCH_CHECK_VALUE(!t.is_neg(), "fastcomm.", api, ": rank ", g.global_rank, ", group ", g.label(), ": argument '",
                    arg, "' is a lazily negated view (such as x.conj().imag); call resolve_neg() on it first");
}

void check_like(const at::Tensor& t, const at::Tensor& ref, int64_t numel, const GroupView& g, OpKind k,
                ArgName arg) {
  const char* api = op_kind_name(k);
  check_tensor(t, g, k, arg);
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), "fastcomm.", api, ": rank ", g.global_rank, ", group ",
                   g.label(), ": argument '", arg, "' has dtype ", t.scalar_type(), ", expected ",
                   ref.scalar_type());
  // One device per op: it runs on that device's path as a whole.
  TORCH_CHECK_VALUE(t.device() == ref.device(), "fastcomm.", api, ": rank ", g.global_rank, ", group ",
                    g.label(), ": argument '", arg, "' is on ", t.device(), ", expected ", ref.device());
  TORCH_CHECK_VALUE(numel < 0 || t.numel() == numel, "fastcomm.", api, ": rank ", g.global_rank, ", group ", g.label(),
                    ": argument '", arg, "' has ", t.numel(), " elements, expected ", numel);
}

void check_reduce_op(RedOp op, c10::ScalarType dt, const GroupView& g, OpKind k) {
  using R = c10d::ReduceOp;
  const char* api = op_kind_name(k);
  const bool bitwise = op == R::BAND || op == R::BOR || op == R::BXOR;
  // torch's Gloo refuses it too; the same result is a multiply by the factor, then SUM.
  TORCH_CHECK_VALUE(op != R::PREMUL_SUM, "fastcomm.", api, ": rank ", g.global_rank, ", group ", g.label(),
                    ": argument 'op' PREMUL_SUM is not supported (as in torch's Gloo backend); multiply the ",
                    "tensor by the factor and use SUM");
  TORCH_CHECK_VALUE(op == R::SUM || op == R::AVG || op == R::PRODUCT || op == R::MIN || op == R::MAX || bitwise,
                    "fastcomm.", api, ": rank ", g.global_rank, ", group ", g.label(), ": argument 'op' ",
                    redop_name(op), " is not supported (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR are)");
  TORCH_CHECK_VALUE(!c10::isComplexType(dt) || op == R::SUM || op == R::AVG, "fastcomm.", api, ": rank ",
                    g.global_rank, ", group ", g.label(), ": argument 'op' ", redop_name(op),
                    " is not supported on complex dtype ", dt, " (SUM and AVG are)");
  TORCH_CHECK_VALUE(op != R::AVG || c10::isFloatingType(dt) || c10::isComplexType(dt), "fastcomm.", api,
                    ": rank ", g.global_rank, ", group ", g.label(), ": argument 'op' AVG needs a floating dtype, got ",
                    dt);
  TORCH_CHECK_VALUE(!bitwise || c10::isIntegralType(dt, /*includeBool=*/true), "fastcomm.", api, ": rank ",
                    g.global_rank, ", group ", g.label(), ": argument 'op' ", redop_name(op),
                    " needs an integer or bool dtype, got ", dt);
}

namespace {
const at::Tensor* first_tensor(const OpRequest& r) {
  if (r.tensor.defined()) return &r.tensor;
  if (r.output.defined()) return &r.output;
  for (const auto& t : r.list)
    if (t.defined()) return &t;
  return nullptr;
}
}  // namespace

c10::Device request_device(const OpRequest& r) {
  const at::Tensor* t = first_tensor(r);
  return t ? t->device() : c10::Device(c10::kCPU);
}

namespace {
void view_as_real_into(at::Tensor& t, RealViews& views) {
  // A sparse tensor's values travel as bytes and torch adds them up: no view needed.
  if (!t.defined() || !t.is_complex() || t.layout() != c10::kStrided) return;
  at::Tensor real = at::view_as_real(t);
  views.emplace_back(real, t);
  t = std::move(real);
}
}  // namespace

RealViews view_complex_as_real(OpRequest& r) {
  RealViews views;
  view_as_real_into(r.tensor, views);
  view_as_real_into(r.output, views);
  for (auto& t : r.list) view_as_real_into(t, views);
  for (auto& t : r.inputs) view_as_real_into(t, views);
  return views;
}

void restore_complex(std::vector<at::Tensor>& ts, const RealViews& views) {
  for (auto& t : ts)
    for (const auto& [real, given] : views)
      if (t.unsafeGetTensorImpl() == real.unsafeGetTensorImpl()) {
        t = given;
        break;
      }
}

void check_request(const OpRequest& r, const GroupView& g) {
  TORCH_CHECK_VALUE(r.kind > OpKind::kNone && r.kind < OpKind::kCount, "fastcomm: rank ", g.global_rank,
                    ": unknown op kind ", (int)r.kind);
  collective_spec(r.kind).check(r, g);
}

}  // namespace fastcomm
