"""Recovery plans, state layouts, checkpoint files, and the chaos injector's schedule.

All without Ray: `plan()` is pure, the layouts are plain dataclasses, the checkpoint files are
real files under tmp_path, and `Chaos` is the plain class the chaos actor wraps.
"""

from __future__ import annotations

import dataclasses
import pickle
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from architectures.base import NoParams as ArchNoParams
from architectures.base import StateLayout, Trainer
from architectures.ddp import DDP
from failbench_ray.errors import RecoveryError
from failbench_ray.replication import pack
from failbench_ray.spec import ExperimentSpec, parse_spec
from injector.chaos import Chaos
from mechanisms import checkpoint_io as io
from mechanisms import sources
from mechanisms.base import FailureContext, HookContext, NoParams, RestoreInstruction
from mechanisms.disk_ckpt import DiskCkpt, DiskCkptHooks, DiskCkptParams
from mechanisms.none import NoFT


def ddp_layout(world_size: int) -> StateLayout:
    spec = parse_spec({"world_size": world_size, "batch_size": 8 * world_size})
    return DDP(spec, ArchNoParams()).layout()


# A sharded layout by hand: shards 0 and 1 held twice (interleaved), shard 2 by ranks 4, 5.
SHARDED = StateLayout(
    shard_of_rank=(0, 1, 0, 1, 2, 2),
    holds=("shard 1/3", "shard 2/3", "shard 1/3", "shard 2/3", "shard 3/3", "shard 3/3"),
)


def ctx(dead: set[int], latest: int | None, layout: StateLayout | None = None) -> FailureContext:
    layout = layout or ddp_layout(4)
    return FailureContext(
        world_size=layout.world_size,
        dead=frozenset(dead),
        layout=layout,
        committed_step=24,
        failure_step=25,
        quiesce="abort",
        latest_checkpoint=latest,
    )


@pytest.fixture
def spec() -> ExperimentSpec:
    return parse_spec({"world_size": 4, "mechanism": "disk_ckpt"})


# ---------------------------------------------------------------------------------------------
# State layouts


def test_ddp_layout_is_one_replica_group() -> None:
    layout = ddp_layout(4)
    assert layout.world_size == 4
    assert layout.shard_of_rank == (0, 0, 0, 0)
    assert layout.holds == ("full replica",) * 4
    assert layout.shard_ids() == [0]
    assert layout.replica_groups() == [[0, 1, 2, 3]]
    assert layout.writer_of(0) == 0
    assert layout.orphaned_shards({1, 3}) == []
    assert layout.orphaned_shards({0, 1, 2}) == []
    assert layout.orphaned_shards({0, 1, 2, 3}) == [0]
    assert layout.orphaned_shards(set()) == []


def test_sharded_layout() -> None:
    assert SHARDED.world_size == 6
    assert SHARDED.shard_ids() == [0, 1, 2]
    assert SHARDED.replica_groups() == [[0, 2], [1, 3], [4, 5]]
    assert [SHARDED.writer_of(s) for s in (0, 1, 2)] == [0, 1, 4]
    assert SHARDED.orphaned_shards({0}) == []
    assert SHARDED.orphaned_shards({0, 2}) == [0]
    assert SHARDED.orphaned_shards({1, 3, 4}) == [1]
    assert SHARDED.orphaned_shards({0, 1, 2, 3, 4, 5}) == [0, 1, 2]
    assert SHARDED.orphaned_shards({1, 2, 3, 4, 5}) == [1, 2]


def test_writer_is_the_lowest_holder_whatever_the_shard_numbering() -> None:
    layout = StateLayout(shard_of_rank=(2, 0, 1, 0, 2, 1), holds=("x",) * 6)
    assert layout.shard_ids() == [0, 1, 2]
    assert layout.replica_groups() == [[1, 3], [2, 5], [0, 4]]
    assert [layout.writer_of(s) for s in (0, 1, 2)] == [1, 2, 0]
    assert layout.orphaned_shards({0, 4}) == [2]


# ---------------------------------------------------------------------------------------------
# Plans


def test_none_replaces_the_dead_and_restarts_from_scratch(spec: ExperimentSpec) -> None:
    mech = NoFT(spec, NoParams())
    for latest in (None, 20):  # a checkpoint on disk changes nothing for `none`
        plan = mech.plan(ctx({3, 1}, latest))
        assert plan.replace == (1, 3)
        assert plan.source == "scratch"
        assert plan.restore_step == 0


