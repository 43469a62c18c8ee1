"""Pipeline parallel with `torch.distributed.pipelining` (GPipe or 1F1B schedules).

The model's layers are cut into contiguous stages, one per rank; micro-batches flow through
them. Every rank builds the whole model from the seed and keeps its stage, so the stages start
from exactly the single-process initialisation. `PipelineTrainer` is shared with `hybrid`.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as _schedules
import torch.distributed.pipelining.stage as _stage
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from architectures import ARCHITECTURES, state
from architectures.base import (
    Architecture,
    StateLayout,
    StepOutput,
    Trainer,
    WorkerContext,
    check_batch_splits,
)
from architectures.tensor import tensor_parallelize
from failbench_ray.data import SyntheticData
from failbench_ray.errors import SpecError
from failbench_ray.models import build_model, layer_count, layers, loss_fn
from failbench_ray.optim import build_optimizer
from failbench_ray.spec import ExperimentSpec

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


# -- making torch's pipelining abortable ----------------------------------------------------
# The schedules wait for their point-to-point messages in one module-level function, and the
# stage's first-step handshake uses blocking send/recv. Both are routed through the running
# trainer's AbortHandle, so a stage waiting on a dead peer is released by the driver's abort
# (the step is then not applied) instead of blocking inside gloo. One training thread per
# worker process, so one current handle is enough.
_current_abort: Any = None


def _abortable_wait(works: list[dist.Work]) -> None:
    for w in works:
        if _current_abort is None:
            w.wait()
        else:
            _current_abort.wait(w)


class _AbortableDist:
    """torch.distributed as the pipeline stage module sees it: send/recv become abortable."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
        _abortable_wait([dist.isend(tensor, dst=dst, group=group, tag=tag)])

    def recv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> int:
        _abortable_wait([dist.irecv(tensor, src=src, group=group, tag=tag)])
        return src


_schedules._wait_batch_p2p = _abortable_wait  # type: ignore[assignment]
_stage.dist = _AbortableDist()  # type: ignore[assignment]


class PipelineParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: Literal["gpipe", "1f1b"] = Field("gpipe", description="Pipeline schedule.")
    microbatches: int = Field(4, ge=1, description="Micro-batches per step (divide the batch).")


