"""Faults beyond the clean kill (issue 19): segfault, abort, an exception, a hang (SIGSTOP), a
held GIL, a preemption with notice and silent corruption (a flipped bit, a NaN), each injected
for real and recovered; the heartbeat that finds the hangs, the checks that find corruption;
their parameters' checks."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from failbench_ray import kinds_report
from failbench_ray.catalog import catalog
from failbench_ray.checks import resolve
from failbench_ray.comm import AbortHandle
from failbench_ray.controller.audit import DigestAudit
from failbench_ray.controller.heartbeat import Heartbeat
from failbench_ray.controller.notice import next_save_step
from failbench_ray.controller.stragglers import Outlier, StepTimeOutliers
from failbench_ray.errors import RecoveryError, SpecError
from failbench_ray.recovery import decide
from failbench_ray.results import ExperimentResult, FailureResult, PhaseTimes, TrialResult
from failbench_ray.runner import run_experiment
from failbench_ray.spec import parse_spec
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database
from injector import throttle
from injector.chaos import Chaos
from injector.kill_kinds import KILL_KINDS, BitflipParams, CorruptParams, corrupt
from mechanisms import MECHANISMS
from mechanisms import checkpoint_io as io
from mechanisms.base import FailureContext
from tests.test_engine import small as engine_small

# -- pure parts --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_heartbeat_finds_the_rank_that_stopped_answering() -> None:
    clock = Clock()
    hb = Heartbeat(1.5, clock)
    for r in (0, 1, 2):
        hb.sent(r)
    clock.now += 0.2
    hb.answered(0)
    hb.answered(2)
    assert hb.hung({0, 1, 2}) == set()
    for _ in range(8):  # pings go out every beat; rank 1 answers none of them
        clock.now += 0.2
        for r in (0, 1, 2):
            hb.sent(r)
        hb.answered(0)
        hb.answered(2)
    assert hb.silent_s(1) == pytest.approx(1.8)  # since its oldest unanswered ping
    assert hb.hung({0, 1, 2}) == {1}
    hb.restart()
    assert hb.hung({0, 1, 2}) == set()


def test_the_heartbeat_blames_no_rank_when_every_rank_is_silent_or_it_is_off() -> None:
    clock = Clock()
    hb = Heartbeat(1.0, clock)
    hb.sent(0)
    hb.sent(1)
    clock.now += 5
    assert hb.hung({0, 1}) == set()  # the driver itself stalled: nobody to blame
    off = Heartbeat(None, clock)
    off.sent(0)
    clock.now += 1000
    assert off.hung({0, 1}) == set()


def _feed(det: StepTimeOutliers, step: int, times: dict[int, float]) -> list[Outlier]:
    for rank, t in times.items():
        det.add(rank, {step: t})
    return det.check(times)


def test_the_step_time_detector_flags_the_rank_that_computes_slower_than_it_did() -> None:
    det = StepTimeOutliers(factor=1.7, window=4, skip=2, base_windows=2)
    # Warm-up (skipped), then the yardstick: stage 2 of a pipeline does twice the work of the
    # others, and that is its normal, not an outlier.
    for step in range(1, 11):
        assert _feed(det, step, {0: 0.01, 1: 0.01, 2: 0.02}) == []
    assert det.ratio(1) is None  # no recent window yet
    for step in range(11, 14):
        assert _feed(det, step, {0: 0.01, 1: 0.03, 2: 0.02}) == []  # the window is not full
    (found,) = _feed(det, 14, {0: 0.01, 1: 0.03, 2: 0.02})
    assert (found.rank, found.step, found.ratio, found.others) == (1, 14, 3.0, 1.0)
    assert "rank 1 computes 3.0x its earlier time by step 14" in found.describe()
    assert _feed(det, 15, {0: 0.01, 1: 0.03, 2: 0.02}) == []  # flagged once


def test_the_step_time_detector_blames_no_rank_when_the_whole_machine_slows() -> None:
    det = StepTimeOutliers(factor=1.7, window=4, skip=0, base_windows=1)
    for step in range(1, 5):
        _feed(det, step, {0: 0.01, 1: 0.01, 2: 0.01})
    for step in range(5, 9):
        assert _feed(det, step, {0: 0.03, 1: 0.03, 2: 0.035}) == []
    # A rank that computes nothing (a parameter server between pushes) is never compared.
    det.add(3, {9: 0.0})
    assert det.ratio(3) is None
    off = StepTimeOutliers(factor=None, window=1, skip=0)
    for step in range(1, 5):
        assert _feed(off, step, {0: 0.01, 1: 1.0 * step}) == []


def test_a_steps_waits_on_peers_count_once_however_they_overlap() -> None:
    handle = AbortHandle()
    handle.begin_step()
    handle.waited(10.0, 12.0)  # a gradient all-reduce in flight...
    handle.waited(11.0, 12.5)  # ...while the step also waits on a message
    handle.waited(20.0, 21.0)
    assert handle.take_waited() == pytest.approx(3.5)
    assert handle.take_waited() == 0.0  # taken


def test_a_straggler_runs_its_process_at_one_over_factor_of_the_time() -> None:
    """The duty cycle, on a real process: it stops and resumes it, and leaves it running."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        stop = threading.Event()
        cycle = threading.Thread(
            target=throttle.duty_cycle, args=([proc.pid], 4.0, 0.05, 30, stop.is_set)
        )
        cycle.start()
        states = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not {"T", "S"} <= states:
            states.add(_proc_state(proc.pid))
            time.sleep(0.003)
        stop.set()
        cycle.join(5)
        # Stopped 3/4 of each cycle; the rest it sleeps as `sleep` does (or, just resumed, is
        # briefly runnable: R, or, on a loaded machine, waits on a page-in: D). Never dead.
        alive = {"T", "S", "R", "D"}
        assert {"T", "S"} <= states <= alive
        assert not cycle.is_alive() and _proc_state(proc.pid) in alive - {"T"}  # resumed
    finally:
        proc.kill()
        proc.wait()


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_the_save_on_notice_step_is_ahead_of_every_rank_and_within_the_trial() -> None:
    assert next_save_step({0: 7, 1: 6}, end=100) == 9
    assert next_save_step({}, end=100) == 2
    assert next_save_step({0: 99}, end=100) is None


