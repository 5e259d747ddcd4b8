"""Every integer-conv path gives the definition's bits: oneDNN's int8 conv (backend onednn_conv, primitive
conv_int8), the C++ conv step (cpp_step) with either forward GEMM, and the Python path, each against the reference
(exact int64 sums), forward and STE backward, over stride / padding / dilation / groups / depthwise / channels_last;
and where oneDNN's conv is not taken, `explain` says why."""

import os
import subprocess
import sys

import pytest
import torch

from intqat.ops import backends, conv_onednn, cpp_step
from intqat.ops.backends.exact import exact_int_mm
from intqat.ops.cpu_features import cpu_has_int8_dot
from intqat.ops.int_conv2d import _im2col, _weight_columns, int_conv2d

ONEDNN = conv_onednn.unavailable_reason()
needs_onednn = pytest.mark.skipif(ONEDNN is not None, reason=f"oneDNN's int8 conv: {ONEDNN}")


def exact_acc(q_x, z, q_w, stride, padding, dilation):
    """The int64 definition of the conv's accumulator: im2col of the codes, exact int64 GEMM, zero-point term.
    -> (B, O, Ho, Wo) int64."""
    B, O = q_x.shape[0], q_w.shape[0]
    cols, Ho, Wo = _im2col(q_x, z, q_w.shape[2:], stride, padding, dilation, 1)
    wc = _weight_columns(q_w)
    acc = exact_int_mm(cols, wc.t()).long() - z * wc.long().sum(1)
    return acc.reshape(B, Ho, Wo, O).permute(0, 3, 1, 2)


# (B, C, H, O, k, stride, padding, dilation)
GEOMETRIES = [(2, 8, 9, 8, 3, 1, 1, 1), (2, 16, 10, 12, 3, 2, 1, 1), (1, 5, 11, 7, 3, 1, 2, 2),
              (2, 8, 8, 16, 1, 1, 0, 1), (1, 3, 12, 8, 5, 2, 2, 1), (2, 6, 7, 4, 2, 1, 0, 1)]


@needs_onednn
@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("z", [0, -128, 37])
def test_onednn_acc_is_the_exact_sum(geom, z):
    B, C, H, O, k, s, p, d = geom
    g = torch.Generator().manual_seed(sum(geom) + z)
    q_x = torch.randint(-128, 128, (B, C, H, H), dtype=torch.int8, generator=g)
    q_w = torch.randint(-128, 128, (O, C, k, k), dtype=torch.int8, generator=g)
    for x in (q_x, q_x.contiguous(memory_format=torch.channels_last)):
        acc = conv_onednn.conv_acc(x, z, q_w, [s, s], [p, p], [d, d])
        assert acc.dtype == torch.float32
        assert torch.equal(acc.long(), exact_acc(q_x, z, q_w, [s, s], [p, p], [d, d]))


@needs_onednn
@pytest.mark.parametrize("C", [57, 58, 64, 130])
def test_onednn_acc_worst_case_weights_chunked(C):
    """All -128 weights and codes at the far end from the zero point: 255 * 128 per term. From C = 58 (3x3: 522
    terms, 255 * 128 * 522 > 2^24) one fp32 accumulator would round: the input channels are cut into chunks."""
    q_x = torch.full((1, C, 5, 5), 127, dtype=torch.int8)
    q_w = torch.full((3, C, 3, 3), -128, dtype=torch.int8)
    chunks = conv_onednn.channel_chunks(q_w)
    assert chunks[0][0] == 0 and chunks[-1][1] == C and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert (len(chunks) > 1) == (C * 9 * 128 > conv_onednn.WEIGHT_ABS_LIMIT)
    acc = conv_onednn.conv_acc(q_x, -128, q_w, [1, 1], [1, 1], [1, 1])
    want = exact_acc(q_x, -128, q_w, [1, 1], [1, 1], [1, 1])
    assert want.abs().max() == 255 * 128 * 9 * C  # the centre pixels: every term at its largest
    assert torch.equal(acc.long(), want)


def _step(x, w, b, xs, xz, ws, conv):
    y = int_conv2d(x, w, b, xs, xz, ws, **conv)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    return (y, *torch.autograd.grad(y, (x, w, b), g))


