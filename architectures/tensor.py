"""Tensor parallel with DTensor's `parallelize_module` (Megatron-style column/row pairs).

MLP: hidden layers are paired, the first of a pair column-parallel and the second row-parallel,
so each pair needs one all-reduce; an unpaired last layer stays replicated. Transformer: q, k, v
and fc1 column-parallel, proj and fc2 row-parallel, each rank computing n_heads / tp heads.
Every rank sees the whole batch.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from architectures import ARCHITECTURES
from architectures.base import Architecture, StateLayout, StepOutput, Trainer, WorkerContext
from failbench_ray.data import SyntheticData
from failbench_ray.errors import SpecError
from failbench_ray.models import MLP, Block, Transformer, build_model, loss_fn
from failbench_ray.optim import build_optimizer
from failbench_ray.spec import ModelSpec


def tp_plan(named: list[tuple[str, nn.Module]]) -> dict[str, ParallelStyle]:
    """Column/row-parallel styles for these (name, layer) pairs: consecutive MLP hidden layers
    are paired (an unpaired one stays replicated), transformer blocks are split inside."""
    plan: dict[str, ParallelStyle] = {}
    hidden = [name for name, m in named if isinstance(m, nn.Sequential)]  # (Linear, ReLU)
    for first, second in zip(hidden[0::2], hidden[1::2], strict=False):
        plan[f"{first}.0"] = ColwiseParallel()
        plan[f"{second}.0"] = RowwiseParallel()
    for name, m in named:
        if isinstance(m, Block):
            for part in ("attn.q", "attn.k", "attn.v", "fc1"):
                plan[f"{name}.{part}"] = ColwiseParallel()
            for part in ("attn.proj", "fc2"):
                plan[f"{name}.{part}"] = RowwiseParallel()
    return plan


def named_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    if isinstance(model, MLP):
        return [(f"layers.{i}", m) for i, m in enumerate(model.layers)]
    assert isinstance(model, Transformer)
    return [(f"blocks.{i}", m) for i, m in enumerate(model.blocks)]


def tensor_parallelize(
    module: nn.Module, named: list[tuple[str, nn.Module]], mesh: object, tp: int
) -> None:
    """Shard `module` in place over `mesh` (every rank built the same init: no broadcast)."""
    parallelize_module(module, mesh, tp_plan(named), src_data_rank=None)  # type: ignore[arg-type]
    for _, m in named:
        if isinstance(m, Block):
            m.attn.n_heads //= tp


def check_tp_degree(spec: ModelSpec, tp: int) -> None:
    if spec.kind == "mlp":
        if spec.hidden_dim % tp:
            fits = [d for d in range(1, spec.hidden_dim + 1) if spec.hidden_dim % d == 0][:8]
            raise SpecError(
                f"tensor-parallel degree {tp} does not divide model.hidden_dim={spec.hidden_dim}; "
                f"degrees that fit: {', '.join(map(str, fits))}, or a hidden_dim that is a "
                f"multiple of {tp}"
            )
        if spec.depth < 2:
            raise SpecError("tensor parallelism pairs hidden layers: use model.depth >= 2")
        return
    for what, n in (("model.n_heads", spec.n_heads), ("model.d_model", spec.d_model)):
        if n % tp:
            raise SpecError(
                f"tensor-parallel degree {tp} does not divide {what}={n}; use a degree that "
                f"divides both n_heads={spec.n_heads} and d_model={spec.d_model}"
            )


class TensorTrainer(Trainer):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        spec = ctx.spec
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        self.module = build_model(spec.model, spec.seed).to(ctx.device)
        tensor_parallelize(self.module, named_layers(self.module), mesh, ctx.world_size)
        self.optimizer = build_optimizer(spec.optimizer, self.module.parameters())
        self.data = SyntheticData(spec.model, spec.seed)

    def train_step(self, step: int) -> StepOutput:
        spec, ctx = self.ctx.spec, self.ctx
        x, y = self.data.global_batch(step, spec.batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(spec.model, self.module(x.to(ctx.device)), y.to(ctx.device))
        loss.backward()
        self.optimizer.step()
        # Every rank computes the same (replicated) loss; count the samples once.
        return StepOutput(loss=float(loss.detach()), samples=len(x) if ctx.rank == 0 else 0)


@ARCHITECTURES.register("tensor")
class Tensor(Architecture):
    name = "tensor"
    summary = "tensor parallel (DTensor parallelize_module): column/row-parallel layer pairs"
    trainer_cls = TensorTrainer

    def check(self) -> None:
        check_tp_degree(self.spec.model, self.spec.world_size)

    def layout(self) -> StateLayout:
        w = self.spec.world_size
        return StateLayout(
            shard_of_rank=tuple(range(w)),
            holds=tuple(f"tensor slice {r + 1}/{w}" for r in range(w)),
        )