def test_a_notice_comes_first_and_the_kill_strikes_notice_s_later() -> None:
    """The chaos actor's logic without Ray, on a real process: SIGTERM after the notice, then
    SIGKILL after the grace period if it is still alive."""
    victim = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60"])  # ignores SIGTERM
    try:
        chaos = Chaos(
            [
                {
                    "ranks": [0],
                    "at_seconds": 0,
                    "kill": "preempt",
                    "kill_params": {"notice_s": 0.3, "grace_s": 0.3},
                }
            ]
        )
        chaos.set_targets({0: (victim.pid, None, "")})
        t0 = time.time()
        chaos._fire(0, None)
        assert chaos.fired() == [0]
        assert list(chaos.noticed()) == [0] and chaos.injections() == []
        assert victim.wait(timeout=10) == -signal.SIGKILL  # the grace ran out
        (inj,) = chaos.injections()
        assert chaos.noticed() == {}
        assert inj.t_injected - t0 >= 0.3  # recorded when it struck, not at the notice
    finally:
        victim.kill()
        victim.wait()


def test_the_digest_check_blames_the_minority_or_every_replica_without_one() -> None:
    audit = DigestAudit([[0, 1, 2], [3, 4], [5]])  # rank 5's shard has no replica: not compared
    assert audit.groups == [[0, 1, 2], [3, 4]]
    for r in range(5):
        audit.add(r, {10: "a"})
    audit.add(5, {10: "z"})
    assert audit.check(range(6)) is None and audit.verified == 10
    for r, sums in {0: "b", 1: "b", 2: "x", 3: "c", 4: "c"}.items():
        audit.add(r, {20: sums, 30: sums})
    bad = audit.check(range(6))
    assert bad is not None and (bad.step, bad.ranks) == (20, {2}) and audit.verified == 10
    audit.rolled_back(10)
    audit.add(3, {20: "c"})
    audit.add(4, {20: "d"})
    audit.add(0, {20: "b"})
    assert audit.check(range(6)) is None  # ranks 1 and 2 have not reported the replay yet
    assert audit.check([0, 3, 4]).ranks == {3, 4}  # two replicas: no majority, both suspect
    audit.rolled_back(5)
    assert audit.verified == 5


