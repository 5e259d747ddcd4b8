/* torch._int_mm's operands in a layout it multiplies correctly (intqat.ops.backends.reference.is_dense /
 * dense_layout, the Python twin).
 *
 * Why: torch._int_mm (CPU, torch 2.13) returns wrong numbers for some layouts with a size-1 dim, e.g. the
 * (1, N) view q_wᵀ with strides (1, 1) of a layer with one input feature (K = 1), or of a conv with one
 * input channel and a 1x1 kernel. Row-major operands, and column-major ones with no size-1 dim, are
 * right (tests/test_int_mm.py sweeps the layouts); anything else is copied row-major, which only happens
 * for degenerate shapes. */
#ifndef INTQAT_INT_MM_LAYOUT_H
#define INTQAT_INT_MM_LAYOUT_H
#include <ATen/ATen.h>

namespace intqat {

inline bool int_mm_dense(const at::Tensor &t) {  // t (rows, cols)
    const int64_t rows = t.size(0), cols = t.size(1), s0 = t.stride(0), s1 = t.stride(1);
    return (s1 == 1 && s0 == cols) || (s0 == 1 && s1 == rows && rows > 1 && cols > 1);
}

/* (not t.contiguous(): a tensor whose size-1 dim has an odd stride counts as contiguous and comes back as is) */
inline at::Tensor int_mm_operand(const at::Tensor &t) {
    return int_mm_dense(t) ? t : at::empty(t.sizes(), t.options()).copy_(t);
}

}  // namespace intqat
#endif
