"""Kill kinds: how a worker is made to fail. Each is one entry in `KILL_KINDS`.

A kind that is not `by_worker` is done to the process from outside by the chaos actor: given
the event's ranks, every current target and the event's validated parameters, it acts and
returns the ranks it hit (a `node` kill takes every rank on the victim's node). A `by_worker`
kind is done by the victim itself when it reaches its failpoint (`worker_side`): faults that
come from inside the process (a segfault in native code, an uncaught exception).

Each kind names the detector that finds it: `death` (the process is gone and Ray says so),
`heartbeat` (the process lives but answers nothing: the driver's progress heartbeat times out),
`digest` or `nonfinite` (silent corruption: the process goes on training on wrong numbers).
A kind with a notice (`preempt`) tells the driver first and strikes `notice_s` later. A kind
that `corrupts` is done by the victim at its failpoint (`corrupt`), which then trains on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from failbench_ray.registry import Registry
from injector import throttle


class Target(NamedTuple):
    """The current worker of a rank: its process, its actor, the Ray node it runs on."""

    pid: int
    handle: Any
    node_id: str = ""


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class GilHangParams(NoParams):
    hold_s: float = Field(3600.0, gt=0, le=86_400, description="How long the thread holds the GIL.")


class PreemptParams(NoParams):
    notice_s: float = Field(
        2.0, ge=0, le=3600, description="Seconds between the notice and the SIGTERM."
    )
    grace_s: float = Field(
        5.0, ge=0, le=3600, description="Seconds between the SIGTERM and the SIGKILL."
    )


class StragglerParams(NoParams):
    factor: float = Field(
        2.0, gt=1, le=100, description="How many times slower the rank runs (more than 1)."
    )
    duration_s: float = Field(30.0, gt=0, le=86_400, description="How long it stays slow.")
    period_s: float = Field(
        0.02,
        ge=0.002,
        le=1.0,
        description="One run-and-stop cycle of the throttle (a CPU quota's period); under a "
        "second, so the heartbeat never takes the stops for a hang.",
    )


class CorruptParams(NoParams):
    """Which number of the victim's own parameters (its shard) is hit."""

    param: int = Field(0, ge=0, description="Index into the rank's parameter tensors.")
    element: int = Field(0, ge=0, description="Flat index of the element in that tensor.")


class BitflipParams(CorruptParams):
    bit: int = Field(
        22, ge=0, le=31, description="Bit of the float32 element to flip (22: top of mantissa)."
    )


KillFn = Callable[[list[int], dict[int, Target], Any], list[int]]

# What finds a failure of each kind (`failbench list` shows them).
DETECTORS: dict[str, str] = {
    "death": "the worker's process is gone: Ray fails the calls to its actor",
    "heartbeat": "the driver's progress heartbeat: a rank that answers no ping for "
    "detectors.heartbeat_timeout_s while others do is hung; it is killed and recovered like a "
    "crash",
    "step_time": "the step-time outlier detector: a rank whose own computation in a step (its "
    "waits on peers left out) takes detectors.straggler_factor times its earlier time, while "
    "the other ranks' does not, is a straggler; flagged, or replaced like a crash "
    "(detectors.straggler_action). Where every wait passes through the worker: ddp, gossip, "
    "ps, pipeline, hybrid with tp=1 (not fsdp, tensor: their collectives are torch's own)",
    "digest": "the cross-replica digest check: every detectors.digest_every steps each rank "
    "reports a checksum of its parameters; replicas of a shard that disagree are corrupt (the "
    "minority, or all of them without a majority), and every rank rolls back to state no newer "
    "than the last step that passed",
    "nonfinite": "the non-finite check: every detectors.nonfinite_every steps each rank checks "
    "its parameters; a rank holding NaN or Inf is corrupt, and every rank rolls back to state "
    "no newer than its last finite check",
}


@dataclass(frozen=True)
class KillKind:
    name: str
    summary: str
    by_worker: bool  # True: the victim ends itself when told (it must reach a failpoint)
    kill: KillFn | None = None  # run by the chaos actor for kinds that are not `by_worker`
    params: type[NoParams] = NoParams
    detector: str = "death"
    # Seconds of notice before `kill` runs (None: no notice): the driver may act on it.
    notice_s: Callable[[Any], float] | None = None
    # Done by the victim at its failpoint, which then trains on (silent corruption).
    corrupts: bool = False
    # Seconds until the fault ends by itself (None: it lasts): the victim is slow meanwhile.
    lasts_s: Callable[[Any], float] | None = None

    @property
    def leaves_alive(self) -> bool:
        """The victim trains on (corrupt, or slow) until a detector finds it, if one does."""
        return self.corrupts or self.lasts_s is not None


