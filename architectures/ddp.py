"""Synchronous data parallel with torch's own DistributedDataParallel."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from architectures import ARCHITECTURES
from architectures.base import (
    Architecture,
    StateLayout,
    StepOutput,
    Trainer,
    WorkerContext,
    check_batch_splits,
)
from failbench_ray.comm import CanonicalAllReduceHook
from failbench_ray.data import SyntheticData
from failbench_ray.models import build_model
from failbench_ray.optim import build_optimizer

# One bucket for all gradients, so the canonical hook sees every gradient at once.
_ONE_BUCKET_MB = 1 << 20


class DDPTrainer(Trainer):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        spec = ctx.spec
        self.module = build_model(spec.model, spec.seed).to(ctx.device)
        self.model = DistributedDataParallel(
            self.module,
            process_group=ctx.group,
            bucket_cap_mb=_ONE_BUCKET_MB,
            init_sync=False,  # every rank builds the same init; restore brings the real state
        )
        hook = CanonicalAllReduceHook(ctx.abort, ctx.group, list(self.module.parameters()))
        self.model.register_comm_hook(None, hook.all_reduce)
        self.optimizer = build_optimizer(spec.optimizer, self.module.parameters())
        self.data = SyntheticData(spec.model, spec.seed)

    def train_step(self, step: int) -> StepOutput:
        loss, samples = self.backward_on_shard(step, self.model)
        self.ctx.abort.check()  # a peer died during the all-reduce: skip the update
        self.optimizer.step()
        return StepOutput(loss=float(loss), samples=samples)


@ARCHITECTURES.register("ddp")
class DDP(Architecture):
    name = "ddp"
    summary = "synchronous data parallel (torch DDP), gradients all-reduced every step"
    trainer_cls = DDPTrainer
    abortable = True

    def check(self) -> None:
        w = self.spec.world_size
        check_batch_splits(self.spec.batch_size, w, f"world_size={w} ranks")

    def layout(self) -> StateLayout:
        w = self.spec.world_size
        return StateLayout(shard_of_rank=(0,) * w, holds=("full replica",) * w)
