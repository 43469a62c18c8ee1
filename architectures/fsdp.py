"""Sharded data parallel (ZeRO-3 style) with torch's FSDP2 `fully_shard`.

Each rank holds 1/N of every parameter and of the optimizer state; parameters are all-gathered
per layer for compute and gradients reduce-scattered. The collectives are torch's own, so a
survivor blocked in one cannot be pulled out (see `Architecture.abortable`).
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from architectures import ARCHITECTURES
from architectures.base import (
    Architecture,
    StateLayout,
    StepOutput,
    Trainer,
    WorkerContext,
    check_batch_splits,
)
from failbench_ray.data import SyntheticData
from failbench_ray.models import build_model, layers
from failbench_ray.optim import build_optimizer


class FSDPTrainer(Trainer):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        spec = ctx.spec
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        self.module = build_model(spec.model, spec.seed).to(ctx.device)
        for layer in layers(self.module):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.module, mesh=mesh)
        self.optimizer = build_optimizer(spec.optimizer, self.module.parameters())
        self.data = SyntheticData(spec.model, spec.seed)

    def train_step(self, step: int) -> StepOutput:
        loss, samples = self.backward_on_shard(step, self.module)
        self.optimizer.step()
        return StepOutput(loss=float(loss), samples=samples)


@ARCHITECTURES.register("fsdp")
class FSDP(Architecture):
    name = "fsdp"
    summary = "sharded data parallel (FSDP2 fully_shard): params, grads, optimizer state 1/N"
    trainer_cls = FSDPTrainer

    def check(self) -> None:
        w = self.spec.world_size
        check_batch_splits(self.spec.batch_size, w, f"world_size={w} ranks")

    def layout(self) -> StateLayout:
        w = self.spec.world_size
        return StateLayout(
            shard_of_rank=tuple(range(w)), holds=tuple(f"shard {r + 1}/{w}" for r in range(w))
        )
