"""`failbench search SPEC`: a second failure in every window a run passes through.

A mechanism is tested where it is weakest: while it is already recovering, writing a
checkpoint or sending a copy. For one architecture and mechanism (the spec's), with the spec's
failure as the first, each window below gets its own trial with a second failure in it:

- each recovery phase of the first failure (quiescing, reforming, restoring, resuming), killing
  another rank, and (once it exists) the replacement; for hot_spare, reforming is the spare's
  promotion;
- the mechanism's own windows (`Mechanism.windows`): inside the next checkpoint write, inside the
  next replica transfer, an elastic group's regrow;
- seeded random steps after the first failure, on a random rank.

Each trial is judged: the recovery hung or failed, lost data (more samples skipped than the
first failure alone loses), broke the oracle (a result that must be bit-identical to the
matched no-fault run is not), or the window was never reached. For each finding the smallest
spec that still reproduces it is written as a YAML file a user can run with `failbench run`.

Pure parts (`windows`, `judge`, `smaller`) are tested without Ray.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from failbench_ray.errors import SpecError
from failbench_ray.results import ExperimentResult, TrialResult
from failbench_ray.spec import RECOVERY_TRIGGERS, WORKER_TRIGGERS, ExperimentSpec

PHASES_BEFORE_REPLACEMENT = ("quiescing", "reforming")
PHASES_AFTER_REPLACEMENT = ("restoring", "resuming")

# Verdicts, worst first: what the report lists as findings.
FINDINGS = ("hung", "recovery failed", "lost data", "broke the oracle")
OK, NOT_REACHED = "ok", "not reached"


@dataclass(frozen=True)
class Window:
    name: str  # what the report calls it
    event: dict[str, Any]  # the second failure: a `FailureEvent`'s fields


@dataclass
class Outcome:
    window: str
    verdict: str
    detail: str
    experiment_id: str
    wall_s: float
    repro: str | None = None  # the smallest spec that reproduces a finding


@dataclass
class SearchReport:
    architecture: str
    mechanism: str
    outcomes: list[Outcome] = field(default_factory=list)
    probe_experiment: str = ""
    stopped_early: str | None = None  # why not every window ran (the time limit)

    def findings(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.verdict in FINDINGS]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "findings": len(self.findings())}


def first_failure(spec: ExperimentSpec) -> Any:
    """The spec's failure: the first of each searched trace. It must strike at a step, so
    the windows after it are known."""
    events = spec.failures.events
    if not events:
        raise SpecError(
            "failbench search needs a first failure in the spec, e.g. failures: "
            "{kind: single, rank: 1, at_step: 12}; each window gets a second one",
            ("failures",),
        )
    first = events[0]
    if first.at_step is None or first.during is not None:
        raise SpecError(
            f"failbench search needs the spec's first failure at a step (at_step), not "
            f"{first.trigger}: the windows are found from the step it strikes at",
            ("failures",),
        )
    if len(events) > 1:
        raise SpecError(
            f"failbench search adds the second failure itself; give the spec one event, not "
            f"{len(events)}",
            ("failures",),
        )
    return first


def windows(
    spec: ExperimentSpec,
    mech_windows: tuple[str, ...],
    interval: int,
    writer_of: Callable[[int], int],
    random_points: int,
    seed: int,
    kill: str = "sigkill",
) -> list[Window]:
    """Every window of this spec's run (see the module docstring), with its second failure.
    `writer_of(rank)`: the rank that writes the checkpoint of `rank`'s shard."""
    first = first_failure(spec)
    victim, world, step1 = first.ranks[0], spec.world_size, first.at_step
    others = [r for r in range(world) if r not in first.ranks]
    other = others[-1] if others else None
    out: list[Window] = []

    def add(name: str, rank: int, **trigger: Any) -> None:
        out.append(Window(name, {"ranks": [rank], "kill": kill, **trigger}))

    for phase in PHASES_BEFORE_REPLACEMENT:
        if other is not None:  # the first failure's ranks are still dead then
            add(f"{phase}: rank {other}", other, during=phase)
    for phase in PHASES_AFTER_REPLACEMENT:
        add(f"{phase}: rank {victim} again", victim, during=phase)
        if other is not None:
            add(f"{phase}: rank {other}", other, during=phase)
    after = (step1 // interval + 1) * interval  # the mechanism's first save after the failure
    for w in mech_windows:
        if w in WORKER_TRIGGERS and after <= spec.steps:
            for rank in sorted({writer_of(victim), *([other] if other is not None else [])}):
                add(f"{w}@{after}: rank {rank}", rank, during=w, at_step=after)
        elif w in RECOVERY_TRIGGERS and other is not None:
            add(f"{w}: rank {other}", other, during=w)
    rng = random.Random(seed)
    for _ in range(random_points if step1 < spec.steps else 0):
        step, rank = rng.randint(step1 + 1, spec.steps), rng.randrange(world)
        add(f"random: step {step}, rank {rank}", rank, at_step=step)
    return out


def with_second(spec: ExperimentSpec, window: Window, label: str) -> dict[str, Any]:
    """The spec's data with `window`'s failure after its own, one trial."""
    data = spec.model_dump(mode="json", exclude_defaults=True)
    first = spec.failures.events[0].model_dump(mode="json", exclude_defaults=True)
    data["failures"] = {"kind": "cascading", "events": [first, window.event]}
    data["trials"] = 1
    data["name"] = f"{label}: {window.name}"
    return data


def judge(
    result: ExperimentResult, skipped_alone: int | None, expect_failures: int = 2
) -> tuple[str, str]:
    """(verdict, detail) of one searched trial. `skipped_alone`: the samples the first
    failure alone skips (the probe's), which a second failure must not add to; None where
    skipping is by design (an architecture that trains on without a dead rank skips its
    share for as long as it is gone)."""
    trial = result.trials[0] if result.trials else None
    if trial is None:
        return "recovery failed", f"the experiment {result.status} before its trial ran"
    if trial.status != "completed":
        error = (trial.error or trial.status).splitlines()[0]
        hung = any(w in error for w in ("no rank completed a step", "timed out", "hung"))
        return ("hung" if hung else "recovery failed"), error
    if len(trial.failures) < expect_failures:
        return NOT_REACHED, "the second failure never struck: the run did not pass this window"
    if trial.match_expected and trial.matches_baseline is False:
        steps = ", ".join(
            f"{f.kill_kind} of {f.ranks} restored from step {f.restored_from_step}"
            for f in trial.failures
        )
        return "broke the oracle", f"the final parameters differ from the no-fault run ({steps})"
    skipped = int((trial.model_extra or {}).get("samples_skipped") or 0)
    if skipped_alone is not None and skipped > skipped_alone:
        return (
            "lost data",
            f"{skipped} samples never trained, {skipped_alone} with the first failure alone",
        )
    return OK, ""


def _interrupted_trial(error: str) -> TrialResult:
    return TrialResult(
        trial=0,
        status="interrupted",
        step_time_s=None,
        overhead_pct=None,
        final_loss=None,
        params_digest=None,
        matches_baseline=None,
        error=error,
    )


def smaller(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Candidate reductions of a reproducing spec, smallest first: the second failure alone
    (when it needs no first one), then the run cut to a few steps past its last trigger."""
    events = data["failures"]["events"]
    out = []
    last = max(e.get("at_step") or 0 for e in events)
    second = events[-1]
    if len(events) > 1 and second.get("during") not in RECOVERY_TRIGGERS:
        alone = {**data, "failures": {"kind": "single", **second}}
        out.append(alone)
    steps = data.get("steps", ExperimentSpec.model_fields["steps"].default)
    short = last + 3
    if short < steps:
        for base in list(out) + [data]:
            out.append({**base, "steps": short})
    return sorted(out, key=lambda d: (len(d["failures"].get("events", [1])), d.get("steps", 0)))


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def write_repro(path: Path, data: dict[str, Any], verdict: str, detail: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Found by failbench search: {verdict}: {detail}\n# Reproduce: failbench run {path}\n"
    )
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))


@dataclass
class SearchOptions:
    random_points: int = 3
    seed: int = 0
    kill: str = "sigkill"
    time_limit_s: float | None = None  # start no trial after this long
    trial_limit_s: float = 600.0  # a trial running longer is stopped and judged hung
    shrink: bool = True
    only: tuple[str, ...] = ()  # just the windows whose name contains one of these


def run_search(
    spec: ExperimentSpec,
    *,
    db: Any,
    out_dir: Path,
    options: SearchOptions | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> SearchReport:
    """Run the search on the connected Ray cluster; write each finding's smallest spec under
    `out_dir`. Stops starting trials once `options.time_limit_s` has passed (the report says
    so)."""
    from failbench_ray.checks import resolve

    o = options or SearchOptions()
    resolved = resolve(spec)
    arch, mech = resolved.arch, resolved.mech
    first_failure(spec)
    report = SearchReport(arch.name, mech.name)
    runner = _Trials(db, out_dir, o.trial_limit_s)
    label = f"search {arch.name}/{mech.name}"
    t0 = time.monotonic()
    probe_data = {**spec.model_dump(mode="json", exclude_defaults=True), "trials": 1}
    probe_data["name"] = f"{label}: the first failure alone"
    probe, _ = runner.run(probe_data, None)
    report.probe_experiment = probe.experiment_id
    verdict, detail = judge(probe, skipped_alone=None, expect_failures=1)
    if verdict != OK:
        report.stopped_early = f"the spec's own failure already ends {verdict}: {detail}"
        return report
    skipped_alone: int | None = int((probe.trials[0].model_extra or {}).get("samples_skipped") or 0)
    if arch.continues_without_dead():  # a dead rank's share is skipped while it is gone
        skipped_alone = None
    layout = arch.layout()
    found = windows(
        spec,
        mech.windows,
        int(getattr(mech.params, "interval", 1)),  # every mechanism with windows has one
        lambda rank: layout.writer_of(layout.shard_of_rank[rank]),
        o.random_points,
        o.seed,
        o.kill,
    )
    found = [w for w in found if not o.only or any(part in w.name for part in o.only)]
    for window in found:
        if o.time_limit_s is not None and time.monotonic() - t0 > o.time_limit_s:
            left = len(found) - len(report.outcomes)
            report.stopped_early = f"time limit {o.time_limit_s:g} s: {left} window(s) not run"
            break
        data = with_second(spec, window, label)
        result, wall = runner.run(data, probe.experiment_id)
        verdict, detail = judge(result, skipped_alone)
        outcome = Outcome(window.name, verdict, detail, result.experiment_id, wall)
        report.outcomes.append(outcome)
        say(f"{label}: {window.name}: {verdict}{': ' + detail if detail else ''}")
        if verdict in FINDINGS:
            best = runner.smallest(data, verdict, skipped_alone) if o.shrink else data
            path = out_dir / f"{slug(arch.name)}-{slug(mech.name)}-{slug(window.name)}.yaml"
            write_repro(path, best, verdict, detail)
            outcome.repro = str(path)
    return report


class _Trials:
    """Runs the search's experiments, each bounded in time."""

    def __init__(self, db: Any, out_dir: Path, limit_s: float) -> None:
        self.db, self.out_dir, self.limit_s = db, out_dir, limit_s

    def run(self, data: dict[str, Any], baseline_of: str | None) -> tuple[ExperimentResult, float]:
        from failbench_ray.errors import TrialInterrupted
        from failbench_ray.runner import run_experiment
        from failbench_ray.spec import parse_spec
        from failbench_ray.storage import repo

        started, created = time.monotonic(), list[str]()

        def too_long() -> str | None:
            if time.monotonic() - started <= self.limit_s:
                return None
            return f"no end after {self.limit_s:g} s: the recovery hung (search's trial limit)"

        try:
            result = run_experiment(
                parse_spec(data),
                db=self.db,
                out_dir=self.out_dir / "runs",
                baseline_of=baseline_of,
                should_stop=too_long,
                on_created=created.append,
            )
        except TrialInterrupted as err:  # stopped by `too_long`: every actor is gone
            with self.db.session() as s:
                repo.mark_interrupted(s, created[0], str(err))
            result = ExperimentResult(
                experiment_id=created[0], status="interrupted", spec=data, baseline=None,
                trials=[_interrupted_trial(str(err))],
            )  # fmt: skip
        return result, time.monotonic() - started

    def smallest(
        self, data: dict[str, Any], verdict: str, skipped_alone: int | None
    ) -> dict[str, Any]:
        """The smallest of `smaller(data)` that still ends `verdict`, else `data` itself."""
        for candidate in smaller(data):
            n = len(candidate["failures"].get("events", [None]))
            if judge(self.run(candidate, None)[0], skipped_alone, n)[0] == verdict:
                return candidate
        return data
