"""The controller's pure parts, without Ray: the recovery timeline, the stall watchdog, the
final-state check, the callbacks, and the states' shape (each returns the next state)."""

from __future__ import annotations

import inspect

import pytest

from architectures.base import StateLayout
from failbench_ray.comm import JoinTimes
from failbench_ray.controller import states
from failbench_ray.controller.callbacks import Callbacks, TrialCallback
from failbench_ray.controller.final_check import check
from failbench_ray.controller.timeline import RecoveryTimeline, replacement
from failbench_ray.controller.watchdog import StallWatchdog
from failbench_ray.errors import RecoveryError
from failbench_ray.identity import HolderId, RankId, SpareId
from failbench_ray.records import FailureRecord
from failbench_ray.spec import Quiesce
from injector.chaos import Injection
from mechanisms.base import RecoveryPlan

DDP4 = StateLayout((0, 0, 0, 0), ("full replica",) * 4)
STAGES2 = StateLayout((0, 1), ("stage 1/2", "stage 2/2"))


def _inj(index: int, ranks: list[int], t: float, step: int | None = 7) -> Injection:
    return Injection(index, ranks, "process", f"step={step}", t, step)


def test_the_timeline_records_each_injection_once_and_times_phases_after_it() -> None:
    tl = RecoveryTimeline((Quiesce.ABORT, ""))
    new = tl.detected([_inj(0, [1], t=100.0)], dead={1}, known_dead=set(), t_detect=100.5)
    assert [(f.index, f.ranks, f.kill_kind) for f in new] == [(0, [1], "process")]
    assert new[0].phases["detected"] == 0.5 and new[0].quiesce == "abort"
    # the chaos actor's log is read again at the next detection: nothing counts twice
    assert tl.detected([_inj(0, [1], t=100.0)], {1}, {1}, 101.0) == []
    tl.quiesced(101.0, committed=6)
    tl.stamp("quiesced", 200.0)  # the first stamp of a phase stands
    assert new[0].phases["quiesced"] == 1.0
    plan = RecoveryPlan((1,), "checkpoint", 5, note="roll back")
    tl.planned(plan)
    done = tl.restored(plan, 103.0)
    assert done == new and tl.open == []
    f = done[0]
    assert (f.replacement, f.restored_from_step, f.restore_source) == (
        "cold",
        5,
        "checkpoint: roll back",
    )
    assert f.phases["restored"] == 3.0
    assert tl.failures == new


def test_a_death_no_injection_names_is_an_unplanned_failure() -> None:
    tl = RecoveryTimeline((Quiesce.KILL_SURVIVORS, "abort asked, but not abortable"))
    (f,) = tl.detected([], dead={2, 3}, known_dead={3}, t_detect=50.0)
    assert (f.ranks, f.kill_kind, f.trigger, f.injected_at_step) == ([2], "unplanned", "crash", -1)
    assert (f.quiesce, f.quiesce_reason) == ("kill_survivors", "abort asked, but not abortable")
    tl.quiesced(51.0, committed=9)
    assert f.injected_at_step == 10  # no known step: the one in flight


def test_a_failure_during_recovery_interrupts_the_open_one() -> None:
    tl = RecoveryTimeline((Quiesce.ABORT, ""))
    (first,) = tl.detected([_inj(0, [0], 10.0)], {0}, set(), 10.2)
    (second,) = tl.detected([_inj(0, [0], 10.0), _inj(1, [2], 11.0, None)], {2}, {0}, 11.1)
    assert first.interrupted_by == 1 and second.interrupted_by is None
    assert len(tl.open) == 2 and tl.failure_step(committed=4) == 7


def test_reformation_parts_end_when_the_last_rank_is_done_and_are_stamped_once() -> None:
    tl = RecoveryTimeline((Quiesce.ABORT, ""))
    (f,) = tl.detected([_inj(0, [1], t=100.0)], {1}, set(), 100.02)
    tl.reform_part("replaced", 100.1)
    tl.joined(
        {
            0: JoinTimes(100.11, 100.2, 100.25, 100.3, reached=100.05),  # reached early
            1: JoinTimes(100.12, 100.22, 100.24, 100.35, reached=100.15),  # the replacement
            2: JoinTimes(100.11, 100.2, 100.25, 100.3, reached=100.06),
        },
        replaced={1},
    )
    tl.joined({0: JoinTimes(101.0, 101.1, 101.2, 101.3)})  # a retried join: the first counts
    got = {k: round(v, 6) for k, v in f.reform.items() if v is not None}
    assert got == {
        "replaced": 0.1,
        "rendezvous": 0.22,
        "connected": 0.25,
        "collective": 0.35,
        "survivors": 0.06,
    }


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        (RecoveryPlan((1,), "peer", 3), "cold"),
        (RecoveryPlan((1,), "replica", 3, spares={1: SpareId(0)}), "warm"),
        (RecoveryPlan((1, 2), "replica", 3, spares={1: SpareId(0)}), "cold"),
        (RecoveryPlan((), "survivors", 3, drop=(1,)), "none"),
        (RecoveryPlan((), "survivors", 3, drop=(1,), grow=(1,)), "cold"),
    ],
)
def test_replacement_says_whether_standbys_took_the_ranks(
    plan: RecoveryPlan, expected: str
) -> None:
    assert replacement(plan) == expected


