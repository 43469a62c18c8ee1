"""Hybrid data x pipeline parallel: dp replicas of a pp-stage pipeline on dp * pp ranks.

Rank r is stage r % pp of replica r // pp. Each stage's gradients are averaged over its
replicas (through the worker's abortable all-reduce) before the optimizer step.
"""

from __future__ import annotations

from pydantic import Field

from architectures import ARCHITECTURES
from architectures.base import Architecture, StateLayout, WorkerContext
from architectures.pipeline import PipelineParams, PipelineTrainer, check_pipeline, stage_holds
from failbench_ray.errors import SpecError


class HybridParams(PipelineParams):
    dp: int = Field(2, ge=1, description="Data-parallel replicas.")
    pp: int = Field(2, ge=2, description="Pipeline stages per replica.")


class HybridTrainer(PipelineTrainer):
    def __init__(self, ctx: WorkerContext) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        p = ctx.params
        mesh = init_device_mesh(ctx.device.type, (p.dp, p.pp), mesh_dim_names=("dp", "pp"))
        super().__init__(
            ctx,
            stage=ctx.rank % p.pp,
            stages=p.pp,
            pp_group=mesh.get_group("pp"),
            dp_index=ctx.rank // p.pp,
            dp=p.dp,
            dp_group=mesh.get_group("dp"),
        )


@ARCHITECTURES.register("hybrid")
class Hybrid(Architecture):
    name = "hybrid"
    summary = "data x pipeline parallel: dp replicas of a pp-stage pipeline"
    Params = HybridParams
    trainer_cls = HybridTrainer

    def check(self) -> None:
        p = self.params
        assert isinstance(p, HybridParams)
        w = self.spec.world_size
        if p.dp * p.pp != w:
            shapes = [f"{d}x{w // d}" for d in range(1, w) if w % d == 0 and w // d >= 2]
            raise SpecError(
                f"hybrid dp x pp = {p.dp} x {p.pp} = {p.dp * p.pp} != world_size={w}; "
                f"shapes that fit {w} ranks (dp x pp): {', '.join(shapes) or 'none'}"
            )
        check_pipeline(self.spec, p.pp, p.dp, p)

    def layout(self) -> StateLayout:
        p = self.params
        assert isinstance(p, HybridParams)
        w = self.spec.world_size
        return StateLayout(
            shard_of_rank=tuple(r % p.pp for r in range(w)),
            holds=tuple(
                f"{stage_holds(self.spec, p.pp, r % p.pp)}, replica {r // p.pp + 1}/{p.dp}"
                for r in range(w)
            ),
        )
