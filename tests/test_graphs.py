"""intqat.graphs: capture, hashing, dedupe, summary and compiled-vs-eager validation.

Most validate() calls use backend="aot_eager" (same dynamo + aot_autograd path, no codegen);
one test pays for an inductor compile.
"""

import itertools
import json

import pytest
import torch
from torch import nn

from intqat.graphs import compare, dedupe, extract, save_groups, validate

# ---------------------------------------------------------------------------------------
# A stand-in for an intqat integer op: int8 codes and an int32 matmul inside one opaque
# custom op, the codes returned so the backward (straight-through, fp32) can reuse them.


@torch.library.custom_op("intqat_test::int_linear", mutates_args=())
def int_linear(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # per-tensor symmetric int8: q = round(v / s), s = max|v| / 127
    sx = x.abs().amax().clamp(min=1e-8) / 127
    sw = w.abs().amax().clamp(min=1e-8) / 127
    xq = torch.round(x / sx).clamp(-127, 127).to(torch.int8)
    wq = torch.round(w / sw).clamp(-127, 127).to(torch.int8)
    acc = torch.mm(xq.to(torch.int32), wq.to(torch.int32).t())  # (M, N) int32
    return acc.to(torch.float32) * (sx * sw), xq, wq


@int_linear.register_fake
def _(x, w):
    return (x.new_empty(x.shape[0], w.shape[0]), torch.empty_like(x, dtype=torch.int8),
            torch.empty_like(w, dtype=torch.int8))


def _int_linear_setup(ctx, inputs, output):
    _, xq, wq = output
    ctx.save_for_backward(xq, wq)


def _int_linear_backward(ctx, grad_y, _grad_xq, _grad_wq):
    # STE: grad_x = grad_y @ W_q, grad_w = grad_y^T @ X_q (codes as fp32, scales dropped)
    xq, wq = ctx.saved_tensors
    return grad_y @ wq.to(torch.float32), grad_y.t() @ xq.to(torch.float32)


int_linear.register_autograd(_int_linear_backward, setup_context=_int_linear_setup)


# An STE whose backward is itself a registered op, as an intqat *_backward kernel would be.
@torch.library.custom_op("intqat_test::ste_round", mutates_args=())
def ste_round(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)


@torch.library.custom_op("intqat_test::ste_round_backward", mutates_args=())
def ste_round_backward(grad: torch.Tensor) -> torch.Tensor:
    return grad.clone()  # d round(x) / dx := 1


ste_round.register_fake(torch.empty_like)
ste_round_backward.register_fake(torch.empty_like)
ste_round.register_autograd(lambda ctx, grad: ste_round_backward(grad))


class IntMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.w2 = nn.Parameter(torch.randn(4, 8) / 8**0.5)

    def forward(self, x):
        return int_linear(torch.relu(self.fc1(x)), self.w2)[0]


class ConvBNMLP(nn.Module):
    """Nested output on purpose: validate must compare every level."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        y = self.fc(h)
        return y, [h, {"twice": y * 2}]


def _conv_bn_mlp():
    torch.manual_seed(0)
    model = ConvBNMLP()
    # Non-trivial running stats, so an eval capture that used batch stats would show.
    model.bn.running_mean.fill_(0.5)
    model.bn.running_var.fill_(2.0)
    return model, (torch.randn(2, 1, 6, 6),)


def _graph_ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# ---------------------------------------------------------------------------------------
# extract


def test_extract_writes_forward_backward_and_hash(tmp_path):
    model, inputs = _conv_bn_mlp()
    capture = extract(model, inputs, out_dir=tmp_path)
    assert (tmp_path / "forward.py").read_text() == capture.forward_code
    assert (tmp_path / "backward.py").read_text() == capture.backward_code
    assert (tmp_path / "graph_hash.txt").read_text().strip() == capture.graph_hash
    assert json.loads((tmp_path / "summary.json").read_text())["saved_bytes"] == capture.summary.saved_bytes
    assert torch.ops.aten.convolution_backward.default in _graph_ops(capture.backward)
    assert torch.ops.aten.native_batch_norm_backward.default in _graph_ops(capture.backward)


def test_extract_leaves_caller_model_and_inputs_alone():
    model, inputs = _conv_bn_mlp()
    model.train()
    before = inputs[0].clone()
    extract(model, inputs)
    assert model.training
    assert torch.equal(inputs[0], before)
    assert all(p.grad is None for p in model.parameters())


def test_eval_capture_uses_running_stats_and_never_differentiates_buffers():
    model, inputs = _conv_bn_mlp()
    capture = extract(model, inputs)
    assert torch.ops.aten._native_batch_norm_legit_no_training.default in _graph_ops(capture.forward)
    # The backward returns one gradient per forward input, None where none is needed.
    (out,) = [n for n in capture.backward.graph.nodes if n.op == "output"]
    grads = dict(zip(capture.regions[0].input_labels, out.args[0]))
    assert {label for label, g in grads.items() if g is not None} == {
        f"param:{name}" for name, _ in model.named_parameters()
    }
    assert not capture.summary.integer_grads


def test_extract_rejects_a_buffer_that_requires_grad():
    model, inputs = _conv_bn_mlp()
    model.bn.running_mean.requires_grad_(True)
    with pytest.raises(ValueError, match="bn.running_mean"):
        extract(model, inputs)


def test_hash_stable_across_extractions_and_identical_layers():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)  # different weights, same graph
    x = torch.randn(4, 8)
    first, again = extract(a, (x,)), extract(a, (x,))
    assert first.graph_hash == again.graph_hash
    assert first.forward_code == again.forward_code
    assert extract(b, (torch.randn(4, 8),)).graph_hash == first.graph_hash
    assert extract(nn.Linear(8, 4), (x,)).graph_hash != first.graph_hash  # other shape
    assert extract(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (x,)).graph_hash != first.graph_hash


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def test_graph_break_gives_one_region_each(tmp_path):
    x = torch.randn(3, 4)
    capture = extract(Broken(), (x,), out_dir=tmp_path)
    # model.forward before and after the break, then the loss (the rest of the step)
    assert capture.summary.regions == len(capture.regions) == 3
    assert all(r.backward is not None for r in capture.regions)
    assert "# region 2 of 3" in (tmp_path / "backward.py").read_text()
    with pytest.raises(ValueError, match="3 regions"):
        capture.forward
    assert extract(Broken(), (x,)).graph_hash == capture.graph_hash


def test_dedupe_writes_one_directory_per_distinct_graph(tmp_path):
    x = torch.randn(4, 8)
    captures = {name: extract(layer, (x,)) for name, layer in
                [("block0", nn.Linear(8, 8)), ("head", nn.Linear(8, 2)), ("block1", nn.Linear(8, 8))]}
    groups = dedupe(captures)
    assert [g.names for g in groups] == [["block0", "block1"], ["head"]]
    dirs = save_groups(groups, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(d.name for d in dirs)
    assert (dirs[0] / "members.txt").read_text().split() == ["block0", "block1"]
    assert (dirs[0] / "graph_hash.txt").read_text().strip() == groups[0].graph_hash


def test_saved_tensors_report_dtype_shape_and_bytes():
    # Only grad_W = grad_y^T @ x needs a saved value: x itself, 5*4 fp32 = 80 bytes.
    capture = extract(nn.Linear(4, 3, bias=False), (torch.randn(5, 4),))
    (saved,) = capture.summary.saved
    assert (saved.dtype, saved.shape, saved.bytes, saved.source) == ("float32", (5, 4), 80, "input[0]")

    model, inputs = _conv_bn_mlp()
    summary = extract(model, inputs).summary
    for s in summary.saved:
        itemsize = torch.empty((), dtype=getattr(torch, s.dtype)).element_size()
        assert s.bytes == itemsize * torch.Size(s.shape).numel()
    assert summary.saved_bytes == sum(s.bytes for s in summary.saved) > 0
    relu = [s for s in summary.saved if s.source == "activation:aten.relu"]
    assert relu and relu[0].bytes == 2 * 2 * 4 * 4 * 4  # (N, C, H, W) fp32
    assert summary.activation_bytes == sum(s.bytes for s in summary.saved if s.source.startswith("activation:"))
    assert summary.activation_bytes < summary.saved_bytes  # conv.weight, the input, ... are saved too


def test_float_model_has_no_integer_ops():
    # BatchNorm's int64 num_batches_tracked is a counter, not integer arithmetic.
    model, inputs = _conv_bn_mlp()
    summary = extract(model, inputs).summary
    assert summary.integer_ops == [] and not summary.has_ste_backward


def test_custom_op_is_one_opaque_integer_node_with_ste_backward():
    torch.manual_seed(0)
    capture = extract(IntMLP(), (torch.randn(4, 8),), int_namespaces=("intqat_test",))
    fw_ops = _graph_ops(capture.forward)
    assert fw_ops.count(torch.ops.intqat_test.int_linear.default) == 1
    # Its int8 quantization and int32 matmul stay inside the node.
    assert not {torch.ops.aten.round.default, torch.ops.aten.mm.default} & set(fw_ops)

    summary = capture.summary
    (fw_int_op,) = [op for op in summary.integer_ops if op.graph == "forward"]
    assert (fw_int_op.target, fw_int_op.reason) == ("intqat_test.int_linear.default", "namespace")
    assert "int8" in fw_int_op.dtypes
    assert summary.has_ste_backward and all(k.codes for k in summary.ste_kernels)
    assert summary.integer_grads == []
    saved_codes = [s for s in summary.saved if s.dtype == "int8"]
    assert saved_codes and all(s.bytes == torch.Size(s.shape).numel() for s in saved_codes)

    # Outside the namespace the int8 outputs alone still flag it.
    default_ns = extract(IntMLP(), (torch.randn(4, 8),)).summary
    assert [op.reason for op in default_ns.integer_ops if op.graph == "forward"] == ["dtype"]


def test_registered_backward_op_counts_as_ste_kernel():
    class Rounded(nn.Linear):
        def forward(self, x):
            return ste_round(super().forward(x))

    summary = extract(Rounded(4, 3), (torch.randn(2, 4),), int_namespaces=("intqat_test",)).summary
    assert [(k.target, k.codes) for k in summary.ste_kernels] == [("intqat_test.ste_round_backward.default", ())]


def test_intqat_integer_layers_show_int_linear_and_its_ste_backward():
    from intqat.convert import to_integer

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = to_integer(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), calibration_data=[(x,)])
    summary = extract(model, (x,), train=True).summary  # IntLinear runs the op in training only
    assert [op.target for op in summary.integer_ops if op.reason == "namespace"] == ["intqat.int_linear.default"] * 2
    assert summary.has_ste_backward and not summary.integer_grads
    assert any(s.dtype == "int8" for s in summary.saved)


# ---------------------------------------------------------------------------------------
# compare


def test_compare_checks_every_level_of_nested_outputs():
    t = torch.ones(2)
    expected = (t, [t, {"a": t, "codes": torch.tensor([1, 2], dtype=torch.int8)}])
    assert all(d.within_tol for d in compare(expected, expected, 0, 0, "out").values())

    deep_change = (t, [t, {"a": t + 1e-3, "codes": expected[1][1]["codes"]}])
    bad = {p for p, d in compare(deep_change, expected, 1e-5, 1e-5, "out").items() if not d.within_tol}
    assert bad == {"out[1][1]['a']"}

    as_list = [t, [t, {"a": t, "codes": expected[1][1]["codes"]}]]
    diffs = compare(as_list, expected, 0, 0, "out")
    assert diffs["out"].mismatch and all(d.within_tol for p, d in diffs.items() if p != "out")

    missing_key = (t, [t, {"a": t}])
    assert not compare(missing_key, expected, 0, 0, "out")["out[1][1]['codes']"].within_tol


def test_compare_integer_tensors_exactly():
    a, b = torch.tensor([3, 4], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    (diff,) = compare(a, b, rtol=1.0, atol=10.0).values()
    assert not diff.within_tol and diff.max_abs == 1.0
    (diff,) = compare(a, a.to(torch.int64), 1.0, 10.0).values()
    assert diff.mismatch.startswith("dtype")


# ---------------------------------------------------------------------------------------
# validate


def test_validate_passes_deterministic_model_without_false_alarms():
    model, inputs = _conv_bn_mlp()
    result = validate(model, inputs, trials=3, backend="aot_eager")
    assert result.passed and result.trial_status == ["pass"] * 3, result.to_table()
    names = {t.name for t in result.tensors}
    assert {"output[0]", "output[1][0]", "output[1][1]['twice']", "loss", "grad.conv.weight",
            "grad.bn.weight", "buffer.bn.running_mean"} <= names
    assert "output[1][1]['twice']" in result.to_table()


def test_validate_train_mode_compares_updated_batchnorm_stats():
    model, inputs = _conv_bn_mlp()
    result = validate(model, inputs, trials=2, backend="aot_eager", train=True)
    assert result.passed, result.to_table()


def _scale_outputs(gm, example_inputs):
    """A deliberately wrong backend: every floating output 1% too large."""
    def run(*args):
        return [o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in gm(*args)]
    return run


def test_validate_fails_a_wrong_compiled_path():
    model, inputs = _conv_bn_mlp()
    result = validate(model, inputs, trials=2, backend=_scale_outputs)
    assert not result.passed and result.trial_status == ["fail", "fail"]
    by_name = {t.name: t for t in result.tensors}
    assert by_name["output[1][1]['twice']"].status == "fail"
    assert by_name["grad.fc.weight"].max_rel == pytest.approx(0.01, rel=1e-3)

    # An explicit fluctuation threshold above the error makes it noise, not failure.
    tolerant = validate(model, inputs, trials=1, backend=_scale_outputs, fluctuation_threshold=1.0)
    assert tolerant.passed and tolerant.trial_status == ["fluctuation"], tolerant.to_table()


def _broken_backend(gm, example_inputs):
    raise RuntimeError("backend exploded")


def test_validate_reports_a_compile_error():
    model, inputs = _conv_bn_mlp()
    result = validate(model, inputs, trials=3, backend=_broken_backend)
    assert not result.passed and result.trial_status == ["error"]
    assert "backend exploded" in result.to_table()


NOISE = 1e-3
_noise_calls = itertools.count()


@torch.compiler.disable
def _alternating_noise(like):
    # Nondeterminism of known size that torch.manual_seed cannot reset: +NOISE, -NOISE, ...
    return torch.full_like(like, NOISE if next(_noise_calls) % 2 == 0 else -NOISE)


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = self.fc(x)
        return y + _alternating_noise(y)


def test_validate_calls_differences_within_eager_noise_fluctuation():
    global _noise_calls
    _noise_calls = itertools.count()  # eager reference on +NOISE
    torch.manual_seed(0)
    model, inputs = Noisy(), (torch.randn(3, 4),)
    # Eager runs 1 and 2 differ by 2*NOISE; the two trials land on the same and on the
    # opposite sign as the eager reference.
    result = validate(model, inputs, trials=2, backend="aot_eager")
    assert result.passed and result.trial_status == ["pass", "fluctuation"], result.to_table()
    (out,) = [t for t in result.tensors if t.name == "output"]
    assert out.eager_fluctuation == pytest.approx(2 * NOISE, rel=1e-4)
    assert out.status == "fluctuation"

    # A real error far beyond the noise is still a failure.
    result = validate(model, inputs, trials=2, backend=_scale_outputs)
    assert not result.passed and "fail" in result.trial_status


def test_validate_inductor_on_custom_int_op():
    torch.manual_seed(0)
    result = validate(IntMLP(), (torch.randn(4, 8),), trials=2, backend="inductor")
    assert result.passed and result.status == "pass", result.to_table()


def test_validate_inductor_on_intqat_integer_conv_and_linear():
    """intqat's own integer layers under inductor: a conv (BatchNorm folded) -> linear model's training step
    compiles as one graph (fullgraph) and gives eager's output, loss and every gradient within 1e-5 (the
    integer GEMMs sit in opaque custom ops; inductor may reorder only the float epilogue and grad_b's sum).
    The same property at benchmark sizes, MLP and CNN: `intqat-bench compile` (its quick run is a slow test)."""
    import intqat

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    x = torch.randn(4, 3, 8, 8)
    intqat.prepare_qat(model, "w8a8")
    intqat.calibrate(model, [x])
    intqat.freeze_observers(model)
    intqat.freeze_bn_stats(model)
    intqat.to_integer(model)
    assert {type(m).__name__ for m in model.modules()} >= {"IntConv2d", "IntLinear"}
    result = validate(model, (x,), trials=1, backend="inductor", train=True, fullgraph=True)
    assert result.passed and result.status == "pass", result.to_table()