def test_a_bitflip_flips_one_bit_and_a_nan_poisons_one_gradient_once() -> None:
    import torch

    p = torch.nn.Parameter(torch.ones(6))
    before = p.detach().clone().view(torch.int32)
    assert corrupt("bitflip", BitflipParams(element=4, bit=31), [p]).startswith("bit 31")
    changed = (p.detach().view(torch.int32) ^ before).nonzero().flatten().tolist()
    assert changed == [4] and p[4].item() == -1.0
    q = torch.nn.Parameter(torch.ones(3))
    corrupt("nan", CorruptParams(param=0, element=2), [q])
    (q * 2).sum().backward()
    assert q.grad is not None and q.grad.isnan().tolist() == [False, False, True]
    q.grad = None
    (q * 2).sum().backward()  # the hook fired once
    assert q.grad is not None and q.grad.isfinite().all()
    with pytest.raises(ValueError, match="this rank holds 1 parameter tensors"):
        corrupt("nan", CorruptParams(param=1), [q])
    with pytest.raises(ValueError, match="parameter 0 has 3 elements"):
        corrupt("bitflip", BitflipParams(element=3), [q])


def test_a_rollback_after_corruption_never_restores_state_newer_than_the_last_check(
    tmp_path: Path,
) -> None:
    for step in (5, 10, 15):
        (io.ckpt_root(tmp_path) / f"step_{step:08d}").mkdir(parents=True)
        io.shard_path(tmp_path, step, 0).write_bytes(b"x")
    assert io.latest_complete(tmp_path, [0], at_most=12) == 10
    spec = parse_spec(engine_small())
    resolved = resolve(spec)
    ctx = dict(
        world_size=4,
        dead=frozenset({1}),
        layout=resolved.arch.layout(),
        committed_step=14,
        failure_step=15,
        quiesce="abort",
    )
    disk = MECHANISMS.get("disk_ckpt")(spec, resolved.mech.params)
    plan = decide(
        disk,
        FailureContext(**ctx, latest_checkpoint=10, restore_at_most=12),
        continues_without_dead=False,
    )
    assert plan.restore_step == 10
    with pytest.raises(RecoveryError, match="cannot undo silent corruption"):
        decide(
            disk,
            FailureContext(**ctx, latest_checkpoint=15, restore_at_most=12),
            continues_without_dead=False,
        )
    assert io.discard_after(tmp_path, 10) == [15]  # the corrupt timeline's checkpoint
    assert io.latest_complete(tmp_path, [0]) == 10


