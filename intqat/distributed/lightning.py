"""Lightning with FSDP2: a ModelParallelStrategy that shards a LightningModule which does not shard itself,
and the distributed-checkpoint step IntQAT needs on resume.

    from lightning import Trainer
    from intqat import IntQAT
    from intqat.distributed.lightning import FullyShardStrategy

    trainer = Trainer(accelerator="cpu", devices=2, strategy=FullyShardStrategy(),
                      callbacks=[IntQAT("w8a8", prepare_at=1, freeze_observers_at=3, integer_at=4)])

Lightning's ModelParallelStrategy runs FSDP2 but leaves the sharding to the module's `configure_model`
(and refuses a module without one). `FullyShardStrategy` is that strategy with a default: a module that
defines configure_model shards itself as before; any other gets `fully_shard` on each member of its
nn.Sequential / nn.ModuleList containers (an MLP's layers, a transformer's blocks: one FSDP group
each), then on each child of the LightningModule holding Parameters (its `model`, the root). So the
recipes' modules (intqat.training) run under FSDP2 unchanged: `intqat-train trainer=fsdp_cpu`.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

__all__ = ["FullyShardStrategy", "shard_module", "is_sharded_checkpoint", "reload_sharded_state", "unsharded_copy"]


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def shard_module(module: nn.Module, mesh=None) -> list[str]:
    """fully_shard on each member of the outermost nn.Sequential / nn.ModuleList containers under `module`
    (members holding Parameters), then on each direct child of `module` holding Parameters. Modules already
    sharded are left alone (Lightning calls this at every fit / validate / test). Returns the fqns sharded."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    done: list[str] = []

    def shard(m: nn.Module, fqn: str) -> None:
        if not isinstance(m, FSDPModule) and _has_params(m):
            fully_shard(m, mesh=mesh)
            done.append(fqn)

    def units(m: nn.Module, prefix: str) -> None:  # bottom-up: members before the containers' owners
        for name, child in m.named_children():
            fqn = f"{prefix}{name}"
            if isinstance(child, (nn.Sequential, nn.ModuleList)):
                for member_name, member in child.named_children():
                    shard(member, f"{fqn}.{member_name}")
            else:
                units(child, f"{fqn}.")

    units(module, "")
    for name, child in module.named_children():
        shard(child, name)
    return done


class FullyShardStrategy(ModelParallelStrategy):
    """ModelParallelStrategy for data-parallel FSDP2: tensor_parallel_size=1, and data_parallel_size "auto" is
    every process (not every node). A module that has no `configure_model` is sharded with `shard_module`.
    Arguments: ModelParallelStrategy's."""

    def __init__(self, data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, **kwargs):
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, **kwargs)

    @override
    def setup_environment(self) -> None:
        # "auto": every process shards the model (ModelParallelStrategy's "auto" is one shard per node)
        if self._data_parallel_size == "auto" and self._tensor_parallel_size != "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes // self._tensor_parallel_size
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if is_overridden("configure_model", module):
            return super().setup(trainer)
        shard_module(module, self.device_mesh["data_parallel"])
        # ModelParallelStrategy.setup (Lightning 2.6) from here on, without its demand for configure_model
        from lightning.fabric.utilities.init import _materialize_distributed_module
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)


def is_sharded_checkpoint(path) -> bool:
    """A distributed checkpoint (the directory ModelParallelStrategy saves: one shard file per rank)."""
    from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint

    return path is not None and _is_sharded_checkpoint(Path(path))


def reload_sharded_state(trainer: pl.Trainer, path) -> None:
    """Load the model's state from distributed checkpoint `path` again, as ModelParallelStrategy.load_checkpoint
    does. It loaded before the callbacks ran, into the keys the model had then: after IntQAT gave the model
    the checkpoint's quantized layers, their quantizers' state (scales, observed ranges) loads here."""
    from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = trainer.strategy.model
    state = {"state_dict": get_model_state_dict(model)}
    _distributed_checkpoint_load(state, Path(path))
    model.load_state_dict(state["state_dict"], strict=trainer.lightning_module.strict_loading)


def unsharded_copy(pl_module: pl.LightningModule, rank: int) -> pl.LightningModule | None:
    """An unsharded copy of a sharded LightningModule, for what needs the whole model in one process (IntQAT's
    export at the end of training: FSDP2 modules refuse deepcopy). Every rank runs it (the whole tensors are
    all-gathered); rank 0 gets the copy, built as load_from_checkpoint builds a module (`cls(**hparams)`),
    with the quantized layers of the original (intqat.checkpoint) and its state; the others get None.
    Raises TypeError on rank 0 when the class cannot be built from its hyper-parameters."""
    from torch.distributed.tensor import DTensor

    from intqat.checkpoint import restore_quant_structure, save_quant_structure

    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in pl_module.state_dict().items()}
    if rank != 0:
        return None
    record: dict = {}
    save_quant_structure(pl_module, record)
    try:
        copy = type(pl_module)(**pl_module.hparams)
    except TypeError as e:
        raise TypeError(f"{type(pl_module).__name__}(**hparams) failed ({e}): call self.save_hyperparameters() with "
                        "every argument __init__ needs") from None
    restore_quant_structure(copy, record)
    copy.load_state_dict(full)
    return copy
