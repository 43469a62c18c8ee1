"""Parameter server: server ranks own parameter shards and the optimizer; worker ranks compute
gradients. Gradients and parameters travel through the Ray object store (actor calls).

Ranks 0..S-1 are servers; parameter i lives on server i % S. A worker pushes each server its
gradients and pulls the server's parameters back. `sync`: a server averages one push from every
worker per step (the same update as one process on the global batch). `async`: a server applies
each push as it comes (scaled by 1/W), and a worker goes on as soon as its own push is applied.
Every wait checks the worker's abort handle, so the driver can always pull a rank out.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import ray
import torch
from pydantic import BaseModel, ConfigDict, Field

from architectures import ARCHITECTURES, state
from architectures.base import (
    Architecture,
    StateLayout,
    StepOutput,
    Trainer,
    WorkerContext,
    check_batch_splits,
    tensors_digest,
)
from failbench_ray.comm import CollectiveAborted
from failbench_ray.data import SyntheticData
from failbench_ray.errors import SpecError
from failbench_ray.models import build_model, loss_fn
from failbench_ray.optim import build_optimizer

_POLL_S = 0.02
Arrays = dict[int, np.ndarray]


@dataclass(frozen=True)
class Push:
    """A worker's gradients for step `step`, for the parameters this server owns."""

    step: int
    worker: int
    grads: Arrays


@dataclass(frozen=True)
class Pull:
    """A worker asks for the parameters after step `step` (sync), or after its own push of
    that step was applied (async)."""

    step: int
    worker: int


class PSParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    servers: int = Field(1, ge=1, description="Parameter-server ranks (the first ranks).")
    mode: Literal["sync", "async"] = Field("sync", description="sync or async updates.")


