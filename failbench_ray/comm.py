"""Process groups that survive a dead peer, and collectives the driver can abort.

Nothing in gloo frees a thread already blocked in a collective (see DESIGN.md), so the training
thread never blocks inside gloo: collectives run with `async_op=True` and the thread waits on a
future of ours, which either the collective's completion or an abort completes.

Every re-formation is a new *generation*: the same TCPStore (hosted by the driver, so it outlives
any worker) under a fresh key prefix. The previous default group is kept referenced, because
dropping its last reference runs a destructor that waits out the stale collective.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from failbench_ray import network


class CollectiveAborted(RuntimeError):
    """The collective of this step was aborted or failed: a peer died. The step did not happen."""


class AbortHandle:
    """Futures that an abort completes. Shared by every collective of one worker's generation.

    A step is applied only if all of its collectives completed; an abort that lands after they
    did lets the step finish, so survivors agree on the last completed step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aborted = False
        self.error: BaseException | None = None
        self._step_failed = False
        self._pending: list[tuple[torch.futures.Future, Any]] = []
        self._events: list[threading.Event] = []  # what `wait()` callers block on
        self._works: list[dist.Work] = []  # launched through this handle, maybe still running
        self._launched: list[float] = []  # when each of them was launched
        self._waits: list[tuple[float, float]] = []  # this step's spans waiting on peers

    def _track(self, work: dist.Work) -> None:
        """Keep `work` (and forget finished ones) so `in_flight` can tell a stale one."""
        pairs = zip(self._works, self._launched, strict=True)
        kept = [(w, t) for w, t in pairs if not w.is_completed()]
        self._works = [w for w, _ in kept] + [work]
        self._launched = [t for _, t in kept] + [time.monotonic()]

    def in_flight(self) -> int:
        """Collectives launched through this handle that have not finished: an aborted one
        stays parked on its dead peer (inside gloo) until the group's timeout."""
        with self._lock:
            return sum(not w.is_completed() for w in self._works)

    def oldest_in_flight(self) -> float | None:
        """When (`time.monotonic()`) the oldest unfinished collective was launched, if any:
        it times out `pg_timeout_s` after that, and only then frees its thread."""
        with self._lock:
            pairs = zip(self._works, self._launched, strict=True)
            return min((t for w, t in pairs if not w.is_completed()), default=None)

    @property
    def failed(self) -> bool:
        """Aborted by the driver or a collective failed: launch no further collectives."""
        return self._aborted or self.error is not None

    def reason(self) -> str:
        if self.error is not None:
            return f"collective failed: {self.error}".splitlines()[0]
        return "aborted by the driver"

    def begin_step(self) -> None:
        self._step_failed = False
        with self._lock:
            self._waits = []

    def waited(self, start: float, end: float) -> None:
        """The step waited on peers from `start` to `end` (`time.monotonic()`)."""
        with self._lock:
            self._waits.append((start, end))

    def take_waited(self) -> float:
        """Seconds of this step spent waiting on peers (overlapping waits count once): what
        is left of the step is the rank's own work, which a straggler does slower."""
        with self._lock:
            spans, self._waits = sorted(self._waits), []
        total, reach = 0.0, float("-inf")
        for start, end in spans:
            start = max(start, reach)
            if end > start:
                total += end - start
                reach = end
        return total

    def check(self) -> None:
        """Raise if a collective of this step did not complete."""
        if self._step_failed:
            raise CollectiveAborted(self.reason())

    def skip(self, fallback: Any) -> torch.futures.Future:
        """A collective this step does not launch (the handle failed before it): the step
        fails with it, or its update would be applied from this rank's gradients alone (a long
        backward lets the driver's abort land before the all-reduce is launched)."""
        out: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self._step_failed = True
        out.set_result(fallback)
        return out

    def watch(
        self, work: dist.Work, fallback: Any, on_success: Callable[[], Any]
    ) -> torch.futures.Future:
        """A future completed by `work` (with `on_success()`), or by an abort (with `fallback`)."""
        out: torch.futures.Future = torch.futures.Future()
        launched = time.monotonic()
        with self._lock:
            self._track(work)
            if self.failed:
                self._step_failed = True
                out.set_result(fallback)
                return out
            self._pending.append((out, fallback))

        def done(fut: torch.futures.Future) -> None:
            try:
                fut.wait()
                value, ok = on_success(), True
            except BaseException as err:  # the peer's socket closed, or the timeout hit
                self.error = self.error or err
                value, ok = fallback, False
            # From launch to completion: in DDP the step blocks on it once backward is done.
            self.waited(launched, time.monotonic())
            self._complete(out, value, ok)

        work.get_future().add_done_callback(done)
        return out

    def _complete(self, fut: torch.futures.Future, value: Any, ok: bool) -> None:
        with self._lock:
            if not fut.done():
                self._step_failed = self._step_failed or not ok
                fut.set_result(value)
            self._pending = [(f, v) for f, v in self._pending if not f.done()]

    def abort(self) -> None:
        """Called from the actor's second thread: release whatever the training thread waits on."""
        with self._lock:
            self._aborted = True
            pending, self._pending = self._pending, []
            for event in self._events:
                event.set()
        for fut, fallback in pending:
            self._complete(fut, fallback, ok=False)

    def wait(self, work: dist.Work) -> None:
        """Wait for a collective or a point-to-point message without blocking inside gloo.

        Gloo's send/recv have no future, so a helper thread does the blocking `wait()`; this
        thread waits on an event that the helper or an abort sets. A helper stuck on a dead
        peer stays parked until the old group times out, like the group itself.
        """
        event = threading.Event()
        failure: list[BaseException] = []

        def blocking_wait() -> None:
            try:
                work.wait()
            except BaseException as err:  # the peer's socket closed, or the timeout hit
                failure.append(err)
            finally:
                event.set()

        with self._lock:
            self._track(work)
            if self._aborted:
                self._step_failed = True
                raise CollectiveAborted(self.reason())
            self._events.append(event)
        threading.Thread(target=blocking_wait, daemon=True, name="gloo-wait").start()
        start = time.monotonic()
        event.wait()
        self.waited(start, time.monotonic())
        with self._lock:
            self._events.remove(event)
            if failure:
                self.error = self.error or failure[0]
            if failure or self._aborted:
                self._step_failed = True
                raise CollectiveAborted(self.reason())


