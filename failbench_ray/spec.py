"""The experiment spec: what to run. Loaded from YAML or JSON (the same schema as the REST API).

Field-level checks live here (pydantic); checks that need the registries (an architecture's own
parameters, a mechanism's applicability, a trace's shape) live in `failbench_ray.checks`.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from failbench_ray.errors import SpecError


class _Strict(BaseModel):
    # No NaN or infinity anywhere: JSON has none (PostgreSQL refuses them), and no count or
    # timeout means anything at either.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


DAY_S = 86_400.0
PARAMS_DEPTH = 8  # how deep a part's `params` may nest (a mechanism's are 1-2 levels)


def _plain_params(value: Any, depth: int = 0) -> None:
    """A part's `params` are validated by its own model later; until then they must at least
    be JSON a database can store: finite numbers, nesting of bounded depth."""
    if depth > PARAMS_DEPTH:
        raise ValueError(f"params nest more than {PARAMS_DEPTH} levels deep")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"params hold {value!r}: numbers must be finite")
    if isinstance(value, dict):
        for v in value.values():
            _plain_params(v, depth + 1)
    elif isinstance(value, list | tuple):
        for v in value:
            _plain_params(v, depth + 1)


class ModelSpec(_Strict):
    """The model trained. Size knobs reach from KBs to GBs of state per rank."""

    kind: Literal["mlp", "transformer"] = Field(
        "mlp", description="`mlp` or a GPT-style `transformer`."
    )
    input_dim: int = Field(64, ge=1, description="mlp: input features.")
    hidden_dim: int = Field(256, ge=1, description="mlp: width of the hidden layers.")
    depth: int = Field(4, ge=1, description="mlp: number of hidden layers.")
    num_classes: int = Field(10, ge=2, description="mlp: classes of the synthetic task.")
    vocab_size: int = Field(128, ge=2, description="transformer: vocabulary size.")
    d_model: int = Field(64, ge=1, description="transformer: embedding width.")
    n_layers: int = Field(2, ge=1, description="transformer: number of blocks.")
    n_heads: int = Field(4, ge=1, description="transformer: attention heads (divide d_model).")
    seq_len: int = Field(32, ge=2, description="transformer: tokens per sample.")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.kind == "transformer" and self.d_model % self.n_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}"
            )
        return self


class OptimizerSpec(_Strict):
    name: Literal["sgd", "adam", "adamw"] = Field("sgd", description="torch.optim optimizer.")
    lr: float = Field(0.05, gt=0, description="Learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd momentum.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay.")


class PartSpec(_Strict):
    """A registered part (architecture or mechanism) and its own parameters."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        # `architecture: ddp` is shorthand for `architecture: {name: ddp}`.
        return {"name": data} if isinstance(data, str) else data

    @field_validator("params")
    @classmethod
    def _storable(cls, params: dict[str, Any]) -> dict[str, Any]:
        _plain_params(params)
        return params


# Recovery phases a cascading failure can be triggered by (the kill lands as the phase starts);
# `regrowing`: an elastic group taking its replacements back in.
RECOVERY_TRIGGERS: tuple[str, ...] = (
    "quiescing",
    "reforming",
    "restoring",
    "resuming",
    "regrowing",
)
# Worker-side triggers, each at `at_step`: in the middle of writing the checkpoint of that
# step; while the rank serves its in-memory copy of that step to a holder.
CHECKPOINT_WRITE = "checkpoint_write"
REPLICA_TRANSFER = "replica_transfer"
WORKER_TRIGGERS: tuple[str, ...] = (CHECKPOINT_WRITE, REPLICA_TRANSFER)