def stage_bounds(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges of balanced contiguous stages (earlier stages take the extra)."""
    base, extra = divmod(n_layers, stages)
    bounds, lo = [], 0
    for s in range(stages):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def check_pipeline(spec: ExperimentSpec, stages: int, dp: int, params: PipelineParams) -> None:
    n, microbatches = layer_count(spec.model), params.microbatches
    if stages < 2:
        raise SpecError(f"a pipeline needs at least 2 stages, got {stages}")
    if stages > n:
        raise SpecError(
            f"{stages} pipeline stages but the {spec.model.kind} has {n} layers; use at most "
            f"{n} stages, or a deeper model (model.depth / model.n_layers)"
        )
    if params.schedule == "1f1b" and microbatches < stages:
        raise SpecError(
            f"the 1f1b schedule needs at least as many micro-batches as stages: "
            f"microbatches={microbatches} < {stages} stages; use microbatches >= {stages}"
        )
    check_batch_splits(spec.batch_size, dp, f"{dp} data-parallel replicas")
    per_replica = spec.batch_size // dp
    if per_replica % microbatches:
        fits = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
        raise SpecError(
            f"microbatches={microbatches} does not divide the batch of {per_replica} per replica; "
            f"micro-batch counts that fit: {', '.join(map(str, fits))}"
        )


class PipelineTrainer(Trainer):
    """One pipeline stage; with dp > 1, also one data-parallel replica of that stage."""

    def __init__(
        self,
        ctx: WorkerContext,
        *,
        stage: int,
        stages: int,
        pp_group: Any,
        dp_index: int = 0,
        dp: int = 1,
        dp_group: Any = None,
        tp_mesh: Any = None,
    ) -> None:
        super().__init__(ctx)
        spec, params = ctx.spec, ctx.params
        self.stage, self.stages = stage, stages
        self.dp_index, self.dp, self.dp_group = dp_index, dp, dp_group
        lo, hi = stage_bounds(layer_count(spec.model), stages)[stage]
        full = build_model(spec.model, spec.seed)
        self.module = nn.Sequential(*layers(full)[lo:hi]).to(ctx.device)
        if tp_mesh is not None:  # tensor parallel inside the stage (pairs never cross stages)
            named = [(str(i), m) for i, m in enumerate(self.module)]
            tensor_parallelize(self.module, named, tp_mesh, tp_mesh.size())
        pipe_stage = PipelineStage(self.module, stage, stages, ctx.device, group=pp_group)
        self.schedule = SCHEDULES[params.schedule](
            pipe_stage,
            n_microbatches=params.microbatches,
            loss_fn=lambda out, target: loss_fn(spec.model, out, target),
        )
        self.optimizer = build_optimizer(spec.optimizer, self.module.parameters())
        self.data = SyntheticData(spec.model, spec.seed)
        # Bubble measurement: time this stage spends computing micro-batches within a step.
        self._busy_s = 0.0
        self._fractions: list[float] = []
        for name in ("forward_one_chunk", "backward_one_chunk"):
            setattr(pipe_stage, name, self._timed(getattr(pipe_stage, name)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._busy_s += time.perf_counter() - t0

        return timed

    def train_step(self, step: int) -> StepOutput:
        global _current_abort
        _current_abort = self.ctx.abort
        spec, device = self.ctx.spec, self.ctx.device
        x, y = self.data.shard(step, spec.batch_size, self.dp_index, self.dp)
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        self._busy_s, t0 = 0.0, time.perf_counter()
        if self.stage == 0:
            self.schedule.step(x.to(device))
        elif self.stage == self.stages - 1:
            self.schedule.step(target=y.to(device), losses=losses)
        else:
            self.schedule.step()
        if step > spec.warmup_steps:
            self._fractions.append(1.0 - self._busy_s / (time.perf_counter() - t0))
        self.ctx.abort.check()  # a message of this step was aborted: skip the update
        if self.dp > 1:
            self._average_over_replicas()
        self.optimizer.step()
        loss = float(torch.stack(losses).mean()) if losses else math.nan
        return StepOutput(loss=loss, samples=len(x) if self.stage == 0 else 0)

    def metrics(self) -> dict[str, float]:
        """Measured bubble (idle share of the schedule's time on this stage) vs theory."""
        m, p = self.ctx.params.microbatches, self.stages
        if not self._fractions:
            return {}
        return {
            "bubble_fraction": statistics.median(self._fractions),
            "bubble_fraction_theory": (p - 1) / (m + p - 1),
        }

    def _average_over_replicas(self) -> None:
        """Average this stage's gradients over its data-parallel replicas, in parameter order."""
        grads = [state.local(p.grad) for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.dp)
        self.ctx.abort.wait(dist.all_reduce(flat, group=self.dp_group, async_op=True))
        pos = 0
        for g in grads:
            g.copy_(flat[pos : pos + g.numel()].view_as(g))
            pos += g.numel()


def stage_holds(spec: ExperimentSpec, stages: int, stage: int) -> str:
    lo, hi = stage_bounds(layer_count(spec.model), stages)[stage]
    return f"stage {stage + 1}/{stages} (layers {lo}..{hi - 1})"


class _PipelineTrainer(PipelineTrainer):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx, stage=ctx.rank, stages=ctx.world_size, pp_group=ctx.group)


@ARCHITECTURES.register("pipeline")
class Pipeline(Architecture):
    name = "pipeline"
    summary = "pipeline parallel (torch.distributed.pipelining): one stage per rank"
    Params = PipelineParams
    trainer_cls = _PipelineTrainer
    abortable = True  # every message goes through the worker's AbortHandle (see above)

    def check(self) -> None:
        p = self.params
        assert isinstance(p, PipelineParams)
        check_pipeline(self.spec, self.spec.world_size, 1, p)

    def layout(self) -> StateLayout:
        w = self.spec.world_size
        return StateLayout(
            shard_of_rank=tuple(range(w)),
            holds=tuple(stage_holds(self.spec, w, r) for r in range(w)),
        )
