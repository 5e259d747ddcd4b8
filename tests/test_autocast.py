"""intqat.autocast.convert: each rule on its own, the cast pass, integer layers, round trips,
argument errors.

Rule tests compare the report with and without one option: the option must flip exactly
the nodes it names and no other. Programs are exported once per module (export is the slow
part); convert itself takes milliseconds.
"""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from intqat.autocast import convert, default_fp32_ops, remove_redundant_casts
from intqat.autocast.casts import CAST_MARK
from intqat.autocast.reduction import reduction_extent

aten = torch.ops.aten


def _export(model, *args, **kw):
    return torch.export.export(model.eval(), args, **kw)


def _flipped(ep, **option):
    """Names of nodes whose precision differs from the default conversion."""
    base = convert(ep)[1].precisions()
    new = convert(ep, **option)[1].precisions()
    assert base.keys() == new.keys()
    return {n for n in base if base[n] != new[n]}


def _roundtrip(ep):
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


def _inserted_casts(ep):
    return [n for n in ep.graph.nodes if n.meta.get(CAST_MARK) == "cast"]


def _sqnr_db(ref, out):
    return (10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean())).item()


# ---------------------------------------------------------------------------------------
# Models


class RuleNet(nn.Module):
    """One node per rule; no widest-type op downstream of a rule's target, so flipping a
    node cannot flip its consumers, except tanh: once linear_1 is fp32, tanh sits between
    two fp32 nodes (linear_1, softmax) and stays fp32 too (isolated_elementwise)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        with torch.no_grad():
            self.fc2.weight.mul_(1e4)  # linear_1's |values| >> data_max; tanh brings them back

    def forward(self, x):  # x (B, 16)
        h = F.gelu(self.fc1(x))  # linear (K=16), gelu
        h = F.gelu(h, approximate="tanh")  # gelu_1
        h = torch.tanh(self.fc2(h))  # linear_1 (K=32), tanh
        return torch.softmax(h, -1)  # softmax (fp32_ops)


class IntLinear(nn.Module):
    """Stand-in for intqat.nn.IntLinear with the same exported structure: quantize prologue,
    _int_mm, int32 zero-point correction, fp32 epilogue."""

    def __init__(self, k, n):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("q_wT", torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g))
        self.register_buffer("w_colsum", self.q_wT.to(torch.int32).sum(0, dtype=torch.int32))  # (N,)
        self.register_buffer("inv_scale_x", torch.tensor(20.0))
        self.register_buffer("zp_x", torch.tensor(3, dtype=torch.int32))
        self.register_buffer("scale_outer", torch.rand(n, generator=g) * 1e-3)  # s_x * s_w (N,)
        self.bias = nn.Parameter(torch.randn(n, generator=g))

    def forward(self, x):  # x (M, K) fp32
        q = torch.clamp(torch.round(x * self.inv_scale_x) + self.zp_x, -128, 127).to(torch.int8)
        acc = torch._int_mm(q, self.q_wT)  # (M, N) int32
        acc = acc - self.zp_x * self.w_colsum  # zero-point correction, int32
        return acc.to(torch.float32) * self.scale_outer + self.bias


class IntNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.il = IntLinear(32, 16)
        self.head = nn.Linear(16, 8)

    def forward(self, x):  # x (32, 32): _int_mm wants M > 16
        y = self.il(x)
        return y, self.head(torch.relu(y))


class IntPairNet(nn.Module):
    """An elementwise op between two integer layers: the float epilogue of il1 and the
    quantize prologue of il2 are fp32; chain=True puts relu -> tanh there."""

    def __init__(self, chain=False):
        super().__init__()
        self.il1, self.il2 = IntLinear(32, 32), IntLinear(32, 16)
        self.chain = chain

    def forward(self, x):  # x (32, 32)
        h = torch.relu(self.il1(x))
        return self.il2(torch.tanh(h) if self.chain else h)


class FloatPairNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class MixNet(nn.Module):
    """Widest-type ops fed by low and fp32 producers."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        a, b = self.a(x), self.b(x)  # low, low
        s = torch.softmax(a, -1)  # fp32
        return a + s, torch.cat([a, b], -1), torch.cat([a, s], -1), a.to(torch.float32) * 2


