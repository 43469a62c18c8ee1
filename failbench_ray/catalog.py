"""What is registered, for `failbench list` (and later the REST registry endpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from architectures import ARCHITECTURES
from failbench_ray.checks import resolve
from failbench_ray.errors import SpecError
from failbench_ray.spec import DetectorSpec, ExperimentSpec, PartSpec, load_spec, parse_spec
from failbench_ray.sweep import standard_trace
from injector.kill_kinds import DETECTORS, KILL_KINDS
from injector.traces import TRACE_KINDS
from mechanisms import MECHANISMS

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def _params(model: type[BaseModel]) -> dict[str, Any]:
    return {
        name: {"default": f.default, "description": f.description or ""}
        for name, f in model.model_fields.items()
    }


def catalog() -> dict[str, list[dict[str, Any]]]:
    return {
        "architectures": [
            {"name": n, "summary": a.summary, "params": _params(a.Params)}
            for n, a in ARCHITECTURES.items()
        ],
        "mechanisms": [
            {"name": n, "summary": m.summary, "params": _params(m.Params)}
            for n, m in MECHANISMS.items()
        ],
        "traces": [{"name": n, "summary": t.summary} for n, t in TRACE_KINDS.items()],
        "kill_kinds": [
            {
                "name": n,
                "summary": k.summary,
                "params": _params(k.params),
                "detector": k.detector,
                "inside_worker": k.by_worker,
            }
            for n, k in KILL_KINDS.items()
        ],
        "detectors": [
            {"name": n, "summary": what, "params": _detector_params(n)}
            for n, what in DETECTORS.items()
        ],
    }


# Each detector's own settings in `spec.DetectorSpec` (`death` has none: Ray reports it).
_DETECTOR_FIELDS = {
    "heartbeat": ("heartbeat_timeout_s",),
    "step_time": ("straggler_factor", "straggler_window", "straggler_action"),
    "digest": ("digest_every",),
    "nonfinite": ("nonfinite_every",),
}


def _detector_params(name: str) -> dict[str, Any]:
    fields = _DETECTOR_FIELDS.get(name, ())
    return {k: v for k, v in _params(DetectorSpec).items() if k in fields}


def mechanism_names() -> list[str]:
    """Registered mechanisms, the no-FT baseline first."""
    return sorted(MECHANISMS.names(), key=lambda n: (n != "none", n))


def _example(architecture: str) -> ExperimentSpec:
    path = EXAMPLES_DIR / f"{architecture}.yaml"
    if path.is_file():
        return load_spec(path)
    return ExperimentSpec(architecture=PartSpec(name=architecture))  # installed without examples/


def _applies(example: ExperimentSpec, mechanism: str) -> str | None:
    """None if `mechanism` applies to the example under a single failure, else why not."""
    data = example.model_dump(mode="json")
    data["mechanism"] = {"name": mechanism}
    data["failures"] = standard_trace("single", example.world_size, example.steps)
    try:
        resolve(parse_spec(data))
    except SpecError as err:
        # "<mech> on <arch>: not applicable: <why>": the table already says which pair.
        return str(err).split(": not applicable: ", 1)[-1]
    return None


def applicability(architecture: str) -> dict[str, str | None]:
    """mechanism -> None where it applies to `architecture` (its example spec), else why not."""
    example = _example(architecture)
    return {mech: _applies(example, mech) for mech in mechanism_names()}


def matrix() -> list[dict[str, Any]]:
    """Architecture x mechanism applicability, on each architecture's example spec (its
    `examples/<arch>.yaml`) with the mechanism swapped in and a single failure."""
    rows = []
    for arch in ARCHITECTURES.names():
        example = _example(arch)
        for mech in mechanism_names():
            reason = _applies(example, mech)
            rows.append(
                {
                    "architecture": arch,
                    "mechanism": mech,
                    "applicable": reason is None,
                    "reason": reason,
                }
            )
    return rows


def shards(architecture: str, world: int) -> int:
    """Distinct pieces the training state is split into on `world` ranks (each rank holds one),
    from the architecture's example: 1 where every rank holds all of it (ddp, gossip, ps
    workers), else in proportion to the world size (fsdp, tensor, pipeline stages, hybrid)."""
    example = _example(architecture)
    n = len(resolve(example).arch.layout().shard_ids())
    if n <= 1:
        return 1
    return max(1, round(n / example.world_size * world))