# (B, C, H, O, k, conv options)
LAYERS = [
    (4, 16, 12, 16, 3, dict(padding=1)),
    (2, 8, 11, 12, 3, dict(stride=2, padding=1)),
    (2, 8, 12, 8, 3, dict(padding=2, dilation=2)),
    (2, 16, 8, 16, 3, dict(padding=1, groups=4)),
    (2, 16, 8, 16, 3, dict(padding=1, groups=16)),  # depthwise
    (2, 12, 8, 20, 1, dict()),
]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: f"{l[0]}x{l[1]}x{l[2]}->{l[3]}k{l[4]}{l[5]}")
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_every_conv_path_equals_the_reference(layer, channels_last):
    """Forward and STE backward of int_conv2d: the C++ step and the Python path, each with oneDNN's int8 conv
    (forced where it applies: it is slow for most of these small shapes) and with im2col + int_mm, equal the forced
    reference bit for bit; `recording` shows which ran. A depthwise conv's backward is depthwise_grad's, whose fp32
    sums each backend orders its own way: both eager paths give the C kernel's bits, within rounding of the reference."""
    B, C, H, O, k, conv = layer
    g = torch.Generator().manual_seed(B * C + H)
    x = (torch.randn(B, C, H, H, generator=g) * 2).requires_grad_()
    groups = conv.get("groups", 1)
    w = (torch.randn(O, C // groups, k, k, generator=g) * 0.2).requires_grad_()
    b = torch.randn(O, generator=g).requires_grad_()
    xs, xz = torch.tensor([0.03]), torch.tensor([-5.0])
    ws = w.detach().abs().amax((1, 2, 3)) / 127 * 0.8  # some weights clip: the mask matters
    xx = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    with backends.use_backend("reference"):
        want = _step(xx, w, b, xs, xz, ws, conv)
    kernel_bits = None  # a depthwise conv's gradients from the first eager path
    for force in ("onednn_conv", None):
        if force == "onednn_conv" and ONEDNN is not None:
            continue
        for cpp in (True, False):
            with (backends.use_backend(force) if force else _nothing()), \
                    (_nothing() if cpp else cpp_step.disabled()), backends.recording() as ran:
                got = _step(xx, w, b, xs, xz, ws, conv)
            depthwise = groups == C == O  # (neither forced backend here implements depthwise_grad: the table's)
            if depthwise:  # every eager path: depthwise_backward.c's bits
                kernel_bits = got if kernel_bits is None else kernel_bits
                for name, a, c in zip(("grad_x", "grad_w", "grad_b"), got[1:], kernel_bits[1:]):
                    assert torch.equal(a, c), (force, cpp, name)
            for name, a, c in zip(("y", "grad_x", "grad_w", "grad_b"), got, want):
                if depthwise and name != "y":
                    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6 * float(c.abs().max()))
                else:
                    assert torch.equal(a, c), (force, cpp, name)
            assert got[0].is_contiguous(memory_format=torch.channels_last) == want[0].is_contiguous(
                memory_format=torch.channels_last)
            onednn_ran = ran[("conv_int8", "onednn_conv")] > 0
            assert onednn_ran == (force == "onednn_conv" and groups == 1), dict(ran)
            if cpp and cpp_step.available():
                assert ran[("conv_step", "cpp_step")] == 1, dict(ran)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@needs_onednn
def test_explain_says_why_onednn_conv_is_not_taken():
    spec = (3, 3, (1, 1), (1, 1), (1, 1), 1)
    text = backends.explain("conv_int8", shape=(16 * 16 * 16, 64 * 9, 64), spec=spec, at_run_time=True, file=open(os.devnull, "w"))
    if not cpu_has_int8_dot():  # (AVX2-only x86 / INTQAT_EMULATE_NO_INT8_DOT: oneDNN's int8 conv never pays there)
        assert "no int8 dot-product units: oneDNN's int8 conv would not be faster than fp32" in text
        assert "onednn_conv RUNS IT" not in text
        return
    assert "onednn_conv RUNS IT" in text
    for shape, spec_, why in [
        ((4096, 128 * 9, 128), spec, "ONEDNN_CONV_MAX_CHANNELS"),
        ((4096, 64, 64), (1, 1, (1, 1), (0, 0), (1, 1), 1), "1x1 conv is a GEMM"),
        ((4096, 64 * 9, 64), (3, 3, (2, 2), (1, 1), (1, 1), 1), "stride > 1"),
        ((256, 64 * 9, 64), spec, "ONEDNN_CONV_MIN_M"),
        ((4096, 9, 64), (3, 3, (1, 1), (1, 1), (1, 1), 64), "grouped / depthwise"),
    ]:
        text = backends.explain("conv_int8", shape=shape, spec=spec_, at_run_time=True, file=open(os.devnull, "w"))
        assert why in text and "no backend takes it" in text, text
    with backends.use_backend("reference"):
        text = backends.explain("conv_int8", shape=(4096, 64 * 9, 64), spec=spec, at_run_time=True,
                                file=open(os.devnull, "w"))
    assert "backend reference is forced" in text


_CHILD = """
import warnings
import torch
from intqat.ops import backends
from intqat.ops.int_conv2d import int_conv2d
warnings.simplefilter("ignore")
print(backends.explain("conv_int8", shape=(4096, 64 * 9, 64), spec=(3, 3, (1, 1), (1, 1), (1, 1), 1), at_run_time=True))
with backends.use_backend("onednn_conv") if backends.unavailable("onednn_conv") is None else warnings.catch_warnings():
    int_conv2d(torch.randn(2, 8, 8, 8), torch.randn(8, 8, 3, 3), None, torch.tensor([0.05]), torch.tensor([0.0]),
               torch.full((8,), 0.01), padding=1)
print("RAN", backends.choices().get("conv_int8"))
"""


@needs_onednn
@pytest.mark.parametrize("env, why", [({"INTQAT_ONEDNN_CONV": "0"}, "switched off (INTQAT_ONEDNN_CONV=0)"),
                                      ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "ONEDNN_MAX_CPU_ISA=AVX2")],
                         ids=["switched-off", "onednn-below-vnni"])
def test_onednn_conv_refused_with_the_reason(env, why):
    """Switched off, or oneDNN held below VNNI (its int8 kernels then saturate int16 pair sums: the self-check
    refuses the conv): the reason is in explain's verdict, and no conv runs on it."""
    out = subprocess.run([sys.executable, "-c", _CHILD], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.strip().startswith("onednn_conv"))
    assert why in line and "RUNS IT" not in line, out.stdout
    assert "RAN None" in out.stdout