class AutocastNet(nn.Module):
    def __init__(self, region):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.region = region

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.region == "disabled":
            with torch.autocast("cpu", enabled=False):
                h = self.fc2(h)
        elif self.region == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.fc2(h)
        else:
            h = self.fc2(h)
        return torch.relu(h)


@pytest.fixture(scope="module")
def x16():
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def rule_ep(x16):
    torch.manual_seed(0)
    return _export(RuleNet(), x16)


@pytest.fixture(scope="module")
def x32():
    return torch.randn(32, 32, generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def int_ep(x32):
    torch.manual_seed(0)
    return _export(IntNet(), x32)


@pytest.fixture(scope="module")
def mix_ep():
    torch.manual_seed(0)
    return _export(MixNet(), torch.randn(4, 8))


# ---------------------------------------------------------------------------------------
# Rules, one at a time


def test_default_decisions(rule_ep):
    rep = convert(rule_ep)[1]
    assert rep["linear"].precision == "bf16" and rep["linear"].rule == "default_low_precision"
    assert rep["softmax"].precision == "fp32" and rep["softmax"].rule == "fp32_ops"
    assert rep["tanh"].precision == "bf16"


def test_nodes_to_exclude(rule_ep):
    assert _flipped(rule_ep, nodes_to_exclude=["^gelu$"]) == {"gelu"}
    assert convert(rule_ep, nodes_to_exclude="^gelu$")[1]["gelu"].rule == "nodes_to_exclude"


def test_targets_to_exclude(rule_ep):
    assert _flipped(rule_ep, targets_to_exclude=[aten.tanh.default]) == {"tanh"}
    assert _flipped(rule_ep, targets_to_exclude=["aten.tanh"]) == {"tanh"}


def test_fp32_ops(rule_ep):
    assert _flipped(rule_ep, fp32_ops=[*default_fp32_ops(), "aten.tanh"]) == {"tanh"}
    assert _flipped(rule_ep, fp32_ops=()) == {"softmax"}


def test_low_precision_ops(rule_ep):
    flipped = _flipped(rule_ep, low_precision_ops=[aten.linear])
    assert flipped == {"gelu", "gelu_1", "tanh"}
    rep = convert(rule_ep, low_precision_ops=[aten.linear])[1]
    assert rep["linear"].rule == "low_precision_ops" and rep["tanh"].rule == "not_in_low_precision_ops"


def test_conditional_fp32_ops_kwarg_and_schema_default(rule_ep):
    tanh_gelu = [(aten.gelu.default, "approximate", ["tanh"])]
    assert _flipped(rule_ep, conditional_fp32_ops=tanh_gelu) == {"gelu_1"}
    # gelu(h) has no approximate kwarg in the graph: the schema default "none" applies.
    assert _flipped(rule_ep, conditional_fp32_ops=[("aten.gelu", "approximate", ("none",))]) == {"gelu"}


def test_conditional_fp32_ops_positional(rule_ep):
    base = convert(rule_ep, fp32_ops=())[1].precisions()
    new = convert(rule_ep, fp32_ops=(), conditional_fp32_ops=[(aten.softmax.int, "dim", [-1])])[1]
    assert {n for n in base if base[n] != new.precisions()[n]} == {"softmax"}
    assert new["softmax"].rule == "conditional_fp32_ops"


def test_max_depth_of_reduction(rule_ep):
    # linear reduces K=16, linear_1 K=32; softmax is already fp32.
    assert _flipped(rule_ep, max_depth_of_reduction=20) == {"linear_1", "tanh"}
    rep = convert(rule_ep, max_depth_of_reduction=20)[1]
    assert rep["linear_1"].rule == "max_depth_of_reduction" and rep["tanh"].rule == "isolated_elementwise"


def test_reduction_extents():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 6, 3, groups=2)

        def forward(self, x):
            return self.conv(x).sum((2, 3)), x.mean(-1)

    ep = _export(Net(), torch.randn(1, 4, 5, 5))
    ext = {n.name: reduction_extent(n) for n in ep.graph.nodes if n.op == "call_function"}
    assert ext["conv2d"] == 4 // 2 * 3 * 3 and ext["sum_1"] == 9 and ext["mean"] == 5


