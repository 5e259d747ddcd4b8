"""The C++ training steps as a backend: `linear_step`, `grouped_step` and `conv_step` in one C++ autograd op each.

intqat.ops.cpp_step builds and calls the ops (kernels/cpu/train_linear.cpp, train_grouped.cpp, train_conv.cpp);
this class says when they may run. They call cpu_fused's C kernels for every elementwise pass and, for the forward
GEMM, torch._int_mm (cpu_fused), AVX2 vpmaddwd (avx2_int16), the AMX forward kernel (amx; linear only) or oneDNN's int8
conv (onednn_conv; convs only): the same bits as the Python path, one call each way. So the table gives them a call only where its own choice for every primitive of that step is a kernel
the op calls; the reason names the primitive and where the table puts it otherwise (a forced backend, a
GEMM the self-check refused, a CPU class).

The primitives (`reference` implements them all: the op's Python path, eager or traced; defined by
intqat/ops/int_linear.py, int_linear_grouped.py and int_conv2d.py, which register it, `Reference.define`):

    linear_step(x2d, weight, bias, x_scale, x_zero_point, w_scale, spec, s_x, z_x) -> y (M, N)
        x2d (M, K) fp32 row-major, weight (N, K); shape (M, K, N). spec: int_linear.LinearStep, the op's options
        (`op`, int_linear.LinearSpec: qmin / qmax of x and W, x_dynamic, masks, grad_gemm) and the facts
        (w_scale_given, learned, x_scale_float32, finite); s_x / z_x: the static activation scale and zero point
        as Python numbers (eager CPU calls; None otherwise).
    grouped_step(x2d, weight, bias, x_scale, x_zero_point, w_scale, spec, s_x, z_x) -> y (M, N)
        the per-group (8da4w) layer; shape (M, K, N); spec: int_linear_grouped.GroupedStep (`op`, GroupedSpec: group
        size, ranges, x_dynamic, w_clip_mask; and the facts as linear_step's). Its forward runs cpu_fused's per-group
        VNNI kernel, avx2_int16's vpmaddwd kernel (CPUs without int8 dot products) or amx's tile kernel, as the table
        runs linear_grouped (elsewhere the Python path runs); grad_w as digits where the table's digit GEMM pays
        (never without int8 dot products: there both backward GEMMs are fp32).
    conv_step(x, weight, bias, x_scale, x_zero_point, w_scale, stride, padding, dilation, spec, s_x, z_x)
        -> y (B, O, Ho, Wo); spec: int_conv2d.ConvStep (ranges, x_dynamic, w_clip_mask, groups, learned,
        x_scale_float32, finite, empty, fits_one_fp32_conv, K, gemm_shape, geometry, grad_gemm). Its forward GEMM:
        oneDNN's int8 conv where the table runs `conv_int8` on onednn_conv, else im2col + the table's `int_mm`. Its
        backward GEMMs (groups == 1, grad_gemm "int8x3"): each as a digit GEMM on the im2col form where the table's
        digit GEMM is fast for gemm_shape (the linear layers' rule), on the kernel the table runs `digit_matmul` on
        (amx's tiles or cpu_fused's torch._int_mm); else fp32 convolution_backward.
"""

from __future__ import annotations

from intqat.ops import cpp_step as ops
from intqat.ops import cpu_kernels
from intqat.ops.backends.base import Backend, plain_cpu
from intqat.ops.backends.exact import MAX_K_INT32
from intqat.ops.backends.formulas import conv_grad_x_digits_may_pay

__all__ = ["CppStep"]


