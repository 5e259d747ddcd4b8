/* intqat_train::observe_minmax_: one training step of a static activation observer (min-max or moving
 * average of the range, then scale and zero point) in one call: the eager CPU fast path of
 * intqat.nn.quantizers.ActivationQuantizer.integer_input.
 *
 * Why: the observer runs before every integer layer at every training step; through Python its dozen scalar
 * steps, four buffer writes and the checks around them cost ~18 us a call (~35 us inside a training step,
 * with cold caches): more than an integer layer's whole C++ forward at BERT-tiny sizes.
 *
 * Same bits as the Python scalar path (ActivationQuantizer._observe_scalar) and so as the tensor path: the
 * update is observe.h's (shared with train_linear.cpp's observed_int_linear). tests/test_observers.py compares
 * the buffers with the Python and the tensor paths after sequences of batches.
 *
 * Returns 1: observed (buffers updated; the batch was finite); 0: the batch held NaN / inf; -1: the kept
 * range is not finite (a loaded state). On 0 and -1 nothing changed: the caller's general path runs. */
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "observe.h"  // intqat::train::observe_update, one_float

extern "C" void intqat_minmax(const float *x, int64_t n, float *out);  // fused.c

namespace {

int64_t observe_minmax_(const at::Tensor &x, at::Tensor &min_val, at::Tensor &max_val, at::Tensor &scale,
                        at::Tensor &zero_point, at::Tensor &initialized, bool first, bool moving_average,
                        double averaging_constant, int64_t qmin, int64_t qmax, bool symmetric, double eps) {
    TORCH_CHECK(x.numel() > 0 && x.device().is_cpu(), "intqat_train::observe_minmax_: a non-empty CPU tensor");
    using intqat::train::one_float;
    TORCH_CHECK(one_float(min_val) && one_float(max_val) && one_float(scale) && one_float(zero_point),
                "intqat_train::observe_minmax_: the observer's buffers must be one float32 element each on the CPU");
    const at::Tensor xc = x.detach().to(at::kFloat).contiguous();
    float mm[2];
    intqat_minmax(xc.data_ptr<float>(), xc.numel(), mm);
    return intqat::train::observe_update(mm[0], mm[1], min_val, max_val, scale, zero_point, initialized, first,
                                         moving_average, averaging_constant, qmin, qmax, symmetric, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(intqat_train, m) {
    m.def("observe_minmax_(Tensor x, Tensor(a!) min_val, Tensor(b!) max_val, Tensor(c!) scale, Tensor(d!) zero_point, "
          "Tensor(e!) initialized, bool first, bool moving_average, float averaging_constant, int qmin, int qmax, "
          "bool symmetric, float eps) -> int",
          observe_minmax_);
}