def test_data_max(rule_ep, x16):
    assert _flipped(rule_ep, calibration_data=[(x16,)]) == {"linear_1", "tanh"}  # tanh: see RuleNet
    rep = convert(rule_ep, calibration_data=[(x16,)])[1]
    assert rep["linear_1"].rule == "data_max" and rep["tanh"].rule == "isolated_elementwise"
    assert _flipped(rule_ep, calibration_data=[(x16,)], data_max=1e9) == set()


def test_data_max_accepts_dataloader_and_tensors(rule_ep, x16):
    ds = torch.utils.data.TensorDataset(x16, torch.zeros(len(x16)))
    loader = torch.utils.data.DataLoader(ds, batch_size=len(x16))  # yields [x, label]
    assert _flipped(rule_ep, calibration_data=loader) == {"linear_1", "tanh"}
    assert _flipped(rule_ep, calibration_data=[x16]) == {"linear_1", "tanh"}
    assert _flipped(rule_ep, calibration_data=[{"x": x16}]) == {"linear_1", "tanh"}


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch's own, in run_decompositions
def test_autocast_disabled_region_stays_fp32():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    plain = convert(_export(AutocastNet(None), x))[1]
    ep = _export(AutocastNet("disabled"), x)
    assert any(n.target is torch.ops.higher_order.wrap_with_autocast for n in ep.graph.nodes)
    conv, rep = convert(ep)
    hop = [n for n in rep.nodes if n.op == "higher_order.wrap_with_autocast"]
    assert len(hop) == 1 and (hop[0].precision, hop[0].rule) == ("fp32", "autocast_region")
    inner = [n for n in rep.nodes if n.name.startswith(hop[0].name + "/")]
    assert [n.op for n in inner] == ["aten.linear.default"] and inner[0].precision == "fp32"
    assert plain["linear_1"].precision == "bf16"  # the same layer outside the region
    outside = {n.name: n.precision for n in rep.nodes if n.op != "higher_order.wrap_with_autocast"
               and "/" not in n.name}
    # relu_1 reads the fp32 region and feeds the fp32 output: low would only add casts.
    assert outside == {"linear": "bf16", "relu": "bf16", "relu_1": "fp32"}
    assert rep["relu_1"].rule == "isolated_elementwise"
    torch.testing.assert_close(conv.module()(x), ep.module()(x), atol=0.05, rtol=0.05)
    assert torch.equal(_roundtrip(conv).module()(x), conv.module()(x))  # the HOP serialises
    # After run_decompositions the region is inlined; provenance still marks its nodes.
    rep_d = convert(ep.run_decompositions())[1]
    assert {n.rule for n in rep_d.nodes if n.op == "aten.addmm.default"} == {"default_low_precision",
                                                                             "autocast_region"}


def test_autocast_enabled_region_is_left_to_autocast():
    ep = _export(AutocastNet("bf16"), torch.randn(4, 8))
    hop = [n for n in convert(ep)[1].nodes if n.op == "higher_order.wrap_with_autocast"]
    assert (hop[0].precision, hop[0].rule) == ("unchanged", "autocast_region")