def one_event(**event: Any) -> dict[str, Any]:
    return {"failures": {"kind": "single", "rank": 1, "at_step": 3, **event}}


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            one_event(kill="preempt", kill_params={"notice_s": -1}),
            "failures.events[0].kill_params.notice_s: Input should be greater than or equal to 0"
            " (preempt's parameters: notice_s, grace_s)",
        ),
        (
            one_event(kill="preempt", kill_params={"notise_s": 1}),
            "failures.events[0].kill_params.notise_s: Extra inputs are not permitted",
        ),
        (one_event(kill="gil_hang", kill_params={"hold_s": 0}), "hold_s: Input should be greater"),
        (one_event(kill="hang", kill_params={"hold_s": 5}), "(hang's parameters: none)"),
        (one_event(kill="sigstop"), "unknown kill kind 'sigstop'; valid: abort, bitflip"),
        (
            one_event(kill="bitflip", kill_params={"bit": 32}),
            "failures.events[0].kill_params.bit: Input should be less than or equal to 31",
        ),
        (
            {**one_event(kill="nan"), "detectors": {"nonfinite_every": 0}},
            "detectors.nonfinite_every: Input should be greater than 0",
        ),
        (
            {**one_event(kill="bitflip"), "detectors": {"digest_every": 0}},
            "detectors.digest_every: Input should be greater than 0",
        ),
        (
            {**one_event(kill="hang"), "detectors": {"heartbeat_timeout_s": None}},
            "kill=hang leaves the process alive and only the heartbeat finds it",
        ),
        (
            {"failures": {"kind": "single", "rank": 1, "at_seconds": 2, "kill": "segfault"}},
            "kill=segfault needs a trigger inside the worker",
        ),
        (
            one_event(kill="straggler", kill_params={"factor": 1}),
            "failures.events[0].kill_params.factor: Input should be greater than 1 (straggler's "
            "parameters: factor, duration_s, period_s)",
        ),
        (
            one_event(kill="straggler", kill_params={"period_s": 2}),
            "kill_params.period_s: Input should be less than or equal to 1",
        ),
        (
            {**one_event(kill="straggler"), "detectors": {"straggler_factor": 0.9}},
            "detectors.straggler_factor: Input should be greater than 1",
        ),
        (
            {**one_event(kill="straggler"), "detectors": {"straggler_window": 0}},
            "detectors.straggler_window: Input should be greater than 0",
        ),
        (
            {
                **one_event(kill="straggler"),
                "architecture": "fsdp",
                "detectors": {"straggler_action": "replace"},
            },
            "detectors.straggler_action=replace: fsdp's collectives are torch's own",
        ),
        (
            one_event(kill="bitflip", kill_params={"param": 10}),
            "failures.events[0].kill_params.param=10: the model has 10 parameter tensors; use 0..9",
        ),
        (
            one_event(kill="nan", kill_params={"param": 9, "element": 10}),
            "kill_params.element=10: parameter 9 has 10 elements; use 0..9",
        ),
    ],
)
def test_bad_fault_parameters_get_one_line_that_says_what_to_change(
    data: dict[str, Any], says: str
) -> None:
    with pytest.raises(SpecError) as err:
        resolve(parse_spec(data))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_heartbeat_timeout_of_zero_is_refused() -> None:
    with pytest.raises(SpecError, match=r"detectors.heartbeat_timeout_s: Input should be greater"):
        parse_spec({"detectors": {"heartbeat_timeout_s": 0}})


def test_the_catalog_says_which_detector_finds_each_kind() -> None:
    data = catalog()
    kinds = {k["name"]: k for k in data["kill_kinds"]}
    assert set(kinds) == set(KILL_KINDS.names())
    assert {n for n, k in kinds.items() if k["detector"] == "heartbeat"} == {"hang", "gil_hang"}
    assert kinds["straggler"]["detector"] == "step_time"
    assert kinds["preempt"]["params"]["notice_s"]["default"] == 2.0
    assert {d["name"] for d in data["detectors"]} == {
        "death",
        "heartbeat",
        "step_time",
        "digest",
        "nonfinite",
    }
    assert (kinds["bitflip"]["detector"], kinds["nan"]["detector"]) == ("digest", "nonfinite")
    own = {d["name"]: set(d["params"]) for d in data["detectors"]}  # each its own setting
    assert own == {
        "death": set(),
        "heartbeat": {"heartbeat_timeout_s"},
        "step_time": {"straggler_factor", "straggler_window", "straggler_action"},
        "digest": {"digest_every"},
        "nonfinite": {"nonfinite_every"},
    }


