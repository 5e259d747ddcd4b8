/* Reused temporaries for the C++ training ops (train_linear.cpp, train_conv.cpp), as
 * intqat.ops.cpu_kernels.scratch is for the Python path: for values that die inside one op call (int32
 * accumulators, bool masks before packing, digit planes, int16 GEMM packs, a dequantized operand). A fresh
 * multi-MB tensor costs page faults on first touch, more than the pass that fills it; one buffer per role
 * and thread, grown as needed. Never return a view of one, never hold two views of one role at once, never
 * change a returned tensor's shape or strides in place (resize_, as_strided_: it is the role's kept view).
 *
 * The view of the last shape asked for is kept with the buffer and returned as is while the shape and dtype
 * repeat (every training step asks the same shapes): the narrow + view that make it are four dispatched aten
 * ops (narrow, slice, as_strided, view), ~3 us a call under torch.profiler, three calls a linear layer's step
 * (AMX Xeon, 2026-11-28).
 *
 * role: a string literal (or any pointer whose characters never change while the process runs). */
#ifndef INTQAT_SCRATCH_H
#define INTQAT_SCRATCH_H
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <string>
#include <unordered_map>

namespace intqat {

inline at::Tensor scratch(const char *role, at::IntArrayRef shape, at::ScalarType dtype) {
    struct Kept {
        at::Tensor buf;   // (n,) the storage, grown as needed
        at::Tensor view;  // the last view handed out: buf's first elements as `shape`
    };
    thread_local std::unordered_map<std::string, Kept> bufs;  // (inline: one map per thread, program-wide)
    // roles are string literals: found by their address first (a pointer hash), by their characters (a std::string
    // built and hashed, ~0.1 us) only the first time an address is seen; literals of the same role at two addresses
    // (two translation units) share its one buffer. (The map's elements never move: the pointers stay valid.)
    thread_local std::unordered_map<const char *, Kept *> by_address;
    Kept *&found = by_address[role];
    if (found == nullptr) found = &bufs[role];
    Kept &k = *found;  // each role has one dtype
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    if (k.buf.defined() && k.buf.numel() >= n && k.buf.scalar_type() == dtype && k.view.defined() &&
        k.view.sizes() == shape)
        return k.view;
    // made as normal tensors even inside torch.inference_mode (a validation pass): the buffers outlive the call, and
    // the next training step writes them in place, which torch refuses for an inference tensor or a view made in
    // inference mode ("Inplace update to inference tensor outside InferenceMode")
    c10::InferenceMode normal(false);
    if (!k.buf.defined() || k.buf.numel() < n || k.buf.scalar_type() != dtype) {
        k.buf = at::empty({n}, at::TensorOptions().dtype(dtype));
        k.view = at::Tensor();
    }
    if (!k.view.defined() || k.view.sizes() != shape) k.view = k.buf.narrow(0, 0, n).view(shape);
    return k.view;
}

}  // namespace intqat
#endif