def test_disk_ckpt_restores_the_latest_complete_checkpoint(spec: ExperimentSpec) -> None:
    mech = DiskCkpt(spec, DiskCkptParams(interval=10))
    plan = mech.plan(ctx({2}, 20))
    assert plan.replace == (2,)
    assert plan.source == "checkpoint"
    assert plan.restore_step == 20
    plan = mech.plan(ctx({5, 0, 4}, 30, SHARDED))
    assert plan.replace == (0, 4, 5)
    assert (plan.source, plan.restore_step) == ("checkpoint", 30)


def test_disk_ckpt_without_a_checkpoint_starts_from_scratch(spec: ExperimentSpec) -> None:
    plan = DiskCkpt(spec, DiskCkptParams(interval=10)).plan(ctx({0, 1}, None))
    assert plan.replace == (0, 1)
    assert (plan.source, plan.restore_step) == ("scratch", 0)


def test_exact_match_is_expected_on_ddp(spec: ExperimentSpec) -> None:
    arch = DDP(spec, ArchNoParams())
    assert NoFT(spec, NoParams()).match_expected(arch) is True
    assert DiskCkpt(spec, DiskCkptParams()).match_expected(arch) is True
    assert NoFT(spec, NoParams()).not_applicable(arch) is None
    assert DiskCkpt(spec, DiskCkptParams()).not_applicable(arch) is None


def test_disk_ckpt_latest_checkpoint_reads_the_disk(spec: ExperimentSpec, tmp_path: Path) -> None:
    mech = DiskCkpt(spec, DiskCkptParams(interval=10))
    assert mech.latest_checkpoint(tmp_path, SHARDED) is None
    for shard in (0, 1, 2):
        io.save_atomic({"x": torch.ones(1)}, io.shard_path(tmp_path, 10, shard))
    for shard in (0, 2):  # step 20: shard 1 missing
        io.save_atomic({"x": torch.ones(1)}, io.shard_path(tmp_path, 20, shard))
    assert mech.latest_checkpoint(tmp_path, SHARDED) == 10
    assert mech.latest_checkpoint(tmp_path, ddp_layout(4)) == 20  # needs shard 0 only


# ---------------------------------------------------------------------------------------------
# Checkpoint files


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def save_packed(state: Any, path: Path, on_first_write: Any = lambda: None) -> tuple[int, float]:
    return io.save_packed_atomic(pack(state), path, on_first_write)


WRITERS = pytest.mark.parametrize("save", [io.save_atomic, save_packed], ids=["direct", "packed"])


@WRITERS
def test_save_then_load_round_trips_bit_exactly(save: Any, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, -3.5])
    state: dict[str, Any] = {
        "step": 20,
        "model": {
            "w": torch.randn(33, 17, generator=g),
            "w64": torch.randn(5, dtype=torch.float64, generator=g),
            "half": torch.randn(7, generator=g).to(torch.bfloat16),
            "idx": torch.arange(11),
            "special": special,
        },
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(3, generator=g)}}},
        "note": "text",
    }
    path = io.shard_path(tmp_path, 20, 0)
    nbytes, secs = save(state, path)
    assert path == tmp_path / "ckpt" / "step_00000020" / "shard_00000.pt"
    assert nbytes == path.stat().st_size > 0
    assert secs >= 0
    assert sorted(p.name for p in path.parent.iterdir()) == ["shard_00000.pt"]  # no temp left

    loaded, n_read, _ = io.load(path)
    assert n_read == nbytes
    assert loaded["step"] == 20 and loaded["note"] == "text"
    for name, t in state["model"].items():
        got = loaded["model"][name]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert bits(got) == bits(t), name
    buf = loaded["optimizer"]["state"][0]["momentum_buffer"]
    assert bits(buf) == bits(state["optimizer"]["state"][0]["momentum_buffer"])


def test_load_refuses_a_file_that_is_no_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "shard_00000.pt"
    torch.save({"x": torch.ones(1)}, path)
    with pytest.raises(ValueError, match="not a FailBench checkpoint"):
        io.load(path)


