"""The Ray object-store replication backend: copies of rank state held by other processes.

An object a worker `ray.put`s dies with that worker (its owner), so a copy that must outlive the
rank it protects is *pulled*: the holder calls `source.snapshot_for.remote(step)` and keeps the
returned reference. A task's return value is owned by the caller, so the copy lives as long as
the holder does, whatever happens to the source.

State travels as one flat uint8 buffer (numpy) plus a picklable skeleton: Ray writes the buffer
into the object store once and every reader maps it zero-copy; the only copies are the snapshot
at the step boundary (on the source) and the final copy into the live parameters (on restore).

Holders are worker actors (`peers` placement: a copy dies with the rank holding it), dedicated
`ReplicaHolder` actors, or hot spares; all of them keep their copies in a `ReplicaStore`.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from failbench_ray.pool import ResetOutcome, process_resources

_ALIGN = 64


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of the state lies in the flat buffer."""

    index: int


@dataclass
class Packed:
    """A rank's state as one flat byte buffer plus the structure around it."""

    skeleton: Any  # the state with every tensor replaced by a _Slot
    meta: list[tuple[str, tuple[int, ...], int, int]]  # (dtype, shape, offset, nbytes)
    buffer: np.ndarray  # uint8

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)


@dataclass
class Layout:
    """Where each tensor of a state goes in a flat buffer, before any byte is copied."""

    skeleton: Any  # the state with every tensor replaced by a _Slot
    tensors: list[torch.Tensor]
    meta: list[tuple[str, tuple[int, ...], int, int]]  # (dtype, shape, offset, nbytes)
    nbytes: int  # the buffer's size, padding included


def layout(state: Any) -> Layout:
    tensors: list[torch.Tensor] = []

    def strip(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj.detach())
            return _Slot(len(tensors) - 1)
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(strip(v) for v in obj)
        return obj

    skeleton = strip(state)
    meta, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        meta.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, n))
        offset += -(-n // _ALIGN) * _ALIGN  # every tensor aligned, so its view is legal
    return Layout(skeleton, tensors, meta, offset)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view when it is already contiguous on CPU)."""
    return t.cpu().contiguous().reshape(-1).view(torch.uint8)


def pack(state: Any, reuse: Packed | None = None) -> Packed:
    """Copy every tensor of `state` into one contiguous buffer (the step-boundary snapshot).
    `reuse`: an earlier snapshot nobody reads any more; its buffer is filled again if the size
    fits (no fresh allocation, whose page faults the step would pay for)."""
    lay = layout(state)
    if reuse is not None and reuse.buffer.nbytes == lay.nbytes and reuse.buffer.flags.writeable:
        flat = torch.from_numpy(reuse.buffer)
    else:
        flat = torch.empty(lay.nbytes, dtype=torch.uint8)
    for t, (_, _, off, n) in zip(lay.tensors, lay.meta, strict=True):
        if n:
            flat[off : off + n].copy_(raw_bytes(t))
    return Packed(lay.skeleton, lay.meta, flat.numpy())


def unpack(packed: Packed) -> Any:
    """The state back, its tensors views into the (possibly read-only, shared) buffer."""
    with warnings.catch_warnings():
        # Buffers mapped from the object store are read-only; the views are only read from
        # (load_state_dict copies them into the live parameters).
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(packed.buffer)
    views = [
        flat[off : off + n].view(getattr(torch, dtype)).reshape(shape)
        for dtype, shape, off, n in packed.meta
    ]

    def fill(obj: Any) -> Any:
        if isinstance(obj, _Slot):
            return views[obj.index]
        if isinstance(obj, dict):
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(fill(v) for v in obj)
        return obj

    return fill(packed.skeleton)


class ReplicaStore:
    """Copies of shards' state by step, owned by this process. Keeps the newest `keep` steps."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._copies: dict[int, dict[int, tuple[Any, Packed]]] = {}  # shard -> step -> copy
        self.bytes_pulled = 0
        self.pull_s = 0.0

    def pull(self, shard: int, step: int, source: Any) -> bool:
        """Fetch `source`'s snapshot of `step` and own it. False if the source is gone."""
        t0 = time.perf_counter()
        ref = source.snapshot_for.remote(step)
        try:
            packed = ray.get(ref)
        except Exception:  # noqa: BLE001  (the source died or dropped the snapshot: no copy)
            return False
        with self._lock:
            versions = self._copies.setdefault(shard, {})
            versions[step] = (ref, packed)
            for old in sorted(versions)[: -self.keep]:
                del versions[old]
            self.bytes_pulled += packed.nbytes
            self.pull_s += time.perf_counter() - t0
        return True

    def inventory(self) -> dict[int, list[int]]:
        with self._lock:
            return {shard: sorted(v) for shard, v in self._copies.items()}

    def ref(self, shard: int, step: int) -> list[Any]:
        """The object ref of a copy, wrapped in a list so Ray hands the ref, not the value."""
        with self._lock:
            return [self._copies[shard][step][0]]

    def local(self, shard: int, step: int) -> Packed | None:
        with self._lock:
            copy = self._copies.get(shard, {}).get(step)
        return copy[1] if copy else None

    def truncate(self, step: int) -> None:
        """Forget copies newer than `step` (after a rollback they are of a discarded timeline)."""
        with self._lock:
            for versions in self._copies.values():
                for s in [s for s in versions if s > step]:
                    del versions[s]


def fetch(holder: Any, shard: int, step: int) -> Packed:
    """Read a holder's copy of `shard` at `step` (zero-copy on the same node)."""
    [ref] = ray.get(holder.replica_ref.remote(shard, step))
    packed: Packed = ray.get(ref)
    return packed


class ReplicaHolder:
    """A process whose only job is to own copies of other ranks' state (num_cpus=0)."""

    def __init__(self, keep: int = 2) -> None:
        self.store = ReplicaStore(keep)

    def ready(self) -> int:
        import os

        return os.getpid()

    def pull(self, shard: int, step: int, source: Any) -> bool:
        return self.store.pull(shard, step, source)

    def inventory(self) -> dict[int, list[int]]:
        return self.store.inventory()

    def replica_ref(self, shard: int, step: int) -> list[Any]:
        return self.store.ref(shard, step)

    def truncate(self, step: int) -> None:
        self.store.truncate(step)

    def stats(self) -> dict[str, float]:
        return {"bytes_pulled": self.store.bytes_pulled, "pull_s": self.store.pull_s}

    def reset(self) -> ResetOutcome:
        """Drop every copy (a pooled holder serves the next trial empty)."""
        self.store = ReplicaStore(self.store.keep)
        return ResetOutcome(None)

    def resources(self) -> dict[str, int]:
        import os

        return process_resources(os.getpid())


# Threaded: pulls for several shards and reads by replacements run at once.
ReplicaHolderActor = ray.remote(num_cpus=0, max_concurrency=16)(ReplicaHolder)


def truncate_copies(holders: Iterable[Any], step: int) -> None:
    """After a rollback to `step`, copies of later steps belong to a timeline that is gone:
    every holder (a `ReplicaHolder`, or a worker holding copies) forgets them."""
    for h in holders:
        h.truncate.remote(step)
