#pragma once
// Elementwise reduction kernels shared by all algorithms. Written as plain loops over
// contiguous memory so the compiler vectorises them; 16-bit floats go through float.
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstddef>

namespace fastcomm {

// dst[i] = dst[i] (op) src[i] for n elements.
void reduce_into(void* dst, const void* src, size_t n, c10::ScalarType dtype,
                 c10d::ReduceOp::RedOpType op);
// dst[i] = a[i] (op) b[i] for n elements.
void reduce_to(void* dst, const void* a, const void* b, size_t n, c10::ScalarType dtype,
               c10d::ReduceOp::RedOpType op);
// dst[i] /= divisor (floating dtypes only; used for AVG).
void divide_by(void* dst, size_t n, c10::ScalarType dtype, int divisor);

// Picks the build of the loops for this process: on x86-64, the AVX2 one where the CPU has
// it, unless `baseline` (how the tests cover the baseline build on AVX2 machines). Until it is
// called the baseline build runs; each engine calls it as it starts.
void select_reduce_kernels(bool baseline = false);
// The build select_reduce_kernels() picked: "avx2" or "baseline" (what tests check it by).
const char* reduce_kernels();

// Floating and integer dtypes, and bool (whose SUM and MAX are a logical or, PRODUCT and MIN a
// logical and, as in torch's other backends).
bool dtype_supported(c10::ScalarType dtype);
// True when folding in any order gives bit-identical results (integers, MIN, MAX).
bool order_independent(c10::ScalarType dtype, c10d::ReduceOp::RedOpType op);

}  // namespace fastcomm