def test_latest_complete(tmp_path: Path) -> None:
    assert io.latest_complete(tmp_path, [0, 1]) is None  # no ckpt directory
    io.ckpt_root(tmp_path).mkdir()
    assert io.latest_complete(tmp_path, [0, 1]) is None  # empty
    for step in (10, 20, 100):
        for shard in (0, 1):
            io.save_atomic({"step": step}, io.shard_path(tmp_path, step, shard))
    assert io.latest_complete(tmp_path, [0, 1]) == 100  # numeric, not the first listed
    # step 200: shard 0 written, shard 1 only a stray temp file of a killed writer
    io.save_atomic({"step": 200}, io.shard_path(tmp_path, 200, 0))
    stray = io.shard_path(tmp_path, 200, 1).with_name(".shard_00001.pt.tmp.123")
    stray.write_bytes(b"torn")
    # and things that are no step at all
    (io.ckpt_root(tmp_path) / "step_300").mkdir()
    (io.ckpt_root(tmp_path) / "step_00000400.old").mkdir()
    (io.ckpt_root(tmp_path) / "notes.txt").write_text("x")
    assert io.latest_complete(tmp_path, [0, 1]) == 100
    assert io.latest_complete(tmp_path, [0]) == 200


@WRITERS
def test_a_kill_in_the_middle_of_a_write_leaves_the_previous_checkpoint(
    save: Any, tmp_path: Path
) -> None:
    old = {"step": 10, "w": torch.full((64, 64), 1.0)}
    save(old, io.shard_path(tmp_path, 10, 0))

    calls: list[int] = []

    def killed() -> None:
        calls.append(1)
        raise RuntimeError("killed in the middle of the write")

    path = io.shard_path(tmp_path, 20, 0)
    with pytest.raises(RuntimeError, match="killed"):
        save({"step": 20, "w": torch.full((64, 64), 2.0)}, path, on_first_write=killed)
    assert calls == [1]
    assert not path.exists()
    assert all(p.name.startswith(".shard_00000.pt.tmp.") for p in path.parent.iterdir())
    assert io.latest_complete(tmp_path, [0]) == 10
    state, _, _ = io.load(io.shard_path(tmp_path, 10, 0))
    assert torch.equal(state["w"], old["w"])


def test_a_packed_header_loads_no_foreign_class(tmp_path: Path) -> None:
    path = io.shard_path(tmp_path, 5, 0)
    save_packed({"w": torch.ones(3), "bad": Path("/etc")}, path)
    with pytest.raises(pickle.UnpicklingError, match="may not hold pathlib"):
        io.load(path)


