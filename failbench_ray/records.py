"""What a trial produces: step records, checkpoint events and failures (recovery events).

These are plain frozen dataclasses: they cross actor boundaries (pickled by Ray) and are written
to SQL by `failbench_ray.storage`. The result JSON (`failbench_ray.results`) is derived from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The recovery phases of one failure, in order. Each is timed in seconds after the injection.
PHASES: tuple[str, ...] = ("detected", "quiesced", "reformed", "restored", "resumed", "caught_up")
# The parts of re-formation (between `quiesced` and `reformed`), timed the same way: the
# replacements are up (a spare took its rank, or a new process answered), every member reached
# the store (rendezvous), every member's process group is connected, the first collective in it
# is done everywhere. `reformed` follows once every rank built its trainer in the new group.
REFORM_PARTS: tuple[str, ...] = ("replaced", "rendezvous", "connected", "collective")
# Beside them, not in that order: when every survivor of a failure that brought replacements
# back had left the dead group and reached the new one's store. The fast re-formation
# (`ExperimentSpec.reform`) does that while the replacements start: before `replaced`.
SURVIVORS_AT_STORE = "survivors"
# And when the driver asked for the new processes of cold replacements (the plan made, the dead
# ended): `replaced` minus this is the replacements' own start-up inside the recovery, under
# whatever load the survivors put beside it.
SPAWNED = "spawned"
REFORM_MARKS: tuple[str, ...] = (SURVIVORS_AT_STORE, SPAWNED)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One optimizer step on one rank."""

    rank: int
    step: int  # 1-based: the state after this record holds `step` completed updates
    generation: int  # process-group generation (0 at start, +1 after each re-formation)
    loss: float
    t_start: float  # wall clock (time.time()) when the step began
    t_end: float  # wall clock when the step and the mechanism's after-step hook were done
    samples: int  # samples this rank consumed in this step
    blocked_s: float = 0.0  # part of the step spent in the mechanism's after-step hook


@dataclass(frozen=True, slots=True)
class CheckpointEvent:
    """A checkpoint save or restore on one rank."""

    rank: int
    step: int
    kind: str  # "save" or "restore"
    nbytes: int
    duration_s: float
    t_end: float
    path: str = ""


@dataclass(slots=True)
class FailureRecord:
    """One injected failure and the recovery that followed it (a recovery event).

    Phase times are seconds after `t_injected`; None when the phase was never reached (for
    example when a cascading failure interrupted this recovery).
    """

    index: int
    ranks: list[int]
    kill_kind: str
    trigger: str  # e.g. "step=25", "t=3.0s", "during=restoring"
    injected_at_step: int  # the step in flight (or the committed step, for a kill in recovery)
    t_injected: float
    quiesce: str = ""  # the strategy used (`spec.Quiesce`)
    restore_source: str = ""
    restored_from_step: int | None = None
    phases: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(PHASES))
    reform: dict[str, float | None] = field(
        default_factory=lambda: dict.fromkeys((*REFORM_PARTS, *REFORM_MARKS))
    )
    interrupted_by: int | None = None  # index of a cascading failure that cut this recovery short
    # How the dead ranks came back: "cold" (new processes, torch imported inside the measured
    # recovery), "warm" (standbys that already ran: hot spares), "none" (training went on
    # without them), "" (no recovery plan was made).
    replacement: str = ""
    quiesce_reason: str = ""  # why `quiesce` is not the strategy the spec asked for, if not
    detector: str = "death"  # what found it (`kill_kinds.DETECTORS`)

    @property
    def lost_steps(self) -> int | None:
        if self.restored_from_step is None:
            return None
        return max(0, self.injected_at_step - self.restored_from_step)