class FailureEvent(_Strict):
    """One injection: which ranks die, how, and what triggers it (exactly one trigger)."""

    ranks: list[int] = Field(min_length=1, description="Ranks killed at the same instant.")
    at_step: int | None = Field(None, ge=1, description="Kill while this step is in flight.")
    at_seconds: float | None = Field(
        None, ge=0, description="Kill this long after the trial starts."
    )
    during: str | None = Field(
        None,
        description="Cascading: kill when the recovery from the previous failure enters this "
        "phase (quiescing, reforming, restoring, resuming, regrowing); or, with at_step, while "
        "the victim writes that step's checkpoint (checkpoint_write) or sends its in-memory "
        "copy of it (replica_transfer).",
    )
    kill: str = Field(
        "sigkill", description="Kill kind (`failbench list` shows them): sigkill, hang, ..."
    )
    kill_params: dict[str, Any] = Field(
        default_factory=dict,
        description="The kill kind's own parameters (e.g. preempt's notice_s).",
    )

    @field_validator("kill_params")
    @classmethod
    def _storable(cls, params: dict[str, Any]) -> dict[str, Any]:
        _plain_params(params)
        return params

    @model_validator(mode="before")
    @classmethod
    def _rank_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and "rank" in data:
            data = dict(data)
            data["ranks"] = [data.pop("rank")]
        return data

    @model_validator(mode="after")
    def _one_trigger(self) -> FailureEvent:
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ranks {self.ranks} repeat a rank; list each rank once")
        if self.during in WORKER_TRIGGERS:
            if self.at_step is None or self.at_seconds is not None:
                raise ValueError(
                    f"during={self.during} needs at_step (the step whose state is being "
                    "written or sent) and no at_seconds"
                )
            return self
        triggers = [t for t in (self.at_step, self.at_seconds, self.during) if t is not None]
        if len(triggers) != 1:
            raise ValueError("each failure event needs exactly one of at_step, at_seconds, during")
        if self.during is not None and self.during not in RECOVERY_TRIGGERS:
            valid = ", ".join((*RECOVERY_TRIGGERS, *WORKER_TRIGGERS))
            raise ValueError(f"during={self.during!r} is not a trigger; valid: {valid}")
        return self

    @property
    def trigger(self) -> str:
        if self.during in WORKER_TRIGGERS:
            return f"during={self.during}@{self.at_step}"
        if self.at_step is not None:
            return f"step={self.at_step}"
        if self.at_seconds is not None:
            return f"t={self.at_seconds:g}s"
        return f"during={self.during}"

    @property
    def worker_point(self) -> tuple[str, int] | None:
        """(where, step) for a trigger that fires inside a worker, else None."""
        if self.during in WORKER_TRIGGERS and self.at_step is not None:
            return (self.during, self.at_step)
        if self.at_step is not None:
            return ("step", self.at_step)
        return None


class FailureTrace(_Strict):
    """The failure schedule of every trial (the baseline runs without it)."""

    kind: str = Field("none", description="none, single, concurrent, cascading or timed.")
    events: list[FailureEvent] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _event_shorthand(cls, data: Any) -> Any:
        # `{kind: single, rank: 3, at_step: 25}` is shorthand for one event.
        if not isinstance(data, dict):
            return data
        keys = {"rank", "ranks", "at_step", "at_seconds", "during", "kill", "kill_params"}
        inline = {k: v for k, v in data.items() if k in keys}
        if inline:
            rest = {k: v for k, v in data.items() if k not in keys}
            rest["events"] = [inline, *rest.get("events", [])]
            return rest
        return data


class DetectorSpec(_Strict):
    """Detectors of failures that do not end a process (`failbench list` shows which kind
    each one finds)."""

    heartbeat_timeout_s: float | None = Field(
        1.5,
        gt=0,
        le=DAY_S,
        description="A rank that answers no progress ping for this long while other ranks "
        "answer is hung: it is killed and recovered like a crash. None: no heartbeat (a hang "
        "then ends the trial through stall_timeout_s).",
    )
    digest_every: int | None = Field(
        10,
        gt=0,
        le=1_000_000,
        description="Every this many steps each rank reports a checksum of its parameters and "
        "the replicas of each shard are compared (silent corruption: `bitflip`). None: off.",
    )
    nonfinite_every: int | None = Field(
        1,
        gt=0,
        le=1_000_000,
        description="Every this many steps each rank checks that its parameters are finite "
        "(`nan`). None: off.",
    )
    straggler_factor: float | None = Field(
        1.7,
        gt=1,
        le=1000,
        description="A rank whose own computation time in a step (its waits on peers left out) "
        "rises to this many times its earlier time, and this many times what the other ranks' "
        "rose, is a straggler (`straggler`). None: off.",
    )
    straggler_window: int = Field(
        10,
        gt=0,
        le=10_000,
        description="Steps averaged for the straggler detector: a rank's earlier time and its "
        "recent time are each the mean over this many steps.",
    )
    straggler_action: Literal["flag", "replace"] = Field(
        "flag",
        description="What a straggler gets: `flag` records it and training goes on at its pace; "
        "`replace` ends it and the mechanism recovers it like a crash.",
    )


class Quiesce(str, Enum):
    """How survivors get out of the collective a dead rank left them in."""

    ABORT = "abort"  # the driver aborts their waits: fast, keeps their state
    KILL_SURVIVORS = "kill_survivors"  # fast, loses their state
    WAIT_TIMEOUT = "wait_timeout"  # what real jobs do: the process group's timeout


QuiesceStrategy = Literal["abort", "kill_survivors", "wait_timeout"]
assert set(QuiesceStrategy.__args__) == {q.value for q in Quiesce}  # type: ignore[attr-defined]