def _trial(status: str, exact: bool | None, *failures: tuple[str, str, float]) -> TrialResult:
    return TrialResult(
        trial=0,
        status=status,
        step_time_s=None,
        overhead_pct=None,
        final_loss=None,
        params_digest=None,
        matches_baseline=exact,
        match_expected=exact is not None,
        failures=[
            FailureResult(
                ranks=[1],
                kill_kind=kind,
                trigger="step=3",
                injected_at_step=3,
                restored_from_step=0,
                lost_steps=3,
                quiesce="abort",
                restore_source="checkpoint",
                detector=detector,
                phases=PhaseTimes(detected_s=detected),
            )
            for kind, detector, detected in failures
        ],
    )


def test_the_report_says_which_mechanism_recovered_from_which_kind() -> None:
    a = ExperimentResult(
        experiment_id="a",
        status="completed",
        spec={},
        baseline=None,
        trials=[
            _trial("completed", True, ("hang", "heartbeat", 1.6)),
            _trial("completed", False, ("hang", "heartbeat", 1.8)),
            _trial("failed", None, ("hang", "heartbeat", 2.0), ("sigkill", "death", 0.01)),
            _trial("completed", True, ("bitflip", "digest", 0.4)),
            _trial("completed", False).model_copy(
                update={"silently_diverged": [{"kind": "bitflip", "ranks": [1], "step": 3}]}
            ),
        ],
    )
    rows = kinds_report.kind_rows([("disk_ckpt", a)])
    assert [(r.mechanism, r.kind, r.trials, r.completed) for r in rows] == [
        ("disk_ckpt", "bitflip", 2, 2),
        ("disk_ckpt", "hang", 3, 2),
        ("disk_ckpt", "sigkill", 1, 0),
    ]
    head, body = kinds_report.table(rows)
    assert head[-1] == "silently diverged"
    assert body[0] == ["disk_ckpt", "bitflip", "digest", "0.400", "2/2", "1/2", "1/2"]
    assert body[1] == ["disk_ckpt", "hang", "heartbeat", "1.800", "2/3", "1/2", "-"]
    assert body[2][-2] == "not expected"


# -- end to end: real faults on real Ray actors -------------------------------------------------


def small(**over: Any) -> dict[str, Any]:
    """test_engine's small ddp job, on 2 ranks, with a group timeout a hang cannot hide behind
    (the heartbeat must find it, not this)."""
    base = {"world_size": 2, "steps": 40, "batch_size": 16, "pg_timeout_s": 300}
    return engine_small(**{**base, **over})


@pytest.fixture(scope="module")
def shared(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Database, dict[str, str]]]:
    """One database for the module, and the first experiment of each baseline key: the cells
    differ only in their failure, so they share one matched no-fault run."""
    path = tmp_path_factory.mktemp("faults") / "faults.db"
    db = Database(f"sqlite:///{path}")
    yield db, {}
    db.dispose()


def run(
    shared: tuple[Database, dict[str, str]], spec_data: dict[str, Any], tmp_path: Path
) -> ExperimentResult:
    from failbench_ray.runner import baseline_key

    db, baselines = shared
    spec = parse_spec(spec_data)
    key = baseline_key(spec)
    result = run_experiment(spec, db=db, out_dir=tmp_path / "runs", baseline_of=baselines.get(key))
    baselines.setdefault(key, result.experiment_id)
    with db.session() as s:
        assert repo.load_result(s, result.experiment_id) == result
    return result


