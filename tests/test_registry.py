"""intqat.registry: the one table prepare_qat / to_integer / to_deployed / the census read."""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import intqat
from intqat import registry
from intqat.config import resolve_config
from intqat.convert import float_census

PACKAGE = Path(intqat.__file__).parent


def test_every_kind_goes_float_to_fake_to_integer_to_deployed():
    """Each row of the table, walked through the three swaps: the classes the table names, the same Parameters."""
    torch.manual_seed(0)
    cases = {
        "linear": (nn.Linear(16, 8), "w8a8", torch.randn(4, 16)),
        "grouped_linear": (nn.Linear(64, 8), "8da4w", torch.randn(4, 64)),
        "conv2d": (nn.Conv2d(3, 4, 3, padding=1), "w8a8", torch.randn(2, 3, 6, 6)),
        "attention": (nn.MultiheadAttention(16, 2, batch_first=True), "w8a8", torch.randn(2, 5, 16)),
        "embedding": (nn.Embedding(32, 16), {"preset": "w8a8", "embedding": {"bits": 8, "granularity": "channel"}},
                      torch.randint(0, 32, (2, 5))),
    }
    assert {k.name for k in registry.KINDS} == set(cases)
    for kind in registry.KINDS:
        layer, config, x = cases[kind.name]
        params = list(layer.parameters())
        model = nn.Sequential(layer)
        assert registry.kind_for_float(layer, resolve_config(config)) is kind
        intqat.prepare_qat(model, config)
        assert type(model[0]) is kind.fake and registry.stage(model[0]) == "fake" and registry.kind_of(model[0]) is kind
        args = (x, x, x) if kind.name == "attention" else (x,)
        intqat.calibrate(model[0], [args]) if kind.name != "attention" else model[0](*args)
        intqat.freeze_observers(model)
        intqat.to_integer(model)
        assert type(model[0]) is kind.integer and registry.stage(model[0]) == "integer"
        assert all(any(p is q for q in model.parameters()) for p in params), kind.name  # the same Parameter objects
        deployed = intqat.to_deployed(model)
        assert type(deployed[0]) is kind.deployed and registry.stage(deployed[0]) == "deployed"


def test_a_per_group_config_takes_linear_layers_and_names_what_it_cannot_group():
    cfg = resolve_config("8da4w")
    assert registry.kind_for_float(nn.Linear(64, 8), cfg).name == "grouped_linear"
    assert registry.kind_for_float(nn.Linear(64, 8), resolve_config("w8a8")).name == "linear"
    model = nn.Sequential(nn.Linear(48, 8), nn.Conv2d(3, 4, 1))  # 48: not a multiple of 32
    with pytest.warns(UserWarning) as rec:
        intqat.prepare_qat(model, cfg)
    text = str(rec[0].message)
    assert "0 (in_features 48 is not a multiple of group_size 32)" in text
    assert "1 (nn.Conv2d: per-group weights (group_size 32) are implemented for nn.Linear" in text
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Conv2d


def test_subclasses_are_named_not_converted():
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(MyLinear(4, 4))
    with pytest.warns(UserWarning, match=r"0 \(MyLinear: a subclass of nn.Linear whose forward intqat cannot vouch for\)"):
        intqat.prepare_qat(model, "w8a8")
    assert type(model[0]) is MyLinear


def test_the_census_names_float_embeddings_with_the_field_that_quantizes_them():
    """An 8da4w Llama keeps embed_tokens float by design (as torchao does); a user deploying it is told."""
    model = nn.Module()
    model.embed_tokens = nn.Embedding(64, 32)
    model.proj = nn.Linear(32, 32)
    with pytest.warns(UserWarning, match=r"embed_tokens \(nn.Embedding: QuantConfig.embedding is None") as rec:
        intqat.prepare_qat(model, "8da4w")
    assert "proj" not in str(rec[0].message)
    assert set(float_census(model)) == {"embed_tokens"}
    # with an embedding spec it is quantized and the census is empty
    model2 = nn.Module()
    model2.embed_tokens, model2.proj = nn.Embedding(64, 32), nn.Linear(32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        intqat.prepare_qat(model2, {"preset": "8da4w", "embedding": {"bits": 4, "granularity": "group", "group_size": 32}})
    assert float_census(model2) == {}


def test_recurrent_layers_are_named_as_one_float_layer():
    model = nn.Module()
    model.lstm = nn.LSTM(8, 16, num_layers=2, bidirectional=True)
    model.head = nn.Linear(32, 4)
    with pytest.warns(UserWarning, match=r"lstm \(LSTM: intqat has no integer recurrent layer"):
        intqat.prepare_qat(model, "w8a8")
    assert set(float_census(model)) == {"lstm"}


def test_on_replace_sees_every_swap_with_old_and_new():
    seen = []
    hook = registry.on_replace(lambda old, new: seen.append((type(old).__name__, type(new).__name__)))
    try:
        model = nn.Sequential(nn.Linear(8, 8))
        intqat.prepare_qat(model, "w8a8")
        intqat.calibrate(model, [torch.randn(4, 8)])
        intqat.to_integer(model)
        intqat.to_deployed(model)
    finally:
        registry._REPLACE_HOOKS.remove(hook)
    assert seen == [("Linear", "FakeQuantLinear"), ("FakeQuantLinear", "IntLinear"), ("IntLinear", "DeployedIntLinear")]


def test_foreign_fake_quant_modules_convert_through_the_registry():
    pytest.importorskip("torchao")
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    model = nn.Sequential(nn.Linear(32, 16))
    act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    quantize_(model, QATConfig(activation_config=act, weight_config=IntxFakeQuantizeConfig(torch.int8, "per_channel"),
                               step="prepare"))
    assert registry.stage(model[0]) == "foreign"
    assert any(f.name == "torchao FakeQuantizedLinear" for f in registry.FOREIGN)
    intqat.to_integer(model)
    assert registry.stage(model[0]) == "integer"


def _imports(path: Path) -> set[str]:
    """Every intqat module `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("intqat"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("intqat"))
    return found


def test_convert_interop_and_registry_import_no_cycle():
    """convert -> interop -> registry -> nn: none of them imports back up the chain, not even inside a function."""
    mods = {name: _imports(PACKAGE / f"{name}.py") for name in ("convert", "interop", "registry")}
    assert "intqat.convert" not in mods["interop"] | mods["registry"]
    assert "intqat.interop" not in mods["registry"]
    nn_files = (PACKAGE / "nn").glob("*.py")
    assert not any({"intqat.registry", "intqat.convert", "intqat.interop"} & _imports(p) for p in nn_files)
    assert "intqat.registry" in sys.modules