class ExperimentSpec(_Strict):
    """One experiment: architecture x mechanism x failure trace x model x steps x seed."""

    name: str | None = Field(None, description="A label for people; not unique.")
    architecture: PartSpec = Field(
        default_factory=lambda: PartSpec(name="ddp"), description="Training architecture."
    )
    world_size: int = Field(4, ge=2, description="Number of worker actors (ranks).")
    model: ModelSpec = Field(default_factory=ModelSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    steps: int = Field(60, ge=1, description="Optimizer steps per trial.")
    batch_size: int = Field(
        64, ge=1, le=2**31 - 1, description="Global batch size (split over data-parallel ranks)."
    )
    trials: int = Field(1, ge=1, description="Trials of the faulty run.")
    seed: int = Field(
        0, ge=0, le=2**32 - 1, description="Seeds the model init and the synthetic data."
    )
    mechanism: PartSpec = Field(
        default_factory=lambda: PartSpec(name="none"), description="Fault-tolerance mechanism."
    )
    failures: FailureTrace = Field(default_factory=FailureTrace)
    detectors: DetectorSpec = Field(default_factory=DetectorSpec)
    pg_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=DAY_S,
        description="Process-group (collective) timeout; torch's default is 30 min.",
    )
    stall_timeout_s: float | None = Field(
        None,
        gt=0,
        le=DAY_S,
        description="Fail a trial when no rank completes a step for this long while training "
        "(a hang, not a failure). Default: pg_timeout_s + 60 s.",
    )
    quiesce: QuiesceStrategy = Field(
        "abort",
        description="How survivors get out of the dead collective: `abort` (fast, keeps their "
        "state), `kill_survivors` (fast, loses it), `wait_timeout` (what real jobs do).",
    )
    warmup_steps: int = Field(3, ge=0, description="Steps per generation left out of steady state.")
    baseline: bool = Field(True, description="Run the matched no-fault baseline.")
    max_recoveries: int = Field(
        8, ge=0, le=10_000, description="Give up a trial after this many recoveries."
    )
    reform: Literal["standard", "fast"] = Field(
        "standard",
        description="How the group re-forms after a failure. `standard`: as PyTorch does by "
        "default, a process imports torch's compiler stack (which DDP, FSDP2, DTensor and "
        "pipelining load) when it first builds its trainer, so a hot spare or a new process "
        "pays it inside the recovery. `fast`: every worker process imports it as it starts "
        "(a hot spare before any failure; a new process as part of its start-up).",
    )
    reform_timeout_s: float = Field(
        60.0,
        gt=0,
        le=DAY_S,
        description="Timeout of the new process group's rendezvous after a failure.",
    )
    threads_per_worker: int = Field(
        1, ge=1, le=1024, description="torch intra-op threads per worker."
    )
    placement: Literal["pack", "spread"] = Field(
        "pack",
        description="How ranks are placed across Ray nodes (a placement group, one bundle per "
        "rank): `pack` on as few nodes as possible, `spread` over as many as possible.",
    )
    metrics: bool = Field(
        True,
        description="Export live training metrics (step time, loss, recovery phases) through "
        "Ray's metrics endpoint, for Prometheus and Grafana.",
    )

    @property
    def stall_limit_s(self) -> float:
        """How long training may go without a completed step before the trial fails."""
        return self.stall_timeout_s or self.pg_timeout_s + 60.0

    @model_validator(mode="after")
    def _fits(self) -> ExperimentSpec:
        for event in self.failures.events:
            bad = [r for r in event.ranks if not 0 <= r < self.world_size]
            if bad:
                raise ValueError(
                    f"failure rank(s) {bad} outside the world: ranks are 0..{self.world_size - 1}"
                )
            if event.at_step is not None and event.at_step > self.steps:
                raise ValueError(
                    f"failure at_step={event.at_step} is past the end (steps={self.steps}); "
                    f"use a step in 1..{self.steps}"
                )
        return self


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "spec"
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "invalid spec: " + "; ".join(parts)


def parse_spec(data: Any) -> ExperimentSpec:
    """Validate a spec from a dict; raise SpecError with one line that says what to change."""
    if not isinstance(data, dict):
        raise SpecError("invalid spec: expected a mapping of fields at the top level")
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_validation_error(err)) from None


def load_spec(path: str | Path) -> ExperimentSpec:
    """Load a spec from a .yaml/.yml/.json file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError(f"cannot read spec {p}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"cannot read spec {p}: not a UTF-8 text file") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise SpecError(f"cannot parse spec {p}: {err}".replace("\n", " ")) from None
    return parse_spec(data)
