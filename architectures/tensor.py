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
from failbench_ray.models import MLP, Transformer, build_model, loss_fn
from failbench_ray.optim import build_optimizer
from failbench_ray.spec import ModelSpec


def tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    if isinstance(model, MLP):
        hidden = len(model.layers) - 1
        for i in range(0, hidden - 1, 2):
            plan[f"layers.{i}.0"] = ColwiseParallel()
            plan[f"layers.{i + 1}.0"] = RowwiseParallel()
        return plan
    assert isinstance(model, Transformer)
    for b in range(len(model.blocks)):
        for name in ("attn.q", "attn.k", "attn.v", "fc1"):
            plan[f"blocks.{b}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "fc2"):
            plan[f"blocks.{b}.{name}"] = RowwiseParallel()
    return plan


def tensor_parallelize(model: nn.Module, mesh: object, tp: int) -> None:
    """Shard `model` in place over `mesh` (every rank built the same init: no broadcast)."""
    parallelize_module(model, mesh, tp_plan(model), src_data_rank=None)  # type: ignore[arg-type]
    if isinstance(model, Transformer):
        for block in model.blocks:
            block.attn.n_heads //= tp  # type: ignore[union-attr,operator]


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
        tensor_parallelize(self.module, mesh, ctx.world_size)
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
