/* Reused temporaries for the C++ training ops (train_linear.cpp, train_conv.cpp), as
 * intqat.ops.cpu_kernels.scratch is for the Python path: for values that die inside one op call (int32
 * accumulators, bool masks before packing, digit planes, int16 GEMM packs, a dequantized operand). A fresh
 * multi-MB tensor costs page faults on first touch, more than the pass that fills it; one buffer per role
 * and thread, grown as needed. Never return a view of one, never hold two views of one role at once. */
#ifndef INTQAT_SCRATCH_H
#define INTQAT_SCRATCH_H
#include <ATen/ATen.h>

#include <string>
#include <unordered_map>

namespace intqat {

inline at::Tensor scratch(const char *role, at::IntArrayRef shape, at::ScalarType dtype) {
    thread_local std::unordered_map<std::string, at::Tensor> bufs;  // (inline: one map per thread, program-wide)
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    at::Tensor &buf = bufs[role];  // each role has one dtype
    if (!buf.defined() || buf.numel() < n || buf.scalar_type() != dtype)
        buf = at::empty({n}, at::TensorOptions().dtype(dtype));
    return buf.narrow(0, 0, n).view(shape);
}

}  // namespace intqat
#endif