class ServerTrainer(Trainer):
    """Owns parameters i % S == s and their optimizer state; serves pushes and pulls."""

    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        p = ctx.params
        self.workers = ctx.world_size - p.servers
        self.module = build_model(ctx.spec.model, ctx.spec.seed)
        params = list(self.module.parameters())
        self.owned = {i: params[i] for i in range(len(params)) if i % p.servers == ctx.rank}
        self.optimizer = build_optimizer(ctx.spec.optimizer, list(self.owned.values()))
        self._cond = threading.Condition()
        self._inbox: dict[int, dict[int, Arrays]] = {}  # sync: step -> worker -> grads
        self._queue: list[tuple[int, int, Arrays]] = []  # async: (step, worker, grads)
        self._published: dict[int, Arrays] = {}  # sync: step -> parameters after it
        self._applied: set[tuple[int, int]] = set()  # async: (worker, step) applied

    # served on the actor's extra threads ------------------------------------------------
    def serve(self, request: Any) -> Any:
        if isinstance(request, Push):
            return self.push(request.step, request.worker, request.grads)
        if isinstance(request, Pull):
            return self.pull(request.step, request.worker)
        return super().serve(request)

    def push(self, step: int, worker: int, grads: Arrays) -> None:
        with self._cond:
            if self.ctx.params.mode == "sync":
                self._inbox.setdefault(step, {})[worker] = grads
            else:
                self._queue.append((step, worker, grads))
            self._cond.notify_all()

    def pull(self, step: int, worker: int) -> Arrays:
        if self.ctx.params.mode == "sync":
            self._wait(lambda: step in self._published)
            return self._published[step]
        self._wait(lambda: (worker, step) in self._applied)
        with self._cond:
            return self._snapshot()

    # the training thread ----------------------------------------------------------------
    def train_step(self, step: int) -> StepOutput:
        if self.ctx.params.mode == "sync":
            self._wait(lambda: len(self._inbox.get(step, {})) == self.workers)
            with self._cond:
                pushes = self._inbox.pop(step)
            self._apply([pushes[w] for w in sorted(pushes)], 1.0 / self.workers)
            with self._cond:
                self._published[step] = self._snapshot()
                self._published.pop(step - 2, None)
                self._cond.notify_all()
        else:
            for _ in range(self.workers):
                self._wait(lambda: bool(self._queue))
                with self._cond:
                    pushed_step, worker, grads = self._queue.pop(0)
                self._apply([grads], 1.0 / self.workers)
                with self._cond:
                    self._applied.add((worker, pushed_step))
                    self._cond.notify_all()
        return StepOutput(loss=math.nan, samples=0)

    def _apply(self, pushes: list[Arrays], scale: float) -> None:
        for i, p in self.owned.items():
            total = pushes[0][i].copy()
            for g in pushes[1:]:
                total += g[i]
            p.grad = torch.from_numpy(total * scale)
        self.optimizer.step()

    def _snapshot(self) -> Arrays:
        return {i: p.detach().numpy().copy() for i, p in self.owned.items()}

    def _wait(self, ready: Any) -> None:
        start = time.monotonic()
        with self._cond:
            while not ready():
                if self.ctx.abort.failed:
                    raise CollectiveAborted(self.ctx.abort.reason())
                self._cond.wait(_POLL_S)
        self.ctx.abort.waited(start, time.monotonic())

    def state_dict(self) -> dict[str, Any]:
        owned = {str(i): p.detach().clone() for i, p in self.owned.items()}
        return {"model": owned, "optimizer": state.optimizer_state(self.optimizer)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        with torch.no_grad():
            for i, p in self.owned.items():
                p.copy_(saved["model"][str(i)])
        state.load_optimizer_state(self.optimizer, saved["optimizer"])

    def parameters_digest(self) -> str:
        return tensors_digest([(str(i), p) for i, p in self.owned.items()])


class WorkerTrainer(Trainer):
    """Computes gradients on its data shard with a full copy of the parameters."""

    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        self.servers = ctx.params.servers
        self.index = ctx.rank - self.servers
        self.workers = ctx.world_size - self.servers
        self.module = build_model(ctx.spec.model, ctx.spec.seed)
        self.params = list(self.module.parameters())
        self.data = SyntheticData(ctx.spec.model, ctx.spec.seed)

    def train_step(self, step: int) -> StepOutput:
        spec, peers = self.ctx.spec, self.ctx.peers
        x, y = self.data.shard(step, spec.batch_size, self.index, self.workers)
        self.module.zero_grad(set_to_none=True)
        loss = loss_fn(spec.model, self.module(x), y)
        loss.backward()
        for s in range(self.servers):
            grads = {
                i: p.grad.numpy()
                for i, p in enumerate(self.params)
                if i % self.servers == s and p.grad is not None
            }
            peers[s].serve_peer.remote(Push(step, self.index, grads))
        pulls = [peers[s].serve_peer.remote(Pull(step, self.index)) for s in range(self.servers)]
        fresh = self._get(pulls)
        with torch.no_grad():
            for part in fresh:
                for i, value in part.items():
                    self.params[i].copy_(torch.from_numpy(value))
        return StepOutput(loss=float(loss.detach()), samples=len(x))

    def _get(self, refs: list[Any]) -> list[Arrays]:
        """Wait for the servers' replies; a dead server or an abort ends the step."""
        pending, start = list(refs), time.monotonic()
        while pending:
            if self.ctx.abort.failed:
                raise CollectiveAborted(self.ctx.abort.reason())
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
        self.ctx.abort.waited(start, time.monotonic())
        try:
            return list(ray.get(refs))
        except Exception as err:  # the server died or was aborted
            raise CollectiveAborted(f"parameter server: {type(err).__name__}") from None

    def state_dict(self) -> dict[str, Any]:
        return {"model": state.model_state(self.module)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state.load_model_state(self.module, saved["model"])


def ps_trainer(ctx: WorkerContext) -> Trainer:
    return ServerTrainer(ctx) if ctx.rank < ctx.params.servers else WorkerTrainer(ctx)


@ARCHITECTURES.register("ps")
class ParameterServer(Architecture):
    name = "ps"
    summary = "parameter server: server ranks own parameter shards, workers push gradients"
    Params = PSParams
    abortable = True

    def check(self) -> None:
        p = self.params
        assert isinstance(p, PSParams)
        w = self.spec.world_size - p.servers
        if w < 1:
            raise SpecError(
                f"ps with servers={p.servers} leaves no worker among world_size="
                f"{self.spec.world_size}; use servers <= {self.spec.world_size - 1}"
            )
        check_batch_splits(self.spec.batch_size, w, f"{w} workers")

    def layout(self) -> StateLayout:
        p = self.params
        assert isinstance(p, PSParams)
        w = self.spec.world_size
        # sync: every worker pulls the same parameters (one replica group, shard id S);
        # async: each worker's copy is as stale as its last pull (a shard of its own).
        sync = p.mode == "sync"
        return StateLayout(
            shard_of_rank=tuple(r if r < p.servers or not sync else p.servers for r in range(w)),
            holds=tuple(
                f"server {r + 1}/{p.servers}: parameter shard + optimizer state"
                if r < p.servers
                else "worker: copy of the parameters"
                for r in range(w)
            ),
        )

    def exact_replay(self) -> bool:
        assert isinstance(self.params, PSParams)
        return self.params.mode == "sync"  # async order depends on arrival times

    def commits_whole_batch(self) -> bool:
        # sync: the server publishes a step once every worker pushed; it may die before a
        # worker has pulled (and recorded) it. async applies each push on its own.
        assert isinstance(self.params, PSParams)
        return self.params.mode == "sync"

    def trainer(self, ctx: WorkerContext) -> Trainer:
        return ps_trainer(ctx)