def test_the_watchdog_fails_a_trial_only_after_no_step_for_its_limit() -> None:
    now = [0.0]
    dog = StallWatchdog(10.0, clock=lambda: now[0])
    dog.observe({0: 1, 1: 1})
    now[0] = 9.0
    dog.observe({0: 1, 1: 1})  # still within the limit
    now[0] = 15.0
    dog.observe({0: 2, 1: 1})  # a step: the clock starts again
    now[0] = 24.0
    dog.observe({0: 2, 1: 1})
    now[0] = 25.5
    with pytest.raises(RecoveryError, match="no rank completed a step for 10 s"):
        dog.observe({0: 2, 1: 1})
    dog.restart()  # a new training phase
    now[0] = 30.0
    dog.observe({0: 2, 1: 1})


def _answer(digest: str, nbytes: int = 100) -> tuple[str, int, list[float], dict[str, float]]:
    return (digest, nbytes, [0.0], {"m": 1.0})


def test_the_final_check_digests_shards_and_catches_diverged_replicas() -> None:
    same = check(DDP4, {r: _answer("a", 100 + r) for r in range(4)}, independent_replicas=False)
    assert same.error is None and len(same.digest) == 64 and same.state_bytes_per_rank == 103
    assert same.replica_spread is None and same.arch_metrics == {"m": 1.0}
    # dropped ranks count for nothing; a stage whose every holder left is skipped
    assert check(DDP4, {0: _answer("a")}, independent_replicas=False).digest == same.digest
    assert check(STAGES2, {0: _answer("a")}, independent_replicas=False).error is None
    bad = check(DDP4, {0: _answer("a"), 1: _answer("b")}, independent_replicas=False)
    assert bad.digest == "diverged" and "shard 0 diverged across ranks [0, 1, 2, 3]" in str(
        bad.error
    )
    stages = check(STAGES2, {0: _answer("a"), 1: _answer("b")}, independent_replicas=False)
    assert stages.error is None and stages.digest != same.digest
    gossip = check(DDP4, {r: _answer("a") for r in range(4)}, independent_replicas=True)
    assert gossip.replica_spread == 0.0


class _Seen(TrialCallback):
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def after_failure(self, failure: FailureRecord) -> None:
        self.calls.append(("failure", failure.index))

    def after_progress(self, step: int) -> None:
        self.calls.append(("progress", step))


def test_callbacks_are_told_in_order_and_default_hooks_do_nothing() -> None:
    a, b = _Seen(), _Seen()
    cbs = Callbacks([a, TrialCallback(), b])
    cbs.after_progress(3)
    (f,) = RecoveryTimeline((Quiesce.ABORT, "")).detected([_inj(0, [1], 1.0)], {1}, set(), 2.0)
    cbs.after_failure(f)
    cbs.after_live_ranks(3)  # no one overrides it
    assert a.calls == b.calls == [("progress", 3), ("failure", 0)]
    # every hook of the base is forwarded by Callbacks
    hooks = {n for n, _ in inspect.getmembers(TrialCallback, inspect.isfunction)}
    assert hooks <= set(vars(Callbacks)), hooks - set(vars(Callbacks))


def test_every_state_returns_the_next_state_and_only_two_end_a_trial() -> None:
    classes = [
        c
        for c in vars(states).values()
        if inspect.isclass(c) and issubclass(c, states.TrialState) and c is not states.TrialState
    ]
    names = {c.name for c in classes}
    assert names == {
        "starting", "training", "quiescing", "reforming", "restoring", "regrowing",
        "finishing", "finished", "failed",
    }  # fmt: skip
    assert {c.name for c in classes if c.terminal} == {"finished", "failed"}
    assert states.Failed("why").run(None) == states.Failed("why")  # type: ignore[arg-type]
    assert states.Restoring(RecoveryPlan((), "survivors", 1)).plan.restore_step == 1


def test_identities_compare_by_role_and_read_as_names() -> None:
    assert (str(RankId(3)), str(HolderId(0)), str(SpareId(1))) == ("rank3", "holder0", "spare1")
    assert RankId(1) != HolderId(1) and len({RankId(1), HolderId(1), SpareId(1), RankId(1)}) == 3