def recovered_from(result: ExperimentResult, kind: str, detector: str, rank: int = 1) -> Any:
    trial = result.trials[0]
    assert trial.status == "completed", trial.error
    (f,) = trial.failures
    assert (f.kill_kind, f.ranks, f.detector) == (kind, [rank], detector)
    assert f.phases.detected_s is not None and f.phases.restored_s is not None
    assert f.restore_source.startswith("checkpoint")
    # The oracle: rolled back to a checkpoint and replayed, bit for bit the baseline.
    assert trial.matches_baseline is True
    return f


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("kind", ["segfault", "abort", "exception"])
def test_a_fault_inside_the_worker_is_a_death_and_is_recovered(
    shared: tuple[Database, dict[str, str]], tmp_path: Path, kind: str
) -> None:
    f = recovered_from(
        run(shared, small(**one_event(kill=kind, at_step=12)), tmp_path), kind, "death"
    )
    assert (f.injected_at_step, f.restored_from_step) == (12, 10)


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("kind", ["hang", "gil_hang"])
def test_a_hang_is_found_by_the_heartbeat_ended_and_recovered(
    shared: tuple[Database, dict[str, str]], tmp_path: Path, kind: str
) -> None:
    """The rank lives and holds its sockets; its peer waits in the all-reduce (for 300 s, the
    process group's timeout). The heartbeat finds it, the driver ends it, disk_ckpt recovers."""
    f = recovered_from(
        run(shared, small(**one_event(kill=kind, at_step=12)), tmp_path), kind, "heartbeat"
    )
    assert f.restored_from_step == 10
    # Found after the heartbeat's timeout (1.5 s by default), not the group's 300 s.
    assert 1.5 <= f.phases.detected_s < 60


@pytest.mark.usefixtures("no_leaks")
def test_a_preemption_notice_is_saved_on_and_the_kill_rolls_back_only_to_it(
    shared: tuple[Database, dict[str, str]], tmp_path: Path
) -> None:
    """disk_ckpt with no checkpoint on its schedule in the whole trial: the only checkpoint is
    the one every rank saves on the notice, before the SIGTERM lands."""
    spec = small(
        steps=1200,  # ~3 ms a step: the trial outlasts the notice by seconds
        mechanism={"name": "disk_ckpt", "params": {"interval": 10_000}},
        **one_event(kill="preempt", at_step=5, kill_params={"notice_s": 0.5, "grace_s": 1.0}),
    )
    f = recovered_from(run(shared, spec, tmp_path), "preempt", "death")
    assert f.restored_from_step is not None and f.restored_from_step > 5
    assert f.injected_at_step > f.restored_from_step  # struck after the save, not at the notice


@pytest.mark.usefixtures("no_leaks")
def test_a_hung_pipeline_stage_is_found_and_recovered(
    shared: tuple[Database, dict[str, str]], tmp_path: Path
) -> None:
    spec = small(
        architecture={"name": "pipeline", "params": {"schedule": "1f1b", "microbatches": 4}},
        **one_event(kill="hang", at_step=12),
    )
    recovered_from(run(shared, spec, tmp_path), "hang", "heartbeat")


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize(("kind", "detector"), [("bitflip", "digest"), ("nan", "nonfinite")])
def test_silent_corruption_is_found_and_rolled_back_to_state_that_passed_the_check(
    shared: tuple[Database, dict[str, str]], tmp_path: Path, kind: str, detector: str
) -> None:
    """The victim trains on after the fault. The digest check (every 10 steps) finds the two
    replicas apart at step 20; the NaN spreads through the all-reduce and the non-finite check
    finds it after step 12. Every rank rolls back to the checkpoint of step 10 (not a newer
    one of the corrupt timeline) and the replay ends bit for bit the baseline."""
    f = recovered_from(
        run(shared, small(**one_event(kill=kind, at_step=12)), tmp_path), kind, detector
    )
    assert (f.injected_at_step, f.restored_from_step) == (12, 10)


@pytest.mark.usefixtures("no_leaks")
def test_an_undetected_bitflip_is_reported_as_silently_diverged(
    shared: tuple[Database, dict[str, str]], tmp_path: Path
) -> None:
    spec = small(detectors={"digest_every": None}, **one_event(kill="bitflip", at_step=12))
    trial = run(shared, spec, tmp_path).trials[0]
    assert trial.status == "completed" and trial.failures == []
    assert trial.matches_baseline is False
    assert trial.silently_diverged == [  # type: ignore[attr-defined]
        {"kind": "bitflip", "ranks": [1], "step": 12, "trigger": "step=12"}
    ]


