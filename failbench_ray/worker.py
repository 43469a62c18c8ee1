"""The training worker actor: one rank. Runs steps, hooks of the mechanism, and failpoints.

Threaded: the default group's threads run `run()` (the training thread), the driver's calls
(`abort()`, `progress()`, ...) so the driver can pull a rank out of a dead collective, and
peers' requests (a parameter server's push and pull).
Replication has groups of its own: `pull` waits on another worker's `snapshot_for`, so if both
shared one thread pool, a ring of ranks each pulling from its predecessor could take every
thread and wait on each other forever. `serve` methods never wait on another actor; `pull` only
waits on `serve` methods, so the waits cannot form a cycle.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import random
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from architectures import ARCHITECTURES
from architectures.base import Trainer, WorkerContext
from failbench_ray.comm import (
    AbortHandle,
    CollectiveAborted,
    Generations,
    JoinTimes,
    StoreAddress,
)
from failbench_ray.identity import ActorId
from failbench_ray.records import CheckpointEvent, StepRecord
from failbench_ray.replication import Packed, ReplicaStore, unpack
from failbench_ray.spec import ExperimentSpec
from failbench_ray.telemetry import Recorder
from failbench_ray.worker_copies import HoldsCopies
from failbench_ray.worker_faults import TakesFaults
from failbench_ray.worker_reuse import Reusable
from injector.kill_kinds import InjectedException
from mechanisms import MECHANISMS
from mechanisms.base import HookContext, Hooks, RestoreInstruction


@dataclass(frozen=True)
class JoinInfo:
    generation: int
    store_host: str
    store_port: int
    members: tuple[int, ...]  # live logical ranks; a rank's place in it is its group rank
    backend: str
    device: str
    peers: dict[int, Any] = field(default_factory=dict)  # rank -> actor handle, this generation
    holders: dict[ActorId, Any] = field(default_factory=dict)  # replica holders, hot spares


@dataclass
class RunReport:
    """What `run()` returns: how it ended and what it recorded."""

    rank: int
    status: str  # "completed" or "aborted"
    last_step: int  # last step whose update was applied
    records: list[StepRecord] = field(default_factory=list)
    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    reason: str = ""
    t_returned: float = 0.0
    # "corrupt": the last step whose state passed this rank's checks (the rollback bound).
    clean_step: int | None = None


def record_log_path(run_dir: Path, pid: int) -> Path:
    return run_dir / "records" / f"pid{pid}.jsonl"


def open_record_log(run_dir: Path, pid: int) -> Any:
    path = record_log_path(run_dir, pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", buffering=1)  # line-buffered: one write() per record


def read_record_log(run_dir: Path, pid: int) -> tuple[list[StepRecord], list[CheckpointEvent]]:
    """The step records and checkpoint events a (dead) worker process logged; a torn last line
    is skipped."""
    records: list[StepRecord] = []
    events: list[CheckpointEvent] = []
    try:
        lines = record_log_path(run_dir, pid).read_text().splitlines()
    except FileNotFoundError:
        return records, events
    for line in lines:
        try:
            kind, *fields = json.loads(line)
            if kind == "step":
                records.append(StepRecord(*fields))
            else:
                events.append(CheckpointEvent(*fields))
        except (ValueError, TypeError):
            continue
    return records, events


class Worker(HoldsCopies, Reusable, TakesFaults):
    """One rank, or (rank -1) a hot spare that mirrors state until it takes a dead rank's place.

    Besides training, every worker can hold copies of other ranks' state and hand out its own
    snapshots and live state (`HoldsCopies`, worker_copies.py), and can shed a trial for the
    pool to reuse it (`Reusable`, worker_reuse.py).
    """

    def __init__(
        self,
        rank: int = -1,
        spec: dict[str, Any] | None = None,
        run_dir: str = "",
        chaos: Any = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        # What a fresh interpreter starts with, so a pooled process can start each trial
        # from exactly that (`configure`); models and data seed their own generators.
        self._fresh_rng = (random.getstate(), torch.get_rng_state(), torch.get_num_threads())
        self._lock = threading.Lock()
        self._running = False  # the training thread is inside run()
        self._log: Any = None
        self.generations = Generations()
        self._handles: list[AbortHandle] = []  # every generation's, to see stale collectives
        self.trial = ""
        if spec is not None:
            self.configure(rank, spec, run_dir, chaos, tags)

    def configure(
        self,
        rank: int,
        spec: dict[str, Any],
        run_dir: str,
        chaos: Any,
        tags: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Become `rank` (-1: a hot spare) of a trial: everything a trial's worker holds is
        made here, so a pooled process serves each trial as a fresh one would. Returns what
        `ready()` returns."""
        self.spec = ExperimentSpec.model_validate(spec)
        rng, torch_rng, threads = self._fresh_rng
        random.setstate(rng)
        torch.set_rng_state(torch_rng)
        torch.set_num_threads(threads)
        tags = tags or {}
        self.trial = f"{tags['experiment'][:8]}-{tags['trial']}" if "trial" in tags else ""
        # Live metrics (`failbench_ray.telemetry`), labelled with the run and this rank.
        self.metrics = Recorder({**tags, "rank": str(rank)}, enabled=self.spec.metrics)
        torch.set_num_threads(self.spec.threads_per_worker)
        arch_cls = ARCHITECTURES.get(self.spec.architecture.name)
        self.arch = arch_cls(
            self.spec, arch_cls.Params.model_validate(self.spec.architecture.params)
        )
        mech_cls = MECHANISMS.get(self.spec.mechanism.name)
        self.mech = mech_cls(self.spec, mech_cls.Params.model_validate(self.spec.mechanism.params))
        self.layout = self.arch.layout()
        if self.spec.reform == "fast":  # a ready process has everything a rank imports
            for module in self.arch.preload:
                importlib.import_module(module)
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.hooks = self._make_hooks(rank)
        self.replicas = ReplicaStore(keep=2)  # copies of other ranks' state this process owns
        self.snapshots: dict[int, Packed] = {}  # this rank's own snapshots, by step
        self.targets: list[Any] = []  # who pulls this rank's snapshots
        self.holder_lost: str | None = None  # a holder died while this rank waited on it
        self.holders: dict[ActorId, Any] = {}
        self.me: Any = None  # this actor's own handle (holders call back on it)
        self.chaos = chaos
        self._peers: dict[int, Any] = {}
        self.abort_handle = AbortHandle()
        self.trainer: Trainer | None = None
        self._restored = False  # the current trainer holds this rank's real state
        self.previous: Trainer | None = None  # last generation's trainer, for state handover
        self.generation = -1
        self.step = 0
        self._reset_faults()
        self._records: list[StepRecord] = []
        self._checkpoints: list[CheckpointEvent] = []
        # Every record also goes to a per-process file as the step ends: a SIGKILL loses the
        # records this rank had not handed over yet, but not what the kernel already holds.
        self._log = open_record_log(self.run_dir, os.getpid())
        if self.trial:
            print(f"now rank {rank} of {self.trial}", flush=True)  # the actor's log says whose
        return self.ready()

    def _make_hooks(self, rank: int) -> Hooks:
        ctx = HookContext(
            rank, self.layout, self.run_dir, self.mech.params, self._failpoint, self._emit
        )
        ctx.publish = self._publish
        return self.mech.hooks_cls(ctx)

    # -- served on the extra threads ------------------------------------------------------
    def ready(self) -> dict[str, Any]:
        self.me = ray.get_runtime_context().current_actor
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def adopt(self, rank: int) -> None:
        """A hot spare takes the place of dead `rank` (its mirror stays for the restore)."""
        self.rank = rank
        self.metrics.set_tag("rank", str(rank))
        self.hooks = self._make_hooks(rank)

    def abort(self) -> None:
        self.abort_handle.abort()

    def kill_node(self) -> None:
        """Fail this actor's whole Ray node: SIGKILL its raylet (this worker's parent process).
        Every worker on the node dies with it; the chaos actor calls this for a `node` kill."""
        raylet = os.getppid()
        if raylet <= 1:
            raise RuntimeError("this worker's parent is not a raylet: cannot fail its node")
        os.kill(raylet, signal.SIGKILL)
        os._exit(1)

    def identity(self) -> dict[str, Any]:
        """Whose rank this process is now (a pooled process's actor name does not say)."""
        return {"rank": getattr(self, "rank", -1), "trial": self.trial, "pid": os.getpid()}

    def serve_peer(self, request: Any) -> Any:
        """Hand a peer's request (the architecture's own typed message, e.g. a parameter
        server's push or pull) to this rank's trainer, on one of the actor's extra threads."""
        assert self.trainer is not None, "join() before serving peers"
        return self.trainer.serve(request)

    def drain(self) -> tuple[list[StepRecord], list[CheckpointEvent]]:
        """Hand over the records kept so far (also from the second thread, e.g. before a kill)."""
        with self._lock:
            records, self._records = self._records, []
            checkpoints, self._checkpoints = self._checkpoints, []
        return records, checkpoints

    # -- the training thread --------------------------------------------------------------
    def join(self, info: JoinInfo) -> JoinTimes:
        """Enter a new process-group generation and build a fresh trainer in it."""
        self.abort_handle = AbortHandle()
        self._handles.append(self.abort_handle)
        group, times = self.generations.join(
            generation=info.generation,
            store=self._store(info.store_host, info.store_port),
            rank=info.members.index(self.rank),
            world_size=len(info.members),
            backend=info.backend,
            device=info.device,
            timeout_s=self.spec.pg_timeout_s,
            own_ip=ray.util.get_node_ip_address(),
        )
        ctx = WorkerContext(
            spec=self.spec,
            params=self.arch.params,
            rank=self.rank,
            world_size=self.spec.world_size,
            device=torch.device(info.device),
            members=info.members,
            peers=info.peers,
            group=group,
            abort=self.abort_handle,
        )
        if self.mech.rebalances_data:
            ctx.data_index, ctx.data_count = ctx.group_rank, len(info.members)
        self._peers = dict(info.peers)
        self.set_holders(info.holders, info.members)
        if self.trainer is not None and self._restored:
            self.previous = self.trainer  # this rank's state, handed over at restore()
        # else a recovery was cut short before this rank's restore: keep the older state
        self.trainer, self._restored = self.arch.trainer(ctx), False
        self.generation = info.generation
        return dataclasses.replace(times, built=time.time())

    def reach(self, generation: int, store_host: str, store_port: int, world_size: int) -> float:
        """Leave the dead group and count in at the next generation's rendezvous ahead of the
        join (the fast re-formation: while the replacements start). Returns when."""
        return self.generations.reach(
            generation=generation,
            store=self._store(store_host, store_port),
            world_size=world_size,
            own_ip=ray.util.get_node_ip_address(),
        )

    def _store(self, host: str, port: int) -> StoreAddress:
        return StoreAddress(host, port, self.spec.reform_timeout_s)

    def restore(self, instruction: RestoreInstruction) -> list[CheckpointEvent]:
        """Load the state the plan names into this generation's fresh trainer."""
        assert self.trainer is not None, "join() before restore()"
        step, shard = instruction.step, self.layout.shard_of_rank[self.rank]
        if self.rank in instruction.keep:
            # "survivors": every rank goes on from where it got (gossip ranks need not agree).
            self._keep_own_state(step, exact=instruction.source != "survivors")
            events = self.hooks.donate(instruction, self.trainer)  # e.g. a just-in-time file
        else:
            local = self.snapshots.get(step) or self.replicas.local(shard, step)
            events = self.hooks.restore(instruction, self.trainer, local)
        for e in events:
            self.metrics.state_transfer(e.kind, e.nbytes, e.duration_s)
        self.previous, self._restored = None, True
        # Copies and snapshots after `step` belong to a timeline that was just rolled back.
        self.replicas.truncate(step)
        self.snapshots = {s: p for s, p in self.snapshots.items() if s <= step}
        with self._lock:
            self._save_steps.clear()
            self._audits = {s: a for s, a in self._audits.items() if s <= step}
            self._compute = {}  # steps to be replayed: timed anew
            self.step = step
        self._clean_step = step
        return events

    def _keep_own_state(self, step: int, exact: bool = True) -> None:
        assert self.trainer is not None
        if self.previous is not None and (self.step == step or not exact):
            self.trainer.load_state_dict(self.previous.state_dict())
        elif step in self.snapshots:
            self.trainer.load_state_dict(unpack(self.snapshots[step]))
        else:
            raise RuntimeError(f"rank {self.rank} has no state of step {step} to keep")

    # -- the mechanism's helpers ----------------------------------------------------------
    def _emit(self, event: CheckpointEvent) -> None:
        self.metrics.state_transfer(event.kind, event.nbytes, event.duration_s)
        with self._lock:
            self._checkpoints.append(event)

    def run(self, start: int, end: int, armed: dict[tuple[str, int], int]) -> RunReport:
        """Run steps start..end (inclusive) until done or a peer's death aborts the step."""
        assert self.trainer is not None, "join() before run()"
        self._running = True
        try:
            return self._run(start, end, armed)
        except InjectedException:
            # As a training script dies of a bug: the traceback on stderr, the process ends.
            traceback.print_exc()
            os._exit(1)
        finally:
            self._running = False

    def _run(self, start: int, end: int, armed: dict[tuple[str, int], int]) -> RunReport:
        assert self.trainer is not None
        self.armed = dict(armed)
        handle = self.abort_handle
        for step in range(start, end + 1):
            if handle.failed:
                return self._report("aborted", handle.reason())
            self._failpoint("step", step)
            t0, started = time.time(), time.monotonic()
            handle.begin_step()
            try:
                out = self.trainer.train_step(step)
            except CollectiveAborted as err:
                return self._report("aborted", str(err))
            except RuntimeError as err:
                # A collective inside torch (FSDP, DTensor, pipelining) failed: a peer died or
                # the group timed out. The driver decides; with no dead peer it is an error.
                return self._report("aborted", f"{type(err).__name__}: {err}".splitlines()[0])
            # Its own work: the step without its waits on peers (the straggler detector's input)
            self._computed(step, time.monotonic() - started - handle.take_waited())
            bad = self._audit(step)  # before the hooks: a corrupt state is never saved
            if bad is not None:
                return self._report("corrupt", bad)
            t1 = time.time()
            checkpoints = self.hooks.after_step(step, self.trainer)
            if self._save_due(step) and not checkpoints:  # (none already saved on schedule)
                checkpoints += self.hooks.save_now(step, self.trainer)
            t2 = time.time()
            record = StepRecord(
                self.rank, step, self.generation, out.loss, t0, t2, out.samples, t2 - t1
            )
            self._log.write(json.dumps(["step", *dataclasses.astuple(record)]) + "\n")
            for event in checkpoints:
                self._log.write(json.dumps(["event", *dataclasses.astuple(event)]) + "\n")
            with self._lock:
                self._records.append(record)
                self._checkpoints += checkpoints
                self.step = step
            self.metrics.step(step, out.loss, t2 - t0, out.samples, t2 - t1)
            for event in checkpoints:
                self.metrics.state_transfer(event.kind, event.nbytes, event.duration_s)
            if self.holder_lost is not None:
                reason, self.holder_lost = self.holder_lost, None
                return self._report("aborted", reason)
        self.hooks.close()
        return self._report("completed", "")

    def digest(self) -> tuple[str, int, list[float], dict[str, float]]:
        """(digest of this rank's parameters, bytes of its state, a sample of its parameters,
        the architecture's own measurements)."""
        assert self.trainer is not None
        t = self.trainer
        return t.parameters_digest(), t.state_bytes(), t.parameters_sample(), t.metrics()

    def _report(self, status: str, reason: str) -> RunReport:
        records, checkpoints = self.drain()
        clean = self._clean_step if status == "corrupt" else None
        return RunReport(
            self.rank, status, self.step, records, checkpoints, reason, time.time(), clean
        )


# Concurrency per group, see the module docstring (several sources may pull from one rank).
WorkerActor = ray.remote(max_concurrency=2, concurrency_groups={"serve": 4, "pull": 4, "beat": 1})(
    Worker
)
