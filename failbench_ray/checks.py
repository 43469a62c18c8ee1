"""Checks of a spec against the registries, all done before any actor starts.

`resolve(spec)` returns the architecture and mechanism objects, or raises SpecError with one
line that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from architectures import ARCHITECTURES, Architecture
from failbench_ray.errors import NotApplicableError, SpecError
from failbench_ray.spec import ExperimentSpec
from injector.kill_kinds import KILL_KINDS, CorruptParams, KillKind
from injector.traces import check_trace
from mechanisms import MECHANISMS, Mechanism


@dataclass(frozen=True)
class Resolved:
    spec: ExperimentSpec
    arch: Architecture
    mech: Mechanism


def _params(model: type[BaseModel], data: dict, where: str) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(p) for p in e["loc"])
        raise SpecError(
            f"invalid spec: {where}.params.{loc}: {e['msg']}", (where, "params", *e["loc"])
        ) from None


def _kill_params(kind: KillKind, data: dict[str, Any], index: int) -> None:
    where = f"failures.events[{index}].kill_params"
    try:
        kind.params.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(p) for p in e["loc"])
        known = ", ".join(kind.params.model_fields) or "none"
        raise SpecError(
            f"invalid spec: {where}.{loc}: {e['msg']} ({kind.name}'s parameters: {known})",
            ("failures", "events", index, "kill_params", *e["loc"]),
        ) from None


def _part(registry: Any, name: str, field: str) -> Any:
    try:
        return registry.get(name)
    except SpecError as err:
        raise SpecError(str(err), (field,)) from None


def resolve(spec: ExperimentSpec) -> Resolved:
    arch_cls = _part(ARCHITECTURES, spec.architecture.name, "architecture")
    mech_cls = _part(MECHANISMS, spec.mechanism.name, "mechanism")
    arch = arch_cls(spec, _params(arch_cls.Params, spec.architecture.params, "architecture"))
    mech = mech_cls(spec, _params(mech_cls.Params, spec.mechanism.params, "mechanism"))
    arch.check()
    check_trace(spec.failures)
    for i, event in enumerate(spec.failures.events):
        kind = _part(KILL_KINDS, event.kill, "failures")
        _kill_params(kind, event.kill_params, i)
        if kind.by_worker and event.worker_point is None:
            raise SpecError(
                f"kill={event.kill} needs a trigger inside the worker (at_step, or during: "
                f"checkpoint_write), not {event.trigger}; use sigkill or ray_kill for that"
            )
        if kind.corrupts:
            _check_corrupt_target(spec, event.kill_params, i)
        if kind.detector == "heartbeat" and spec.detectors.heartbeat_timeout_s is None:
            raise SpecError(
                f"kill={event.kill} leaves the process alive and only the heartbeat finds it, "
                "but detectors.heartbeat_timeout_s is off; set it (default 1.5 s)",
                ("detectors", "heartbeat_timeout_s"),
            )
    _check_straggler_detector(spec, arch)
    reason = mech.not_applicable(arch)
    if reason:
        raise NotApplicableError(f"{mech.name} on {arch.name}: not applicable: {reason}")
    if mech.needs_survivor:
        for event in spec.failures.events:
            if set(event.ranks) >= set(range(spec.world_size)):
                raise NotApplicableError(
                    f"{mech.name} recovers from a surviving rank, but failure {event.trigger} "
                    f"kills every rank; kill at most {spec.world_size - 1} ranks at once"
                )
    return Resolved(spec, arch, mech)


def _check_corrupt_target(spec: ExperimentSpec, kill_params: dict[str, Any], index: int) -> None:
    """A corruption's `param` and `element` must exist in the model (a rank holds its shard
    of it, which the victim checks again as it strikes). Built on the meta device: no memory."""
    import torch

    from failbench_ray.models import build_model

    params = CorruptParams.model_validate(
        {k: v for k, v in kill_params.items() if k in CorruptParams.model_fields}
    )
    with torch.device("meta"):
        shapes = [p.numel() for p in build_model(spec.model, spec.seed).parameters()]
    where = f"failures.events[{index}].kill_params"
    if params.param >= len(shapes):
        raise SpecError(
            f"invalid spec: {where}.param={params.param}: the model has {len(shapes)} parameter "
            f"tensors; use 0..{len(shapes) - 1}",
            ("failures", "events", index, "kill_params", "param"),
        )
    if params.element >= shapes[params.param]:
        raise SpecError(
            f"invalid spec: {where}.element={params.element}: parameter {params.param} has "
            f"{shapes[params.param]} elements; use 0..{shapes[params.param] - 1}",
            ("failures", "events", index, "kill_params", "element"),
        )


def _check_straggler_detector(spec: ExperimentSpec, arch: Architecture) -> None:
    """Replacing stragglers needs the step-time outlier detector, which needs every wait of a
    step to pass through the worker (`Architecture.abortable`) to tell waits from work."""
    d = spec.detectors
    if d.straggler_action == "replace" and d.straggler_factor is not None and not arch.abortable:
        raise SpecError(
            f"detectors.straggler_action=replace: {arch.name}'s collectives are torch's own, so "
            "the step-time outlier detector cannot tell a rank's waits on peers from its work "
            "and finds no straggler there; use straggler_action: flag, or ddp, gossip, ps, "
            "pipeline, or hybrid with tp=1",
            ("detectors", "straggler_action"),
        )