class CanonicalAllReduceHook:
    """DDP comm hook: average the bucket's gradients in a fixed (parameter) order.

    Gloo's ring all-reduce sums each element in an order that depends on its offset in the
    buffer, and DDP re-orders its buckets after the first iteration of every wrap. Flattening in
    the parameters' own order makes the summation identical whenever a step is replayed, which
    is what lets a rolled-back run end bit-identical to the baseline.
    """

    def __init__(self, handle: AbortHandle, group: dist.ProcessGroup, params: Sequence[Any]):
        self.handle = handle
        self.group = group
        self.world = dist.get_world_size(group)
        self.index = {id(p): i for i, p in enumerate(params)}

    # DDP inspects this signature and accepts only real (not stringified) annotations or none.
    def all_reduce(self, _state, bucket):  # type: ignore[no-untyped-def]
        buf = bucket.buffer()
        params = bucket.parameters()
        grads = bucket.gradients()
        offsets, off = [], 0
        for g in grads:
            offsets.append(off)
            off += g.numel()
        order = sorted(range(len(params)), key=lambda i: self.index[id(params[i])])
        if self.handle.failed:  # aborted during the backward: no all-reduce, no update
            return self.handle.skip(buf)
        flat = torch.cat([grads[i].reshape(-1) for i in order]).div_(self.world)
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def scatter_back() -> torch.Tensor:
            pos = 0
            for i in order:
                n = grads[i].numel()
                buf.narrow(0, offsets[i], n).copy_(flat.narrow(0, pos, n))
                pos += n
            return buf

        return self.handle.watch(work, buf, scatter_back)


def rendezvous_store(host: str) -> dist.TCPStore:
    """The driver's rendezvous store, listening on `host` only: 127.0.0.1 for a local
    cluster, the node's cluster address when joined to a multi-node one (where the workers
    reach it). torch's own server would listen on every interface, unauthenticated, so a
    stranger could write keys into a re-formation; it takes a socket bound here instead."""
    sock = network.listen_socket(host)
    port = sock.getsockname()[1]
    # The store owns the descriptor from here on (it closes it when it is destroyed).
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach()
    )


def listen_on_interface_of(ip: str) -> None:
    """gloo (and NCCL's bootstrap) listen on the interface that carries `ip`, this node's
    cluster address (loopback on a local cluster), instead of whatever the machine's hostname
    resolves to. An interface the user chose (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) stays."""
    interface = network.interface_of(ip)
    if interface is None:
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, interface)


@dataclass(frozen=True)
class JoinTimes:
    """When (`time.time()`) each part of one rank's join into a new generation ended: the
    driver takes, for each part, the latest over the ranks (a part ends when it is done on
    every rank)."""

    started: float  # the rank began to join (its call arrived)
    arrived: float  # every member had reached the store: the store rendezvous
    connected: float  # this rank's process group was built (its connections to the peers made)
    collective: float  # the new group's first collective completed
    built: float = 0.0  # the rank's trainer was built in the new group (the worker fills it)
    # this rank had left the old group and reached the store: with the fast re-formation a
    # survivor does that while the replacements start, before its join is called
    reached: float = 0.0