@torch.library.custom_op("intqat_autocast_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_custom_ops_stay_fp32_unless_listed():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(_twice(self.fc(x)))

    ep = _export(Net(), torch.randn(2, 8))
    rep = convert(ep)[1]
    assert (rep["twice"].precision, rep["twice"].rule) == ("fp32", "custom_op")
    assert (rep["relu"].precision, rep["relu"].rule) == ("fp32", "isolated_elementwise")  # fp32 -> relu -> out
    assert _flipped(ep, low_precision_ops=[torch.ops.intqat_autocast_test.twice, aten.linear, aten.relu]) \
        == {"twice", "relu"}


def test_converting_twice_changes_nothing(mix_ep):
    once, _ = convert(mix_ep)
    twice, rep = convert(once)
    assert rep.casts_inserted == 0 and rep.cast_params == [] and "bf16" not in rep.counts()
    x = torch.randn(4, 8)
    for a, b in zip(once.module()(x), twice.module()(x)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# Integer layers


def test_integer_nodes_untouched_and_layer_output_exact(int_ep, x32):
    conv, rep = convert(int_ep)
    for name in ("to", "_int_mm", "mul_1", "sub", "to_1"):
        assert rep[name].precision == "unchanged" and rep[name].rule == "integer_op"
    for name in ("mul", "round_1", "clamp", "mul_2", "add_1"):  # prologue and epilogue
        assert rep[name].precision == "fp32" and rep[name].rule == "integer_layer"
    assert rep["linear"].precision == "bf16"
    old = {n.name: n for n in int_ep.graph.nodes}
    for n in conv.graph.nodes:
        if n.name in ("to", "_int_mm", "mul_1", "sub", "to_1", "mul", "mul_2", "add_1"):
            assert n.target == old[n.name].target
            assert [str(a) for a in n.args] == [str(a) for a in old[n.name].args]
    y_ref, _ = int_ep.module()(x32)
    y, out = conv.module()(x32)
    assert torch.equal(y, y_ref) and y.dtype == torch.float32 and out.dtype == torch.float32
    assert "il.bias" not in rep.cast_params and "il.scale_outer" not in rep.cast_params
    assert conv.state_dict["il.q_wT"].dtype == torch.int8


def test_integer_module_types_rule(int_ep):
    # Without the rule the layer's float ops are still fp32 here (fp32 inputs, widest_type
    # and isolated_elementwise), so compare the rules as well as the precisions.
    base = convert(int_ep)[1]
    new = convert(int_ep, integer_module_types=())[1]
    changed = {n.name for n in base.nodes if (n.precision, n.rule) != (new[n.name].precision, new[n.name].rule)}
    assert changed and all(base[n].rule == "integer_layer" for n in changed)


def test_integer_module_types_match_type_name_suffix(x32):
    class DeployedIntLinear(IntLinear):  # intqat exports this name: "IntLinear" must cover it
        pass

    ep = _export(DeployedIntLinear(32, 16), x32)
    assert convert(ep)[1]["add_1"].rule == "integer_layer"
    assert convert(ep, integer_module_types=["Conv"])[1]["add_1"].rule != "integer_layer"


def test_elementwise_between_integer_layers_stays_fp32(x32):
    torch.manual_seed(0)
    ep = _export(IntPairNet(), x32)
    conv, rep = convert(ep)
    assert (rep["relu"].precision, rep["relu"].rule) == ("fp32", "isolated_elementwise")
    assert rep.casts_inserted == 0 and _inserted_casts(conv) == []
    assert "bf16" not in rep.counts()
    assert torch.equal(conv.module()(x32), ep.module()(x32))
    # Iterated to a fixed point: a chain between the two layers stays fp32 as a whole.
    chain_ep = _export(IntPairNet(chain=True), x32)
    chain_conv, chain_rep = convert(chain_ep)
    assert {chain_rep[n].rule for n in ("relu", "tanh")} == {"isolated_elementwise"}
    assert chain_rep.casts_inserted == 0
    assert torch.equal(chain_conv.module()(x32), chain_ep.module()(x32))


def test_elementwise_next_to_a_low_op_still_goes_low(int_ep, x32):
    rep = convert(_export(FloatPairNet(), x32))[1]  # relu between two float linears
    assert (rep["relu"].precision, rep["relu"].rule) == ("bf16", "default_low_precision")
    rep = convert(int_ep)[1]  # integer layer -> relu -> float linear: the consumer is low
    assert (rep["relu"].precision, rep["relu"].rule) == ("bf16", "default_low_precision")
    # The user's low_precision_ops wins over the rule.
    rep = convert(_export(IntPairNet(), x32), low_precision_ops=[aten.relu])[1]
    assert (rep["relu"].precision, rep["relu"].rule) == ("bf16", "low_precision_ops")


# ---------------------------------------------------------------------------------------
# Cast pass


def test_widest_type_on_add_and_cat(mix_ep):
    rep = convert(mix_ep)[1]
    assert (rep["add"].precision, rep["add"].rule) == ("fp32", "widest_type")  # bf16 + fp32
    assert (rep["cat"].precision, rep["cat_1"].precision) == ("bf16", "fp32")
    assert rep["to"].rule == "explicit_cast"


def test_casts_deduplicated_and_no_chains(mix_ep, int_ep, rule_ep):
    for ep in (mix_ep, int_ep, rule_ep):
        conv, rep = convert(ep)
        casts = _inserted_casts(conv)
        assert len(casts) == rep.casts_inserted > 0
        keys = [(c.args[0], c.kwargs["dtype"]) for c in casts]
        assert len(keys) == len(set(keys)), "one cast per (value, dtype)"
        for c in casts:
            src = c.args[0]
            assert not (src.op == "call_function" and src.target in (aten._to_copy.default, aten.to.dtype)
                        and src.args[0].meta["val"].dtype == c.kwargs["dtype"]), f"round trip at {c}"
            assert src.meta["val"].dtype != c.kwargs["dtype"]


def test_remove_redundant_casts_collapses_chains():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, dtype=torch.float32)

    def cast(src, dtype, inserted=True):
        n = g.call_function(aten._to_copy.default, (src,), {"dtype": dtype})
        n.meta["val"] = torch.empty(2, dtype=dtype)
        if inserted:
            n.meta[CAST_MARK] = "cast"
        return n

    b = cast(x, torch.bfloat16)
    back = cast(b, torch.float32)  # fp32 -> bf16 -> fp32: x itself
    half = cast(b, torch.float16)  # fp32 -> bf16 -> fp16: one cast from x
    user_b = cast(x, torch.bfloat16, inserted=False)  # the model's own rounding: kept
    widened = cast(user_b, torch.float32, inserted=False)
    narrowed = cast(widened, torch.bfloat16)  # exact round trip through the user's cast
    g.output((g.call_function(aten.relu.default, (back,)), half, narrowed))
    remove_redundant_casts(g)
    relu, half2, narrowed2 = next(n for n in g.nodes if n.op == "output").args[0]
    assert relu.args[0] is x
    assert half2.args[0] is x and half2.kwargs["dtype"] == torch.float16
    assert narrowed2 is user_b
    assert b not in g.nodes and user_b in g.nodes


def test_io_dtypes_preserved_and_accuracy(rule_ep, x16):
    conv, _ = convert(rule_ep)
    ins = [n for n in conv.graph.nodes if n.op == "placeholder" and n.name == "x"]
    assert ins[0].meta["val"].dtype == torch.float32
    ref, out = rule_ep.module()(x16), conv.module()(x16)
    assert out.dtype == ref.dtype == torch.float32 and out.shape == ref.shape
    mix = MixNet().eval()
    x = torch.randn(4, 8)
    outs = convert(_export(mix, x))[0].module()(x)
    for r, o in zip(mix(x), outs):
        assert o.dtype == torch.float32 and _sqnr_db(r, o) >= 25


def test_cast_optional_params_shrinks_storage(rule_ep):
    on, rep_on = convert(rule_ep)
    off, rep_off = convert(rule_ep, cast_optional_params=False)
    assert {on.state_dict[k].dtype for k in ("fc1.weight", "fc2.weight", "fc2.bias")} == {torch.bfloat16}
    assert isinstance(on.state_dict["fc1.weight"], nn.Parameter)
    assert {v.dtype for v in off.state_dict.values()} == {torch.float32}
    assert rep_on.stored_bytes_after < rep_on.stored_bytes_before == rep_off.stored_bytes_after
    assert sorted(rep_on.cast_params) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert {v.dtype for v in rule_ep.state_dict.values()} == {torch.float32}, "input program untouched"


def test_in_place_buffer_update_keeps_fp32():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen.add_(1)
            return self.fc(x) * self.seen

    conv, rep = convert(_export(Counter(), torch.randn(2, 4)))
    assert conv.state_dict["seen"].dtype == torch.float32 and rep["add_"].rule == "in_place_op"


def test_dynamic_batch_save_load_roundtrip(rule_ep):
    torch.manual_seed(0)
    model = RuleNet()
    ep = _export(model, torch.randn(4, 16), dynamic_shapes=({0: Dim("B", min=2, max=64)},))
    conv, _ = convert(ep, low_precision_type=torch.float16)
    x = torch.randn(9, 16)
    out = conv.module()(x)
    loaded = _roundtrip(conv)
    assert torch.equal(loaded.module()(x), out)
    assert loaded.state_dict["fc1.weight"].dtype == torch.float16


def test_save_load_roundtrip_with_integer_layer(int_ep, x32):
    conv, _ = convert(int_ep)
    loaded = _roundtrip(conv)
    for a, b in zip(conv.module()(x32), loaded.module()(x32)):
        assert torch.equal(a, b)


def test_sequential_input_named_like_a_builtin(x16):
    # nn.Sequential's forward(input): a fresh fx.Graph renames that placeholder, and the
    # input specs must follow it or the verifier rejects the program.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    ep = _export(model, x16)
    assert "input" in [n.name for n in ep.graph.nodes if n.op == "placeholder"]
    conv, rep = convert(ep)
    placeholders = [n.name for n in conv.graph.nodes if n.op == "placeholder"]
    assert [s.arg.name for s in conv.graph_signature.input_specs] == placeholders
    assert rep["relu"].precision == "bf16" and rep.casts_inserted > 0
    out = conv.module()(x16)
    assert out.dtype == torch.float32 and _sqnr_db(model(x16), out) >= 25
    assert torch.equal(_roundtrip(conv).module()(x16), out)


def test_builtin_named_input_does_not_rename_other_nodes():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, input, input_1):  # fx would rename input to input_1, taken
            return self.fc(input) + input_1

    torch.manual_seed(0)
    model = Net().eval()
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    ep = _export(model, a, b)
    conv, _ = convert(ep)
    kept = [n.name for n in conv.graph.nodes if n.meta.get(CAST_MARK) != "cast"]
    renamed = [old.name for old, new in zip(ep.graph.nodes, kept) if old.name != new]
    assert renamed == ["input"], "input_1 and every other node keep their names"
    placeholders = [n.name for n in conv.graph.nodes if n.op == "placeholder"]
    assert [s.arg.name for s in conv.graph_signature.input_specs] == placeholders
    out = conv.module()(a, b)
    assert _sqnr_db(model(a, b), out) >= 25
    assert torch.equal(_roundtrip(conv).module()(a, b), out)


