"""`failbench search` (issue 19): the windows it tries, how it judges a trial, the smaller specs
it tries; and one real search on Ray (every window run, each judged, the checkpoint write
reached)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from failbench_ray.errors import SpecError
from failbench_ray.results import ExperimentResult, FailureResult, PhaseTimes, TrialResult
from failbench_ray.search import (
    NOT_REACHED,
    OK,
    SearchOptions,
    Window,
    judge,
    run_search,
    smaller,
    windows,
    with_second,
)
from failbench_ray.spec import parse_spec
from failbench_ray.storage.db import Database

REPO = Path(__file__).resolve().parents[1]


def spec_of(**over: Any) -> Any:
    data: dict[str, Any] = {
        "architecture": "ddp",
        "world_size": 4,
        "model": {"kind": "mlp", "input_dim": 16, "hidden_dim": 32, "depth": 2},
        "steps": 30,
        "batch_size": 32,
        "mechanism": {"name": "disk_ckpt", "params": {"interval": 5}},
        "failures": {"kind": "single", "rank": 1, "at_step": 12},
    }
    data.update(over)
    return parse_spec(data)


def test_every_recovery_phase_the_mechanisms_own_windows_and_seeded_random_steps() -> None:
    spec = spec_of()
    found = windows(spec, ("checkpoint_write",), 5, lambda rank: 0, random_points=2, seed=7)
    names = [w.name for w in found]
    assert names[:6] == [
        "quiescing: rank 3",  # the first failure's rank is still dead: another one
        "reforming: rank 3",
        "restoring: rank 1 again",  # its replacement
        "restoring: rank 3",
        "resuming: rank 1 again",
        "resuming: rank 3",
    ]
    # the next checkpoint after step 12 is 15's: written by rank 0 (ddp's one writer), and
    # rank 3 (not a writer: the report will say the window was not reached)
    assert names[6:8] == ["checkpoint_write@15: rank 0", "checkpoint_write@15: rank 3"]
    assert found[6].event == {
        "ranks": [0],
        "kill": "sigkill",
        "during": "checkpoint_write",
        "at_step": 15,
    }
    randoms = found[8:]
    assert len(randoms) == 2 and all(12 < w.event["at_step"] <= 30 for w in randoms)
    again = windows(spec, ("checkpoint_write",), 5, lambda rank: 0, random_points=2, seed=7)
    assert again == found  # seeded
    regrow = windows(spec, ("regrowing",), 1, lambda rank: rank, 0, 0, kill="hang")
    assert regrow[-1] == Window(
        "regrowing: rank 3", {"ranks": [3], "kill": "hang", "during": "regrowing"}
    )


def test_each_window_is_a_valid_cascading_spec_after_the_first_failure() -> None:
    spec = spec_of()
    for w in windows(spec, ("checkpoint_write",), 5, lambda rank: 0, 3, 0):
        data = with_second(spec, w, "search")
        parsed = parse_spec(data)
        assert parsed.trials == 1 and len(parsed.failures.events) == 2
        assert parsed.failures.events[0].at_step == 12


@pytest.mark.parametrize(
    ("failures", "says"),
    [
        ({"kind": "none"}, "needs a first failure in the spec"),
        ({"kind": "single", "rank": 1, "at_seconds": 3}, r"at a step \(at_step\), not t=3s"),
        (
            {
                "kind": "cascading",
                "events": [{"rank": 1, "at_step": 5}, {"rank": 2, "during": "restoring"}],
            },
            "give the spec one event, not 2",
        ),
    ],
)
def test_a_spec_search_cannot_start_from_gets_one_line(failures: dict[str, Any], says: str) -> None:
    with pytest.raises(SpecError, match=says) as err:
        windows(spec_of(failures=failures), (), 1, lambda r: r, 0, 0)
    assert "\n" not in str(err.value)


def _result(status: str = "completed", failures: int = 2, **extra: Any) -> ExperimentResult:
    fail = FailureResult(
        ranks=[1],
        kill_kind="sigkill",
        trigger="step=12",
        injected_at_step=12,
        restored_from_step=10,
        lost_steps=2,
        quiesce="abort",
        restore_source="checkpoint",
        phases=PhaseTimes(),
    )
    exact = extra.pop("exact", True)
    trial = TrialResult(
        trial=0,
        status=status,
        step_time_s=None,
        overhead_pct=None,
        final_loss=None,
        params_digest=None,
        matches_baseline=exact,
        match_expected=True,
        error=extra.pop("error", None),
        failures=[fail] * failures,
        **extra,
    )
    return ExperimentResult(
        experiment_id="e", status=status, spec={}, baseline=None, trials=[trial]
    )


def test_a_searched_trial_is_judged_worst_first() -> None:
    assert judge(_result(), skipped_alone=0) == (OK, "")
    hung = _result("failed", error="no rank completed a step for 61 s while training")
    assert judge(hung, 0)[0] == "hung"
    assert judge(_result("failed", error="rank 2 failed: boom"), 0) == (
        "recovery failed",
        "rank 2 failed: boom",
    )
    assert judge(_result(failures=1), 0)[0] == NOT_REACHED
    verdict, detail = judge(_result(exact=False), 0)
    assert verdict == "broke the oracle" and "restored from step 10" in detail
    assert judge(_result(samples_skipped=32), skipped_alone=0)[0] == "lost data"
    assert judge(_result(samples_skipped=32), skipped_alone=32)[0] == OK
    # gossip trains on without a dead rank: its share is skipped while it is gone, by design
    assert judge(_result(samples_skipped=64), skipped_alone=None)[0] == OK


def test_a_finding_is_shrunk_to_the_window_alone_and_to_a_few_steps_past_it() -> None:
    spec = spec_of()
    second = Window(
        "checkpoint_write@15: rank 0", {"ranks": [0], "during": "checkpoint_write", "at_step": 15}
    )
    data = with_second(spec, second, "s")
    tries = smaller(data)
    assert [(len(t["failures"].get("events", [1])), t["steps"]) for t in tries] == [
        (1, 18),  # the window alone, cut to 3 steps past it
        (1, 30),
        (2, 18),
    ]
    for t in tries:
        parse_spec(t)  # each runs as it is
    phase = with_second(
        spec, Window("restoring: rank 3", {"ranks": [3], "during": "restoring"}), "s"
    )
    # a phase needs the failure it recovers from: only the run is cut
    assert [t["steps"] for t in smaller(phase)] == [15]


@pytest.mark.usefixtures("no_leaks")
def test_a_search_runs_each_window_it_is_asked_for_and_says_what_each_did(
    ray_cluster: None, tmp_path: Path
) -> None:
    """inmem_replica on ddp, quiescing by killing the survivors, two kinds of window (the
    others are the same machinery, and `make bench` runs them all):
    - a second kill during quiescing strikes a rank the quiesce kills anyway: it is still a
      failure of its own, and the records that rank logged before it died still count (both
      were lost before, the trial judged `not reached`, then `lost data`);
    - while rank 0 serves its copy of step 15 to its holder (ddp's one shard: rank 0 sends
      it), recovered from; rank 3 sends none, so its window is never reached."""
    db = Database(f"sqlite:///{tmp_path}/search.db")
    lines: list[str] = []
    spec = spec_of(
        steps=20,
        quiesce="kill_survivors",
        mechanism={"name": "inmem_replica", "params": {"interval": 5}},
    )
    try:
        report = run_search(
            spec,
            db=db,
            out_dir=tmp_path,
            options=SearchOptions(random_points=0, only=("quiescing", "replica_transfer")),
            say=lines.append,
        )
    finally:
        db.dispose()
    verdicts = {o.window: o.verdict for o in report.outcomes}
    assert verdicts == {
        "quiescing: rank 3": OK,
        "replica_transfer@15: rank 0": OK,
        "replica_transfer@15: rank 3": NOT_REACHED,
    }, report.outcomes
    assert report.stopped_early is None and report.findings() == []
    assert lines[0] == "search ddp/inmem_replica: quiescing: rank 3: ok"


def test_the_search_command_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"failures": {"kind": "single", "rank": 1, "at_step": 5}}))
    for args, says in (
        (["--random", "-1"], "--random -1: give 0 or more"),
        (["--kill", "zap"], "unknown kill kind 'zap'"),
        (["--time-limit-s", "0"], "--time-limit-s 0: give a positive"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "failbench_ray.cli", "search", str(spec), *args],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert done.returncode == 2, done.stderr
        assert says in done.stderr and done.stderr.count("\n") == 1
