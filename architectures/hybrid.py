"""Hybrid data x pipeline (x tensor) parallel: dp replicas of a pp-stage pipeline whose stages
are split tp ways, on dp * pp * tp ranks.

Rank r = (replica * pp + stage) * tp + slice. Tensor-parallel pairs stay inside a stage, so the
activations between stages are whole. Each stage slice's gradients are averaged over its
replicas (through the worker's abortable all-reduce) before the optimizer step.
"""

from __future__ import annotations

from pydantic import Field

from architectures import ARCHITECTURES
from architectures.base import Architecture, StateLayout, WorkerContext
from architectures.pipeline import PipelineParams, PipelineTrainer, check_pipeline, stage_holds
from architectures.tensor import check_tp_degree
from failbench_ray.comm import init_mesh
from failbench_ray.errors import SpecError


class HybridParams(PipelineParams):
    dp: int = Field(2, ge=1, description="Data-parallel replicas.")
    pp: int = Field(2, ge=2, description="Pipeline stages per replica.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree inside each stage.")


class HybridTrainer(PipelineTrainer):
    def __init__(self, ctx: WorkerContext) -> None:
        p = ctx.params
        mesh = init_mesh(
            ctx.device.type, (p.dp, p.pp, p.tp), ("dp", "pp", "tp"), ctx.spec.pg_timeout_s
        )
        cell, _ = divmod(ctx.rank, p.tp)
        super().__init__(
            ctx,
            stage=cell % p.pp,
            stages=p.pp,
            pp_group=mesh.get_group("pp"),
            dp_index=cell // p.pp,
            dp=p.dp,
            dp_group=mesh.get_group("dp"),
            tp_mesh=mesh["tp"] if p.tp > 1 else None,
        )


@ARCHITECTURES.register("hybrid")
class Hybrid(Architecture):
    name = "hybrid"
    summary = "data x pipeline parallel: dp replicas of a pp-stage pipeline"
    Params = HybridParams
    trainer_cls = HybridTrainer

    @property
    def abortable(self) -> bool:  # type: ignore[override]
        # Pipeline messages and the data-parallel all-reduce are abortable; DTensor's
        # tensor-parallel collectives inside a stage are not.
        assert isinstance(self.params, HybridParams)
        return self.params.tp == 1

    def check(self) -> None:
        p = self.params
        assert isinstance(p, HybridParams)
        w = self.spec.world_size
        if p.dp * p.pp * p.tp != w:
            shapes = [f"{d}x{w // d}" for d in range(1, w) if w % d == 0 and w // d >= 2]
            raise SpecError(
                f"hybrid dp x pp x tp = {p.dp} x {p.pp} x {p.tp} = {p.dp * p.pp * p.tp} != "
                f"world_size={w}; dp x pp shapes that fit {w} ranks with tp=1: "
                f"{', '.join(shapes) or 'none'}"
            )
        check_pipeline(self.spec, p.pp, p.dp, p)
        if p.tp > 1:
            check_tp_degree(self.spec.model, p.tp)

    def layout(self) -> StateLayout:
        p = self.params
        assert isinstance(p, HybridParams)

        def where(r: int) -> tuple[int, int, int]:
            cell, slice_ = divmod(r, p.tp)
            return cell // p.pp, cell % p.pp, slice_  # replica, stage, tensor slice

        ranks = range(self.spec.world_size)
        return StateLayout(
            shard_of_rank=tuple(where(r)[1] * p.tp + where(r)[2] for r in ranks),
            holds=tuple(
                f"{stage_holds(self.spec, p.pp, where(r)[1])}"
                + (f", tensor slice {where(r)[2] + 1}/{p.tp}" if p.tp > 1 else "")
                + f", replica {where(r)[0] + 1}/{p.dp}"
                for r in ranks
            ),
        )