def test_report_serialises(int_ep):
    import json

    rep = convert(int_ep)[1]
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["low_precision_type"] == "bf16" and d["nodes"][0].keys() == {"name", "op", "precision", "rule"}
    md = rep.to_markdown().splitlines()
    assert md[0] == "| name | op | precision | rule |" and len(md) == len(rep.nodes) + 2


# ---------------------------------------------------------------------------------------
# Argument errors


def test_rejects_non_exported_program():
    with pytest.raises(TypeError, match="ExportedProgram"):
        convert(nn.Linear(2, 2))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(low_precision_type=torch.int8), ValueError, "low_precision_type"),
    (dict(conditional_fp32_ops=[("aten.gelu", "approximate")]), ValueError, r"conditional_fp32_ops\[0\]"),
    (dict(conditional_fp32_ops=[("aten.gelu", "approx", ["tanh"])]), ValueError, "no argument 'approx'"),
    (dict(conditional_fp32_ops=("aten.gelu", "approximate", ["tanh"])), ValueError, "wrap it in a list"),
    (dict(conditional_fp32_ops=[("aten.gelu", "approximate", "tanh")]), ValueError, "values must be a list"),
    (dict(nodes_to_exclude=["linear("]), ValueError, "nodes_to_exclude: bad regex"),
    (dict(targets_to_exclude=["aten.not_an_op"]), ValueError, "unknown op"),
    (dict(fp32_ops=[torch.softmax]), ValueError, "fp32_ops"),
    (dict(data_max=-1.0), ValueError, "data_max"),
    (dict(max_depth_of_reduction=0), ValueError, "max_depth_of_reduction"),
    (dict(calibration_data=torch.randn(4, 16)), TypeError, "calibration_data"),
    (dict(calibration_data=[]), ValueError, "calibration_data is empty"),
])
def test_bad_arguments(rule_ep, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        convert(rule_ep, **kwargs)
