/* One update of a static activation observer from a batch's min / max: what observe.cpp's observe_minmax_,
 * train_linear.cpp's observed_int_linear and train_conv.cpp's observed_int_conv2d (the observer and the step in one
 * call: observe_then_qparams, below) run.
 *
 * Same bits as the Python scalar path (ActivationQuantizer._observe_scalar, qparams.scale_zero_point_scalar)
 * and so as the tensor path: every value is a float32 and every +, -, *, / one float32 operation, which is
 * what the Python code's _f32(a op b) rounds to (53 >= 2 * 24 + 2 bits: the double result rounded once is
 * the correctly rounded float32 one); min / max pick as Python's do; rounding is nearbyint's half to even,
 * as Python's round(). Compiled with -ffp-contract=off (no FMA).
 *
 * The buffers are written through their data (float32, one element each, checked by the callers), as
 * `fill_` would write them: min_val, max_val and (on the first batch) initialized get a new version, as
 * fill_ gives them; scale and zero_point keep theirs, as the Python path's `.data.fill_` leaves them. */
#ifndef INTQAT_OBSERVE_H
#define INTQAT_OBSERVE_H
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace intqat {
namespace train {

/* Is t one float32 element on the CPU (an observer's buffer the update can write in place)? */
inline bool one_float(const at::Tensor &t) {
    return t.defined() && t.numel() == 1 && t.scalar_type() == at::kFloat && t.device().is_cpu();
}

/* 1: updated from the batch's (lo, hi); 0: the batch held NaN / inf; -1: the kept range is not finite (a loaded
 * state). On 0 and -1 nothing changed: the caller's general path runs. */
inline int64_t observe_update(float lo, float hi, at::Tensor &min_val, at::Tensor &max_val, at::Tensor &scale,
                              at::Tensor &zero_point, at::Tensor &initialized, bool first, bool moving_average,
                              double averaging_constant, int64_t qmin, int64_t qmax, bool symmetric, double eps) {
    if (!std::isfinite(lo) || !std::isfinite(hi)) return 0;  // NaN / inf
    float *min_p = min_val.data_ptr<float>(), *max_p = max_val.data_ptr<float>();
    float new_lo = lo, new_hi = hi;
    if (!first) {
        const float old_lo = *min_p, old_hi = *max_p;
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
    *min_p = new_lo;
    *max_p = new_hi;
    min_val.unsafeGetTensorImpl()->bump_version();
    max_val.unsafeGetTensorImpl()->bump_version();
    *scale.data_ptr<float>() = s;
    *zero_point.data_ptr<float>() = (float)z;
    if (first) {
        initialized.fill_(true);  // (any dtype the buffer has: bool)
    }
    return 1;
}

/* The observed ops' first step (train_linear.cpp's observed_int_linear, train_conv.cpp's observed_int_conv2d):
 * observe per `observe` (OBSERVE_NOTHING: eval mode, the kept scale; OBSERVE_CHECK: refuse NaN / inf; OBSERVE_UPDATE:
 * observe_update from the batch's min / max), then the activation scale and zero point the step runs on: s_x =
 * float(scale), z = round(clamp(float(zero_point), qmin, qmax)) (int_linear's rounded_zero_point_int).
 * xc: the batch, contiguous (the elements the Python path's observer reads, in its order: the same min / max bits).
 * false, having changed nothing: the general path runs (a batch holding NaN / inf, which it refuses; a kept range, scale
 * or zero point that is not finite). */
enum Observe : int64_t {  // intqat.ops.cpp_step.OBSERVE_*
    OBSERVE_NOTHING = 0 /* eval-mode training: the kept scale */,
    OBSERVE_CHECK = 1 /* training, observer off: refuse NaN / inf (the general path raises) */,
    OBSERVE_UPDATE = 2 /* training, observing: observe_update, then the updated scale */
};

extern "C" void intqat_minmax(const float *x, int64_t n, float *out);  // fused.c

inline bool observe_then_qparams(const at::Tensor &xc, int64_t observe, at::Tensor &min_val, at::Tensor &max_val,
                                 at::Tensor &scale, at::Tensor &zero_point, at::Tensor &initialized, bool first,
                                 bool moving_average, double averaging_constant, bool symmetric, int64_t qmin,
                                 int64_t qmax, double eps, float *s_x, int64_t *z) {
    if (observe != OBSERVE_NOTHING) {
        float mm[2];
        intqat_minmax(xc.data_ptr<float>(), xc.numel(), mm);
        if (!std::isfinite(mm[0]) || !std::isfinite(mm[1])) return false;  // (the general path refuses the batch)
        if (observe == OBSERVE_UPDATE &&
            observe_update(mm[0], mm[1], min_val, max_val, scale, zero_point, initialized, first, moving_average,
                           averaging_constant, qmin, qmax, symmetric, eps) != 1)
            return false;
    }
    const float s = *scale.data_ptr<float>(), z_f = *zero_point.data_ptr<float>();
    if (s != s || z_f != z_f) return false;  // NaN: the Python path says what torch says
    *s_x = s;
    *z = (int64_t)std::nearbyint(std::min(std::max((double)z_f, (double)qmin), (double)qmax));
    return true;
}

}  // namespace train
}  // namespace intqat
#endif