class CppStep(Backend):
    name = "cpp_step"
    needs = "a C++ compiler and torch's headers (built on first use), and the kernels of cpu_fused / avx2_int16"
    primitives = frozenset({"linear_step", "conv_step", "grouped_step"})

    def __init__(self):
        self._plans: dict[tuple, tuple | str] = {}

    def unavailable(self):
        return ops.unavailable_reason()

    def refuse(self, primitive, tensors, shape, traced, spec=None):
        if traced:
            return "not while tracing (the custom op is what compile / export see)"
        if not ops.available():
            return ops.unavailable_reason()
        if not plain_cpu(*tensors):
            return "needs plain CPU tensors"
        if spec.learned:
            return "learned (LSQ) scales or zero point: their gradients are the Python path's"
        if not spec.x_scale_float32:
            return "x_scale is not float32"
        if not spec.finite:
            return "a NaN activation scale or zero point: the Python path says what torch says"
        plan = self._plan(primitive, shape, spec)
        return plan if isinstance(plan, str) else None

    # --- the plan: what one step runs, from the table's own choices --------------------------------------

    def _plan(self, primitive: str, shape, spec) -> tuple | str:
        """(gemm code, digits_x, digits_w, ran) for the op (the conv's: with digits_amx before ran), or why it may not
        run: cached per shape, options and the table's state (forced backend, off switches)."""
        key = (primitive, shape, spec, self.table.state())
        plan = self._plans.get(key)
        if plan is None:
            plan = (self._linear_plan(shape, spec) if primitive == "linear_step" else
                    self._grouped_plan(shape, spec) if primitive == "grouped_step" else self._conv_plan(spec))
            if len(self._plans) < 4096:
                self._plans[key] = plan
        return plan

    def _passes_on_cpu_fused(self, steps) -> str | None:
        """Every primitive of the step but the forward GEMM must run on cpu_fused (asked without a shape: which
        kernel, not whether an algorithm pays; the digit GEMM's `fast` question was asked already)."""
        for p in dict.fromkeys(steps):
            b = self.table.runs(p, None)
            if b != "cpu_fused":
                return f"the table runs {p} on {b}{self.table.forced_note()}: the op calls cpu_fused's kernels"
        return None

    def _gemm(self, primitive: str, shape) -> int | str:
        b = self.table.runs(primitive, shape)
        if b not in ops.LINEAR_GEMMS:
            return (f"the table runs {primitive} on {b}{self.table.forced_note()}: the op's forward GEMM is "
                    "cpu_fused's torch._int_mm, avx2_int16's or amx's kernel")
        return ops.LINEAR_GEMMS[b]

    def _linear_plan(self, shape, spec) -> tuple | str:
        M, K, N = shape
        if not (M and K and N):
            return "an empty layer (M, K or N is 0)"
        if max(M, K, N) > MAX_K_INT32:
            return "a dimension past MAX_K_INT32 (an int32 sum of the backward digit GEMMs could overflow)"
        gemm = self._gemm("linear", shape)
        if isinstance(gemm, str):
            return gemm
        op = spec.op  # (LinearStep: the op's options, then the facts)
        int8x3 = op.grad_gemm == "int8x3"
        digits_x = int8x3 and self.table.fast("digit_matmul", shape, "x")
        digits_w = int8x3 and self.table.fast("digit_matmul", shape, "w")
        x_mask, w_mask = not op.x_dynamic, op.w_clip_mask and spec.w_scale_given  # (a min-max scale never clips)
        steps = ["quantize_rows_dynamic" if op.x_dynamic else "quantize_rows",
                 "quantize_rows" if spec.w_scale_given else "quantize_rows_dynamic"]
        steps += ["pack_mask"] * (x_mask + w_mask)
        for digits, masked in ((digits_x, x_mask), (digits_w, w_mask)):
            steps += ["digit_matmul" if digits else "dequantize_rows"] + ["mask_zero_packed_"] * masked
        reason = self._passes_on_cpu_fused(steps)
        if reason is not None:
            return reason
        linear = next(name for name, code in ops.LINEAR_GEMMS.items() if code == gemm)
        ran = (("linear", linear), *((p, "cpu_fused") for p in steps))
        return gemm, digits_x, digits_w, ran

    def _grouped_plan(self, shape, spec) -> tuple | str:
        M, K, N = shape
        op = spec.op  # (GroupedStep: the op's options, then the facts)
        if not (M and K and N):
            return "an empty layer (M, K or N is 0)"
        if max(M, K, N) > MAX_K_INT32:
            return "a dimension past MAX_K_INT32 (an int32 sum of the backward digit GEMM could overflow)"
        if not spec.w_scale_given and op.w_qmin != -op.w_qmax:
            return "min-max weight scales on an asymmetric range: the Python path computes that scale"
        b = self.table.runs("linear_grouped", shape)
        if b not in ("cpu_fused", "avx2_int16", "amx"):
            return (f"the table runs linear_grouped on {b}{self.table.forced_note()}: the op calls cpu_fused's "
                    "per-group VNNI kernel, avx2_int16's vpmaddwd kernel or amx's tile kernel")
        if b == "avx2_int16":  # (avx2_int16 refuses an odd group size only when given the tensors, not a shape)
            if not cpu_kernels.int16_gemm_available() or op.group_size % 2:
                return "the per-group vpmaddwd kernel needs AVX2 in the build and an even group size"
        elif not cpu_kernels.grouped_vnni_available() or op.group_size % 4:
            return "the per-group VNNI kernel needs AVX512-VNNI in the build and a group size that is a multiple of 4"
        digits_w = self.table.fast("digit_matmul", shape, "w")
        x_mask, w_mask = not op.x_dynamic, op.w_clip_mask and spec.w_scale_given
        steps = ["quantize_rows_dynamic" if op.x_dynamic else "quantize_rows",
                 "quantize_rows" if spec.w_scale_given else "quantize_rows_dynamic", "dequantize_rows"]
        steps += ["pack_mask"] * (x_mask + w_mask) + ["mask_zero_packed_"] * (x_mask + w_mask)
        steps += ["digit_matmul" if digits_w else "dequantize_rows"]
        reason = self._passes_on_cpu_fused(steps)
        if reason is not None:
            return reason
        return ops.LINEAR_GEMMS[b], False, digits_w, (("linear_grouped", b), *((p, "cpu_fused") for p in steps))

    def _conv_plan(self, spec) -> tuple | str:
        if spec.x_dynamic:
            return "dynamic activations: the C++ conv op takes static ones"
        if spec.empty:
            return "an empty conv (no input elements or no output channels)"
        grouped = spec.groups > 1
        if grouped and not spec.fits_one_fp32_conv:
            return "a group longer than one exact fp32 conv (512 terms): the Python path cuts it into chunks"
        if not grouped and not 0 < spec.K <= MAX_K_INT32:
            return "K = C * kh * kw outside (0, MAX_K_INT32]"
        steps = ["quantize_rows", "dequantize_rows"] + ([] if grouped else ["epilogue"]) + (
            ["depthwise_grad"] if spec.depthwise else [])  # (its kernel is cpu_fused's: the op calls it)
        reason = self._passes_on_cpu_fused(steps)
        if reason is not None:
            return reason
        if grouped:  # an exact fp32 conv of the codes: no integer GEMM; the fp32 backward
            return 0, False, False, False, tuple((p, "cpu_fused") for p in steps)
        digits = self._conv_digits(spec)
        if isinstance(digits, str):
            return digits
        digits_x, digits_w, digits_ran = digits
        if self.table.runs("conv_int8", spec.gemm_shape, spec.geometry) == "onednn_conv":
            # oneDNN's int8 conv: the accumulator without im2col, then the epilogue's float steps (no int32 epilogue)
            ran = (("conv_int8", "onednn_conv"), *((p, "cpu_fused") for p in steps if p != "epilogue"))
            return ops.CONV_ONEDNN, digits_x, digits_w, digits_ran == "amx", ran + self._digits_ran(digits)
        gemm = self._gemm("int_mm", None)
        if isinstance(gemm, str):
            return gemm
        name = next(n for n, code in ops.LINEAR_GEMMS.items() if code == gemm)
        ran = (("int_mm", name), *((p, "cpu_fused") for p in steps))
        return gemm, digits_x, digits_w, digits_ran == "amx", ran + self._digits_ran(digits)

    def _conv_digits(self, spec) -> tuple | str:
        """(digits_x, digits_w, the backend of the digit GEMM or None) for a groups == 1 conv: int_conv2d's
        `_digits_chosen` (the linear layers' rule on the im2col GEMM's shape), or why the op may not run them."""
        if spec.grad_gemm != "int8x3" or spec.gemm_shape is None:
            return False, False, None
        digits_x = conv_grad_x_digits_may_pay(spec.gemm_shape) is None and \
            self.table.fast("digit_matmul", spec.gemm_shape, "x")
        digits_w = self.table.fast("digit_matmul", spec.gemm_shape, "w")
        if not (digits_x or digits_w):
            return False, False, None
        b = self.table.runs("digit_matmul", None)
        if b not in ("amx", "cpu_fused"):
            return (f"the table runs digit_matmul on {b}{self.table.forced_note()}: the op calls amx's or cpu_fused's "
                    "digit kernels")
        return digits_x, digits_w, b

    @staticmethod
    def _digits_ran(digits) -> tuple:
        digits_x, digits_w, b = digits
        return (("digit_matmul", b),) * (digits_x + digits_w)

    # --- the primitives ---------------------------------------------------------------------------------

    def linear_step(self, x2d, weight, bias, x_scale, x_zero_point, w_scale, spec, s_x, z_x):
        gemm, digits_x, digits_w, ran = self._plan("linear_step", (x2d.shape[0], x2d.shape[1], weight.shape[0]), spec)
        self.table.note_ran(ran)
        op = spec.op
        return ops.run_linear(gemm, digits_x, digits_w, x2d, weight, bias, w_scale, 0.0 if s_x is None else s_x,
                              0 if z_x is None else z_x, op.x_qmin, op.x_qmax, op.w_qmin, op.w_qmax, op.x_dynamic,
                              op.w_clip_mask and spec.w_scale_given)

    def grouped_step(self, x2d, weight, bias, x_scale, x_zero_point, w_scale, spec, s_x, z_x):
        gemm, _, digits_w, ran = self._plan("grouped_step", (x2d.shape[0], x2d.shape[1], weight.shape[0]), spec)
        self.table.note_ran(ran)
        op = spec.op
        return ops.run_grouped(digits_w, x2d, weight, bias, w_scale, 0.0 if s_x is None else s_x,
                               0 if z_x is None else z_x, op.group_size, op.x_qmin, op.x_qmax, op.w_qmin, op.w_qmax,
                               op.x_dynamic, op.w_clip_mask and spec.w_scale_given, gemm)

    def conv_step(self, x, weight, bias, x_scale, x_zero_point, w_scale, stride, padding, dilation, spec, s_x, z_x):
        gemm, digits_x, digits_w, digits_amx, ran = self._plan("conv_step", None, spec)
        self.table.note_ran(ran)
        return ops.run_conv(gemm, digits_x, digits_w, digits_amx, x, weight, bias, w_scale, s_x, z_x, stride, padding, dilation, spec.groups,
                            spec.x_qmin, spec.x_qmax, spec.w_qmin, spec.w_qmax, spec.w_clip_mask)