def _kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # already gone: nothing to signal
            os.kill(pid, sig)


def signal_ranks(ranks: list[int], targets: dict[int, Target], sig: int) -> list[int]:
    """Send `sig` to each rank's process: from here when it runs on this node, else from a
    task placed on its node (a signal cannot cross machines)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    by_node: dict[str, list[int]] = {}
    for rank in ranks:
        by_node.setdefault(targets[rank].node_id or here, []).append(targets[rank].pid)
    _kill_pids(by_node.pop(here, []), sig)
    if not by_node:
        return list(ranks)
    remote = ray.remote(num_cpus=0, max_retries=0)(_kill_pids)
    refs = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            pids, sig
        )
        for node, pids in by_node.items()
    ]
    ray.get(refs, timeout=30)
    return list(ranks)


def _sigkill(ranks: list[int], targets: dict[int, Target], _: Any) -> list[int]:
    return signal_ranks(ranks, targets, signal.SIGKILL)


def _hang(ranks: list[int], targets: dict[int, Target], _: Any) -> list[int]:
    """SIGSTOP: the process keeps its sockets and its actor, and answers nothing."""
    return signal_ranks(ranks, targets, signal.SIGSTOP)


def _straggler(ranks: list[int], targets: dict[int, Target], params: StragglerParams) -> list[int]:
    """A throttle on each rank's process, from outside (`throttle.duty_cycle`)."""
    import ray

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    by_node: dict[str, list[int]] = {}
    for rank in ranks:
        by_node.setdefault(targets[rank].node_id or here, []).append(targets[rank].pid)
    throttle.start(by_node, here, params.factor, params.period_s, params.duration_s)
    return list(ranks)


def _gil_hang(ranks: list[int], targets: dict[int, Target], params: GilHangParams) -> list[int]:
    for rank in ranks:
        targets[rank].handle.hold_gil.remote(params.hold_s)
    return list(ranks)


def _preempt(ranks: list[int], targets: dict[int, Target], params: PreemptParams) -> list[int]:
    """The notice ran out: SIGTERM now, SIGKILL after the grace period (as a spot VM ends)."""
    signal_ranks(ranks, targets, signal.SIGTERM)
    timer = threading.Timer(params.grace_s, signal_ranks, (ranks, targets, signal.SIGKILL))
    timer.daemon = True
    timer.start()
    return list(ranks)


def _ray_kill(ranks: list[int], targets: dict[int, Target], _: Any) -> list[int]:
    import ray

    for rank in ranks:
        ray.kill(targets[rank].handle, no_restart=True)
    return list(ranks)


def _node(ranks: list[int], targets: dict[int, Target], _: Any) -> list[int]:
    """The node of each named rank fails: its raylet is SIGKILLed (by one of its own workers,
    so this works on any node of the cluster), and every actor on it dies with it."""
    import ray

    one_per_node = {targets[r].node_id: r for r in ranks}
    nodes = set(one_per_node)
    refs = [targets[r].handle.kill_node.remote() for r in one_per_node.values()]
    # The calls never answer (the process dies); waiting bounds the time until the kill.
    ray.wait(refs, num_returns=len(refs), timeout=10)
    return sorted(r for r, t in targets.items() if t.node_id in nodes)


class InjectedException(RuntimeError):
    """The `exception` kind: raised in the training step like a bug in user code."""


def worker_side(kind: str) -> None:
    """Do a `by_worker` kind to this process (the victim calls this at its failpoint)."""
    if kind == "exit":
        os._exit(1)
    if kind == "segfault":
        ctypes.string_at(0)  # reads address 0: a real SIGSEGV from native code
    if kind == "abort":
        os.abort()  # SIGABRT, as a failed assertion in native code
    if kind == "exception":
        raise InjectedException("injected exception in the training step")
    raise ValueError(f"{kind} is not a kind the worker does to itself")


