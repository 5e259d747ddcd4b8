/* intqat_train::observe_minmax_: one training step of a static activation observer (min-max or moving
 * average of the range, then scale and zero point) in one call: the eager CPU fast path of
 * intqat.nn.quantizers.ActivationQuantizer.integer_input.
 *
 * Why: the observer runs before every integer layer at every training step; through Python its dozen scalar
 * steps, four buffer writes and the checks around them cost ~18 us a call (~35 us inside a training step,
 * with cold caches): more than an integer layer's whole C++ forward at BERT-tiny sizes.
 *
 * Same bits as the Python scalar path (ActivationQuantizer._observe_scalar, qparams.scale_zero_point_scalar)
 * and so as the tensor path: every value is a float32 and every +, -, *, / one float32 operation, which is
 * what the Python code's _f32(a op b) rounds to (53 >= 2 * 24 + 2 bits: the double result rounded once is
 * the correctly rounded float32 one); min / max pick as Python's do; rounding is nearbyint's half to even,
 * as Python's round(). Compiled with -ffp-contract=off (no FMA). tests/test_observers.py compares the
 * buffers with the Python and the tensor paths after sequences of batches.
 *
 * Returns 1: observed (buffers updated; the batch was finite); 0: the batch held NaN / inf; -1: the kept
 * range is not finite (a loaded state). On 0 and -1 nothing changed: the caller's general path runs. */
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

extern "C" void intqat_minmax(const float *x, int64_t n, float *out);  // fused.c

namespace {

int64_t observe_minmax_(const at::Tensor &x, at::Tensor &min_val, at::Tensor &max_val, at::Tensor &scale,
                        at::Tensor &zero_point, at::Tensor &initialized, bool first, bool moving_average,
                        double averaging_constant, int64_t qmin, int64_t qmax, bool symmetric, double eps) {
    TORCH_CHECK(x.numel() > 0 && x.device().is_cpu(), "intqat_train::observe_minmax_: a non-empty CPU tensor");
    const at::Tensor xc = x.detach().to(at::kFloat).contiguous();
    float mm[2];
    intqat_minmax(xc.data_ptr<float>(), xc.numel(), mm);
    const float lo = mm[0], hi = mm[1];
    if (!std::isfinite(lo) || !std::isfinite(hi)) return 0;  // NaN / inf
    float new_lo = lo, new_hi = hi;
    if (!first) {
        const float old_lo = min_val.item<float>(), old_hi = max_val.item<float>();
        if (!moving_average) {  // Python's min(old, lo) / max(old, hi): old unless the new one is beyond it
            new_lo = lo < old_lo ? lo : old_lo;
            new_hi = hi > old_hi ? hi : old_hi;
        } else {  // min_val += c * (lo - min_val), each step rounded to float32
            const float c = (float)averaging_constant;
            new_lo = old_lo + c * (lo - old_lo);
            new_hi = old_hi + c * (hi - old_hi);
        }
    }
    if (!std::isfinite(new_lo) || !std::isfinite(new_hi)) return -1;
    // scale_zero_point_scalar: the range widened to hold 0, then the symmetric or the affine grid
    const float r_lo = std::min(new_lo, 0.0f), r_hi = std::max(new_hi, 0.0f);
    float s;
    int64_t z = 0;
    if (symmetric) {
        s = std::max(std::max(-r_lo, r_hi) / (float)((qmax - qmin) / 2.0), (float)eps);
    } else {
        s = std::max((r_hi - r_lo) / (float)(qmax - qmin), (float)eps);
        const float zf = (float)qmin - std::nearbyint(r_lo / s);  // qmin - round(lo / s), as a float32
        z = (int64_t)std::min(std::max(zf, (float)qmin), (float)qmax);
    }
    min_val.fill_(new_lo);
    max_val.fill_(new_hi);
    scale.variable_data().fill_(s);  // `.data`, as the Python path: a learnable scale's version is not bumped
    zero_point.variable_data().fill_((double)z);
    if (first) initialized.fill_(true);
    return 1;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(intqat_train, m) {
    m.def("observe_minmax_(Tensor x, Tensor(a!) min_val, Tensor(b!) max_val, Tensor(c!) scale, Tensor(d!) zero_point, "
          "Tensor(e!) initialized, bool first, bool moving_average, float averaging_constant, int qmin, int qmax, "
          "bool symmetric, float eps) -> int",
          observe_minmax_);
}