@dataclass(frozen=True)
class StoreAddress:
    """Where the generations' rendezvous store listens, and how long a rendezvous may take."""

    host: str
    port: int
    timeout_s: float


class Generations:
    """Joins a worker to generation after generation of the default process group."""

    def __init__(self) -> None:
        self._graveyard: list[Any] = []  # old groups, kept alive on purpose (see module doc)
        self._client: dist.TCPStore | None = None
        self._lock = threading.Lock()
        self._reached: tuple[int, float] | None = None  # (generation, when) of the last reach

    def reach(self, *, generation: int, store: StoreAddress, world_size: int, own_ip: str) -> float:
        """Leave the current group and count this process in at generation `generation`'s
        rendezvous, once per generation: the fast re-formation has survivors do it while the
        replacements start, and their join then finds it done. Returns when it happened."""
        with self._lock:  # an early reach and the join may run on two of the actor's threads
            if self._reached is not None and self._reached[0] == generation:
                return self._reached[1]
            self.leave()
            if self._client is None:
                listen_on_interface_of(own_ip)
                self._client = dist.TCPStore(
                    store.host,
                    store.port,
                    is_master=False,
                    timeout=timedelta(seconds=store.timeout_s),
                    wait_for_workers=False,
                )
            if self._prefixed(generation).add("arrived", 1) == world_size:
                self._prefixed(generation).set("all_arrived", b"1")
            self._reached = (generation, time.time())
            return self._reached[1]

    def _prefixed(self, generation: int) -> dist.PrefixStore:
        assert self._client is not None
        return dist.PrefixStore(f"gen{generation}/", self._client)

    def join(
        self,
        *,
        generation: int,
        store: StoreAddress,
        rank: int,
        world_size: int,
        backend: str,
        device: str,
        timeout_s: float,
        own_ip: str,
    ) -> tuple[dist.ProcessGroup, JoinTimes]:
        started = time.time()
        reached = self.reach(
            generation=generation, store=store, world_size=world_size, own_ip=own_ip
        )
        prefixed = self._prefixed(generation)
        # The store rendezvous: every member counted in. Without it, the wait for the last
        # member would hide inside the group's connecting.
        prefixed.wait(["all_arrived"], timedelta(seconds=store.timeout_s))
        arrived = time.time()
        dist.init_process_group(
            backend,
            store=prefixed,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=store.timeout_s),
        )
        group = dist.distributed_c10d._get_default_group()
        connected = time.time()
        # The first collective, under the re-formation timeout: a group is formed when data
        # went through it (gloo connects at construction, NCCL at the first collective).
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        collective = time.time()
        # Rendezvous got the (shorter) re-formation timeout; collectives get the spec's.
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
        return group, JoinTimes(started, arrived, connected, collective, reached=reached)

    def leave(self) -> None:
        if dist.is_initialized():
            # Every group of the generation, sub-groups too (a DeviceMesh's, a pipeline's):
            # the last reference to one with a collective stuck on a dead peer runs a
            # destructor that waits out that collective's timeout, in whatever thread drops
            # it. Seen: a hybrid rank's Python GC collected the old trainer inside a Ray task
            # thread, which then served nothing for a minute while its peers waited on it.
            self._graveyard += list(dist.distributed_c10d._world.pg_map)
            dist.destroy_process_group()

    def held(self) -> int:
        """Old groups kept alive (see `leave`)."""
        return len(self._graveyard)

    def close(self) -> None:
        """Free every group and the store client, for a process that serves another trial.

        Only safe when no collective of any generation is still in flight (the caller checks
        `AbortHandle.in_flight`): then no destructor has a stale collective to wait out."""
        self.leave()
        self._graveyard.clear()
        self._client = None
        self._reached = None


def init_mesh(
    device_type: str, shape: tuple[int, ...], names: tuple[str, ...], timeout_s: float
) -> Any:
    """A DeviceMesh whose sub-groups time out after `timeout_s`, like the default group.

    `init_device_mesh` creates its sub-groups with torch's default timeout (30 min), whatever
    the default group has, so a collective stuck on a rank that hung (not died) would hold its
    peers for half an hour.
    """
    from torch.distributed.device_mesh import init_device_mesh

    backend = dist.get_backend()
    options_cls = dist.ProcessGroupGloo._Options if backend == "gloo" else None
    if backend == "nccl":
        options_cls = dist.ProcessGroupNCCL.Options
    if options_cls is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    override: dict[int | str, Any] = {}
    for name in names:
        options = options_cls()
        options._timeout = timedelta(seconds=timeout_s)
        override[name] = (backend, options)
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)