def corrupt(kind: str, params: CorruptParams, parameters: list[Any]) -> str:
    """Do a `corrupts` kind to this rank's `parameters` (its trainer's, in order); returns
    what was hit. `bitflip` flips one bit of one element now; `nan` makes one element of the
    next gradient of that parameter NaN (a hook that fires once, before any all-reduce)."""
    import torch

    if params.param >= len(parameters):
        raise ValueError(
            f"kill_params.param={params.param}: this rank holds {len(parameters)} parameter "
            f"tensors (0..{len(parameters) - 1})"
        )
    p = parameters[params.param]
    local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor: this rank's piece
    if params.element >= local.numel():
        raise ValueError(
            f"kill_params.element={params.element}: parameter {params.param} has "
            f"{local.numel()} elements on this rank"
        )
    if kind == "bitflip":
        assert isinstance(params, BitflipParams)
        if local.dtype != torch.float32:
            raise ValueError(f"bitflip needs float32 parameters, not {local.dtype}")
        with torch.no_grad():
            words = local.detach().view(-1).view(torch.int32)
            words[params.element] ^= (1 << params.bit) - (1 << 32 if params.bit == 31 else 0)
        return f"bit {params.bit} of element {params.element} of parameter {params.param}"
    if kind == "nan":
        handle: Any = None

        def poison(grad: Any) -> Any:
            handle.remove()  # once
            grad = grad.clone()
            mine = grad.to_local() if hasattr(grad, "to_local") else grad
            mine.view(-1)[params.element] = float("nan")
            return grad

        handle = p.register_hook(poison)
        return f"element {params.element} of parameter {params.param}'s next gradient"
    raise ValueError(f"{kind} is not a corruption kind")


KILL_KINDS: Registry[KillKind] = Registry("kill kind")
KILL_KINDS.add(
    "sigkill",
    KillKind("sigkill", "SIGKILL of the worker process (true fail-stop)", False, _sigkill),
)
KILL_KINDS.add("ray_kill", KillKind("ray_kill", "ray.kill of the worker actor", False, _ray_kill))
KILL_KINDS.add("exit", KillKind("exit", "the worker calls os._exit(1) at the trigger", True))
KILL_KINDS.add("segfault", KillKind("segfault", "the worker reads address 0: a real SIGSEGV", True))
KILL_KINDS.add("abort", KillKind("abort", "the worker calls abort(): SIGABRT", True))
KILL_KINDS.add(
    "exception",
    KillKind(
        "exception",
        "an uncaught exception in the training step: the process prints it and exits 1",
        True,
    ),
)
KILL_KINDS.add(
    "hang",
    KillKind(
        "hang",
        "SIGSTOP of the worker process: it holds its sockets and answers nothing",
        False,
        _hang,
        detector="heartbeat",
    ),
)
KILL_KINDS.add(
    "gil_hang",
    KillKind(
        "gil_hang",
        "a thread inside the worker holds the GIL for hold_s: the process lives, the actor "
        "answers nothing",
        False,
        _gil_hang,
        GilHangParams,
        detector="heartbeat",
    ),
)
KILL_KINDS.add(
    "straggler",
    KillKind(
        "straggler",
        "the rank runs factor times slower for duration_s, throttled from outside (a "
        "SIGSTOP/SIGCONT duty cycle of period_s); it lives and answers",
        False,
        _straggler,
        StragglerParams,
        detector="step_time",
        lasts_s=lambda p: float(p.duration_s),
    ),
)
KILL_KINDS.add(
    "preempt",
    KillKind(
        "preempt",
        "spot preemption: a notice, SIGTERM notice_s later, SIGKILL grace_s after that; "
        "disk_ckpt, async_ckpt and jit_ckpt save on the notice",
        False,
        _preempt,
        PreemptParams,
        notice_s=lambda p: float(p.notice_s),
    ),
)
KILL_KINDS.add(
    "node",
    KillKind(
        "node",
        "the Ray node of the named ranks fails (its raylet is SIGKILLed): every worker, replica "
        "holder and spare on it dies at once. Needs a multi-node cluster; never the head node",
        False,
        _node,
    ),
)
KILL_KINDS.add(
    "bitflip",
    KillKind(
        "bitflip",
        "silent data corruption: one bit of one parameter element flips on the victim, which "
        "trains on",
        True,
        params=BitflipParams,
        detector="digest",
        corrupts=True,
    ),
)
KILL_KINDS.add(
    "nan",
    KillKind(
        "nan",
        "one element of the victim's next gradient is NaN (before any all-reduce spreads it); "
        "training goes on",
        True,
        params=CorruptParams,
        detector="nonfinite",
        corrupts=True,
    ),
)