def test_a_checkpoint_written_before_the_backend_moved_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files written while the backend was `mechanisms.replication` name that module for the
    slots in their header; they load as they did then."""

    @dataclasses.dataclass(frozen=True)
    class _Slot:  # the old module's slot, as pickle names it
        index: int

    old = types.ModuleType("mechanisms.replication")
    _Slot.__module__, _Slot.__qualname__ = old.__name__, "_Slot"
    old._Slot = _Slot  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, old.__name__, old)
    packed = pack({"w": torch.arange(6.0), "step": 5})
    packed.skeleton["w"] = _Slot(packed.skeleton["w"].index)
    path = io.shard_path(tmp_path, 5, 0)
    io.save_packed_atomic(packed, path)
    assert b"mechanisms.replication" in path.read_bytes()
    monkeypatch.delitem(sys.modules, old.__name__)
    state, _, _ = io.load(path)
    assert torch.equal(state["w"], torch.arange(6.0)) and state["step"] == 5


@WRITERS
def test_on_first_write_is_called_once(save: Any, tmp_path: Path) -> None:
    calls: list[int] = []
    save(
        {"w": torch.zeros(100_000)},
        io.shard_path(tmp_path, 1, 0),
        on_first_write=lambda: calls.append(1),
    )
    assert calls == [1]


# ---------------------------------------------------------------------------------------------
# Disk checkpoint hooks (worker side) with a real, tiny trainer


class TinyTrainer(Trainer):
    """A real single-process trainer: a linear layer and SGD with momentum."""

    def __init__(self, seed: int) -> None:
        super().__init__(ctx=None)  # type: ignore[arg-type]  # no process group needed
        with torch.random.fork_rng(devices=[]):  # leave the global RNG alone
            torch.manual_seed(seed)
            self.module = nn.Linear(4, 3)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1, momentum=0.9)

    def train_step(self, step: int) -> Any:
        x = torch.full((2, 4), float(step))
        self.optimizer.zero_grad()
        self.module(x).square().mean().backward()
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def parameters_digest(self) -> str:
        return ""


def hooks(
    rank: int, layout: StateLayout, run_dir: Path, interval: int = 5, failpoint: Any = None
) -> DiskCkptHooks:
    kwargs = {"failpoint": failpoint} if failpoint is not None else {}
    return DiskCkptHooks(
        HookContext(rank, layout, run_dir, DiskCkptParams(interval=interval), **kwargs)
    )


def test_non_writer_rank_writes_nothing(tmp_path: Path) -> None:
    trainer = TinyTrainer(0)
    layout = ddp_layout(4)
    for rank in (1, 2, 3):
        assert hooks(rank, layout, tmp_path).after_step(5, trainer) == []
    assert not io.ckpt_root(tmp_path).exists()
    # rank 2 holds shard 0 of the sharded layout, but rank 0 writes it
    assert hooks(2, SHARDED, tmp_path).after_step(5, trainer) == []
    assert not io.ckpt_root(tmp_path).exists()


def test_writer_saves_on_the_interval_only_and_restores(tmp_path: Path) -> None:
    failpoints: list[tuple[str, int]] = []
    writer = hooks(0, ddp_layout(2), tmp_path, failpoint=lambda w, s: failpoints.append((w, s)))
    trainer = TinyTrainer(0)
    for step in range(1, 11):
        trainer.train_step(step)
        events = writer.after_step(step, trainer)
        if step % 5:
            assert events == []
        else:
            (event,) = events
            path = io.shard_path(tmp_path, step, 0)
            assert (event.rank, event.step, event.kind, event.path) == (0, step, "save", str(path))
            assert event.nbytes == path.stat().st_size
        if step == 5:
            at_5 = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    assert failpoints == [("checkpoint_write", 5), ("checkpoint_write", 10)]
    assert io.latest_complete(tmp_path, [0]) == 10

    # a replacement rank 1 restores step 5 into a trainer built from another seed
    fresh = TinyTrainer(1)
    reader = hooks(1, ddp_layout(2), tmp_path)
    (event,) = sources.load(RestoreInstruction("checkpoint", 5), reader.ctx, fresh)
    assert (event.rank, event.step, event.kind) == (1, 5, "restore")
    for name, t in fresh.module.state_dict().items():
        assert torch.equal(t, at_5[name]), name
    assert fresh.optimizer.state_dict()["state"]  # the momentum buffers came back too

    # scratch: nothing loaded
    other = TinyTrainer(2)
    before = {k: v.clone() for k, v in other.module.state_dict().items()}
    assert sources.load(RestoreInstruction("scratch", 0), reader.ctx, other) == []
    assert all(torch.equal(v, before[k]) for k, v in other.module.state_dict().items())


def test_sharded_writers_write_their_own_shard(tmp_path: Path) -> None:
    trainer = TinyTrainer(0)
    for rank in range(SHARDED.world_size):
        hooks(rank, SHARDED, tmp_path).after_step(5, trainer)
    step_dir = io.shard_path(tmp_path, 5, 0).parent
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "shard_00000.pt",
        "shard_00001.pt",
        "shard_00002.pt",
    ]
    assert io.latest_complete(tmp_path, SHARDED.shard_ids()) == 5


def test_failpoint_during_checkpoint_write_leaves_no_checkpoint(tmp_path: Path) -> None:
    class Killed(Exception):
        pass

    def failpoint(where: str, step: int) -> None:
        if (where, step) == ("checkpoint_write", 10):
            raise Killed

    writer = hooks(0, ddp_layout(2), tmp_path, failpoint=failpoint)
    trainer = TinyTrainer(0)
    assert len(writer.after_step(5, trainer)) == 1
    with pytest.raises(Killed):
        writer.after_step(10, trainer)
    assert not io.shard_path(tmp_path, 10, 0).exists()
    assert (
        DiskCkpt(parse_spec({}), DiskCkptParams()).latest_checkpoint(tmp_path, ddp_layout(2)) == 5
    )


def test_a_restore_from_a_donor_needs_one_for_the_shard(tmp_path: Path) -> None:
    h = NoFT.hooks_cls(HookContext(0, ddp_layout(2), tmp_path, NoParams()))
    trainer = TinyTrainer(0)
    assert h.after_step(5, trainer) == []
    assert sources.load(RestoreInstruction("scratch", 0), h.ctx, trainer) == []
    with pytest.raises(RecoveryError, match="no donor for shard 0 at step 5"):
        sources.load(RestoreInstruction("replica", 5), h.ctx, trainer)


# ---------------------------------------------------------------------------------------------
# The chaos injector (the plain class; only `exit` kills, or kills of our own sleep processes)


def test_single_exit_event_fires_when_the_victim_arrives() -> None:
    chaos = Chaos([{"ranks": [1], "at_step": 3, "kill": "exit"}])
    assert chaos.fired() == []
    t0 = time.time()
    assert chaos.reached(0, 1, 3) == "exit"
    (inj,) = chaos.injections()
    assert inj.index == 0
    assert inj.ranks == [1]
    assert inj.kill_kind == "exit"
    assert inj.trigger == "step=3"
    assert inj.step == 3
    assert t0 <= inj.t_injected <= time.time()
    assert chaos.fired() == [0]


def test_concurrent_event_waits_for_every_victim() -> None:
    chaos = Chaos([{"ranks": [1, 2], "at_step": 5, "kill": "exit"}])
    answers: list[str] = []
    first = threading.Thread(target=lambda: answers.append(chaos.reached(0, 1, 5)))
    first.start()
    time.sleep(0.2)
    assert first.is_alive() and chaos.fired() == []  # rank 1 waits for rank 2
    assert chaos.reached(0, 2, 5) == "exit"
    first.join(timeout=5)
    assert answers == ["exit"]
    (inj,) = chaos.injections()
    assert inj.ranks == [1, 2]


def test_sigkill_kills_exactly_the_targets() -> None:
    procs = {rank: subprocess.Popen(["sleep", "60"]) for rank in range(3)}
    try:
        chaos = Chaos([{"ranks": [0, 2], "at_step": 4, "kill": "sigkill"}])
        chaos.set_targets({rank: (p.pid, None) for rank, p in procs.items()})
        answers: list[str] = []
        t = threading.Thread(target=lambda: answers.append(chaos.reached(0, 0, 4)))
        t.start()
        time.sleep(0.1)
        assert procs[0].poll() is None  # nobody is killed before every victim arrived
        assert chaos.reached(0, 2, 4) == "go"  # the chaos actor kills; the victim need not
        t.join(timeout=5)
        assert answers == ["go"]
        assert procs[0].wait(timeout=5) == -signal.SIGKILL
        assert procs[2].wait(timeout=5) == -signal.SIGKILL
        assert procs[1].poll() is None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=5)


def test_cascading_events_fire_in_order_on_their_phase() -> None:
    chaos = Chaos(
        [
            {"ranks": [0], "at_step": 5, "kill": "exit"},
            {"ranks": [1], "during": "restoring", "kill": "exit"},
            {"ranks": [2], "during": "reforming", "kill": "exit"},
        ]
    )
    assert chaos.on_phase("restoring", 4) == []  # event 0 has not fired yet
    assert chaos.reached(0, 0, 5) == "exit"
    assert chaos.on_phase("quiescing", 4) == []
    assert chaos.on_phase("reforming", 4) == []  # event 2 waits for event 1
    (inj,) = chaos.on_phase("restoring", 4)
    assert (inj.index, inj.ranks, inj.step) == (1, [1], 4)
    assert inj.trigger == "during=restoring"
    assert chaos.on_phase("restoring", 4) == []  # fires once
    (inj,) = chaos.on_phase("reforming", 4)
    assert inj.index == 2
    assert chaos.fired() == [0, 1, 2]


def test_time_triggered_event() -> None:
    chaos = Chaos([{"ranks": [3], "at_seconds": 0.05, "kill": "exit"}])
    chaos.start()
    try:
        deadline = time.time() + 5
        while not chaos.fired() and time.time() < deadline:
            time.sleep(0.01)
        (inj,) = chaos.injections()
        assert inj.step is None
        assert inj.trigger == "t=0.05s"
        # the victim is told to end itself when it next reaches a failpoint
        assert chaos.reached(0, 3, 9) == "exit"
        assert len(chaos.injections()) == 1
    finally:
        chaos.stop()


def test_stopped_timer_does_not_fire() -> None:
    chaos = Chaos([{"ranks": [0], "at_seconds": 0.2, "kill": "exit"}])
    chaos.start()
    chaos.stop()
    time.sleep(0.4)
    assert chaos.fired() == []


def test_kill_during_checkpoint_write_event() -> None:
    chaos = Chaos([{"ranks": [0], "at_step": 20, "during": "checkpoint_write", "kill": "exit"}])
    assert chaos.events[0].worker_point == ("checkpoint_write", 20)
    assert chaos.reached(0, 0, 20) == "exit"
    assert chaos.injections()[0].trigger == "during=checkpoint_write@20"