@pytest.mark.usefixtures("no_leaks")
def test_a_bitflip_in_a_pipeline_stage_of_hybrid_is_found_by_its_replica(
    shared: tuple[Database, dict[str, str]], tmp_path: Path
) -> None:
    spec = small(
        world_size=4,
        batch_size=32,
        architecture={"name": "hybrid", "params": {"dp": 2, "pp": 2, "microbatches": 2}},
        **one_event(kill="bitflip", at_step=12, rank=3, kill_params={"param": 1}),
    )
    f = recovered_from(run(shared, spec, tmp_path), "bitflip", "digest", rank=3)
    assert f.restored_from_step == 10


@pytest.mark.usefixtures("no_leaks")
def test_jit_ckpt_rolls_back_to_its_save_on_notice_when_every_holder_of_a_shard_is_preempted(
    shared: tuple[Database, dict[str, str]], tmp_path: Path
) -> None:
    """hybrid dp 2 x pp 2: ranks 0 and 2 hold the first stage. Both are preempted: no survivor
    holds their state to checkpoint just in time, but the save on the notice does."""
    spec = small(
        world_size=4,
        batch_size=32,
        steps=250,  # ~12 ms a step: the trial outlasts the notice by seconds
        architecture={"name": "hybrid", "params": {"dp": 2, "pp": 2, "microbatches": 2}},
        mechanism="jit_ckpt",
        failures={
            "kind": "concurrent",
            "ranks": [0, 2],
            "at_step": 5,
            "kill": "preempt",
            "kill_params": {"notice_s": 0.3, "grace_s": 1.0},
        },
    )
    trial = run(shared, spec, tmp_path).trials[0]
    assert trial.status == "completed", trial.error
    (f,) = trial.failures
    assert f.restore_source.startswith("checkpoint: no survivor holds"), f.restore_source
    assert f.restored_from_step is not None and 5 < f.restored_from_step < f.injected_at_step
    assert trial.matches_baseline is True


def straggler_job(**detectors: Any) -> dict[str, Any]:
    """Steps long enough (a few ms of work each) for a 10 ms throttle cycle to show; rank 1
    runs 5 times slower from step 40 (the detector has learnt every rank's time by then)."""
    return small(
        steps=110,
        model={"kind": "mlp", "input_dim": 64, "hidden_dim": 256, "depth": 4},
        batch_size=64,
        detectors={"straggler_factor": 2.5, **detectors},
        **one_event(
            kill="straggler",
            at_step=40,
            kill_params={"factor": 5, "duration_s": 600, "period_s": 0.01},
        ),
    )


@pytest.mark.usefixtures("no_leaks")
def test_a_straggler_is_flagged_by_its_step_time_and_training_goes_on_at_its_pace(
    shared: tuple[Database, dict[str, str]], tmp_path: Path
) -> None:
    trial = run(shared, {**straggler_job(), "baseline": False}, tmp_path).trials[0]
    assert trial.status == "completed", trial.error
    assert trial.failures == []  # flagged, not failed
    (flag,) = trial.stragglers  # type: ignore[attr-defined]
    assert (flag["rank"], flag["kind"], flag["action"]) == (1, "straggler", "flag")
    assert flag["ratio"] >= 2.5 and 40 < flag["step"] <= 110
    assert 0 < flag["detected_s"] < 30


@pytest.mark.usefixtures("no_leaks")
def test_a_straggler_set_to_be_replaced_is_recovered_like_a_crash(
    shared: tuple[Database, dict[str, str]], tmp_path: Path
) -> None:
    """With straggler_action: replace the slow rank is ended when found and disk_ckpt
    restores it from its last checkpoint; a slow rank computes right, so the result is exact."""
    result = run(shared, straggler_job(straggler_action="replace"), tmp_path)
    f = recovered_from(result, "straggler", "step_time")
    assert f.restored_from_step is not None and f.restored_from_step >= 40
    assert 0 < f.phases.detected_s < 30
