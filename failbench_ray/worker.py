"""The training worker actor: one rank. Runs steps, hooks of the mechanism, and failpoints.

Threaded with max_concurrency=2: the training thread runs `run()`, the second thread serves
`abort()` and `progress()` so the driver can pull a rank out of a dead collective.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from architectures import ARCHITECTURES
from architectures.base import Trainer, WorkerContext
from failbench_ray.comm import AbortHandle, CollectiveAborted, Generations
from failbench_ray.records import CheckpointEvent, StepRecord
from failbench_ray.spec import ExperimentSpec
from mechanisms import MECHANISMS
from mechanisms.base import HookContext, RestoreInstruction

_FAILPOINT_WAIT_S = 120.0


@dataclass(frozen=True)
class JoinInfo:
    generation: int
    store_host: str
    store_port: int
    members: tuple[int, ...]  # live logical ranks; a rank's place in it is its group rank
    backend: str
    device: str
    peers: dict[int, Any] = field(default_factory=dict)  # rank -> actor handle, this generation


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


class Worker:
    def __init__(self, rank: int, spec: dict[str, Any], run_dir: str, chaos: Any) -> None:
        self.spec = ExperimentSpec.model_validate(spec)
        torch.set_num_threads(self.spec.threads_per_worker)
        self.rank = rank
        arch_cls = ARCHITECTURES.get(self.spec.architecture.name)
        self.arch = arch_cls(
            self.spec, arch_cls.Params.model_validate(self.spec.architecture.params)
        )
        mech_cls = MECHANISMS.get(self.spec.mechanism.name)
        mech_params = mech_cls.Params.model_validate(self.spec.mechanism.params)
        self.hooks = mech_cls.hooks_cls(
            HookContext(rank, self.arch.layout(), Path(run_dir), mech_params, self._failpoint)
        )
        self.chaos = chaos
        self.generations = Generations()
        self.abort_handle = AbortHandle()
        self.trainer: Trainer | None = None
        self.previous: Trainer | None = None  # last generation's trainer, for state handover
        self.generation = -1
        self.step = 0
        self.armed: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._records: list[StepRecord] = []
        self._checkpoints: list[CheckpointEvent] = []

    # -- served on the second thread ------------------------------------------------------
    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def abort(self) -> None:
        self.abort_handle.abort()

    def progress(self) -> int:
        return self.step

    def call_trainer(self, method: str, *args: Any) -> Any:
        """Serve a peer's request to this rank's trainer (e.g. a parameter server's push/pull),
        on one of the actor's extra threads."""
        assert self.trainer is not None, "join() before serving peers"
        return getattr(self.trainer, method)(*args)

    def drain(self) -> tuple[list[StepRecord], list[CheckpointEvent]]:
        """Hand over the records kept so far (also from the second thread, e.g. before a kill)."""
        with self._lock:
            records, self._records = self._records, []
            checkpoints, self._checkpoints = self._checkpoints, []
        return records, checkpoints

    # -- the training thread --------------------------------------------------------------
    def join(self, info: JoinInfo) -> float:
        """Enter a new process-group generation and build a fresh trainer in it."""
        t0 = time.perf_counter()
        self.abort_handle = AbortHandle()
        group = self.generations.join(
            generation=info.generation,
            store_host=info.store_host,
            store_port=info.store_port,
            rank=info.members.index(self.rank),
            world_size=len(info.members),
            backend=info.backend,
            timeout_s=self.spec.pg_timeout_s,
            rendezvous_timeout_s=self.spec.reform_timeout_s,
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
        self.previous, self.trainer = self.trainer, self.arch.trainer(ctx)
        self.generation = info.generation
        return time.perf_counter() - t0

    def restore(self, instruction: RestoreInstruction) -> list[CheckpointEvent]:
        assert self.trainer is not None, "join() before restore()"
        if instruction.source == "survivors":
            # Continue with this rank's own state, handed from the last generation's trainer.
            assert self.previous is not None, "a survivor keeps the state it trained"
            self.trainer.load_state_dict(self.previous.state_dict())
            events: list[CheckpointEvent] = []
        else:
            events = self.hooks.restore(instruction, self.trainer)
        self.previous = None
        self.step = instruction.step
        return events

    def run(self, start: int, end: int, armed: dict[tuple[str, int], int]) -> RunReport:
        """Run steps start..end (inclusive) until done or a peer's death aborts the step."""
        assert self.trainer is not None, "join() before run()"
        self.armed = dict(armed)
        handle = self.abort_handle
        for step in range(start, end + 1):
            if handle.failed:
                return self._report("aborted", handle.reason())
            self._failpoint("step", step)
            t0 = time.time()
            handle.begin_step()
            try:
                out = self.trainer.train_step(step)
            except CollectiveAborted as err:
                return self._report("aborted", str(err))
            except RuntimeError as err:
                # A collective inside torch (FSDP, DTensor, pipelining) failed: a peer died or
                # the group timed out. The driver decides; with no dead peer it is an error.
                return self._report("aborted", f"{type(err).__name__}: {err}".splitlines()[0])
            t1 = time.time()
            checkpoints = self.hooks.after_step(step, self.trainer)
            t2 = time.time()
            record = StepRecord(
                self.rank, step, self.generation, out.loss, t0, t2, out.samples, t2 - t1
            )
            with self._lock:
                self._records.append(record)
                self._checkpoints += checkpoints
                self.step = step
        return self._report("completed", "")

    def digest(self) -> tuple[str, int, list[float], dict[str, float]]:
        """(digest of this rank's parameters, bytes of its state, a sample of its parameters,
        the architecture's own measurements)."""
        assert self.trainer is not None
        t = self.trainer
        return t.parameters_digest(), t.state_bytes(), t.parameters_sample(), t.metrics()

    def _report(self, status: str, reason: str) -> RunReport:
        records, checkpoints = self.drain()
        return RunReport(self.rank, status, self.step, records, checkpoints, reason, time.time())

    def _failpoint(self, where: str, step: int) -> None:
        index = self.armed.pop((where, step), None)
        if index is None:
            return
        action = ray.get(
            self.chaos.reached.remote(index, self.rank, step), timeout=_FAILPOINT_WAIT_S
        )
        if action == "exit":
            os._exit(1)


WorkerActor = ray.remote(max_concurrency=2)(Worker)
