"""Durable checkpoint files: atomic writes and "latest complete" discovery.

Layout: RUN_DIR/ckpt/step_00000020/shard_00000.pt, one file per shard (a replica group writes
one). A file is *packed*: a small pickled header (the state's structure, each tensor's dtype,
shape and offset) then the tensors' raw bytes, each 64-byte aligned, exactly the flat buffer
of `replication.pack`. `save_atomic` writes the bytes straight from the live tensors' memory
(no serialising copy and no zip CRC, unlike `torch.save`);
`save_packed_atomic` writes a snapshot already packed (`async_ckpt`). Both use plain
`write`s, which hold no GIL, so a background write barely slows the training thread. A file
appears under its final name only after its bytes are fsynced (write to a temp name, fsync,
rename, fsync the directory), so a kill in the middle of a save leaves at most a stray temp
file and never a corrupt checkpoint. A step is complete when every shard is there.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from failbench_ray.replication import Packed, _Slot, layout, raw_bytes, unpack

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def ckpt_root(run_dir: Path) -> Path:
    return run_dir / "ckpt"


def shard_path(run_dir: Path, step: int, shard: int) -> Path:
    return ckpt_root(run_dir) / f"step_{step:08d}" / f"shard_{shard:05d}.pt"


def jit_path(run_dir: Path, step: int, shard: int) -> Path:
    """A just-in-time checkpoint, written by a survivor after a failure."""
    return run_dir / "jit" / f"step_{step:08d}" / f"shard_{shard:05d}.pt"


class _NotifyingWriter(io.RawIOBase):
    """A file whose first write calls `on_first_write` (a failpoint for tests of torn writes)."""

    def __init__(self, f: BinaryIO, on_first_write: Callable[[], None]) -> None:
        self._f = f
        self._hook: Callable[[], None] | None = on_first_write
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        self.nbytes += n
        if self._hook is not None:
            hook, self._hook = self._hook, None
            hook()
        return n


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_MAGIC = b"FAILBENCH-PACKED-1\n"
_CHUNK = 8 << 20  # bytes per write(): the GIL is free during each


def save_atomic(
    state: dict[str, Any], path: Path, on_first_write: Callable[[], None] = lambda: None
) -> tuple[int, float]:
    """Write `state` durably to `path`, its tensors' bytes straight from their memory.
    Returns (bytes, seconds)."""
    t0 = time.perf_counter()
    lay = layout(state)

    def pieces() -> Iterator[memoryview]:
        pos = 0
        for t, (_, _, off, n) in zip(lay.tensors, lay.meta, strict=True):
            if off > pos:
                yield memoryview(bytes(off - pos))  # alignment padding
            if n:
                yield memoryview(raw_bytes(t).numpy())
            pos = off + n
        if lay.nbytes > pos:
            yield memoryview(bytes(lay.nbytes - pos))

    nbytes = _write_atomic(path, _header(lay.skeleton, lay.meta), pieces(), on_first_write)
    return nbytes, time.perf_counter() - t0


def save_packed_atomic(
    packed: Packed, path: Path, on_first_write: Callable[[], None] = lambda: None
) -> tuple[int, float]:
    """Write a packed snapshot durably to `path`. Returns (bytes, seconds)."""
    t0 = time.perf_counter()
    data = packed.buffer.data.cast("B")
    nbytes = _write_atomic(path, _header(packed.skeleton, packed.meta), [data], on_first_write)
    return nbytes, time.perf_counter() - t0


def _header(skeleton: Any, meta: list[Any]) -> bytes:
    header = pickle.dumps((skeleton, meta), protocol=pickle.HIGHEST_PROTOCOL)
    head = _MAGIC + struct.pack("<Q", len(header)) + header
    return head + b"\0" * (-len(head) % 64)  # the buffer starts aligned, like in memory


def _write_atomic(
    path: Path, head: bytes, pieces: Iterable[memoryview], on_first_write: Callable[[], None]
) -> int:
    """Write head + pieces to a temp file, fsync, rename, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb", buffering=0) as f:
        writer = _NotifyingWriter(f, on_first_write)
        writer.write(head)
        for piece in pieces:
            data = piece.cast("B")
            for off in range(0, len(data), _CHUNK):
                view = data[off : off + _CHUNK]
                while view:  # a raw write may be short
                    view = view[writer.write(view) :]
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return writer.nbytes


class _SkeletonUnpickler(pickle.Unpickler):
    """A packed file's header holds plain containers, numbers, strings and slots: nothing
    else is loaded (like `torch.load(weights_only=True)`)."""

    # Files written before the backend moved into the engine name its old module.
    _SLOT_MODULES = (_Slot.__module__, "mechanisms.replication")

    def find_class(self, module: str, name: str) -> Any:
        if module in self._SLOT_MODULES and name == "_Slot":
            return _Slot
        raise pickle.UnpicklingError(f"a checkpoint header may not hold {module}.{name}")


def _load_packed(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        f.seek(len(_MAGIC))
        (n,) = struct.unpack("<Q", f.read(8))
        skeleton, meta = _SkeletonUnpickler(io.BytesIO(f.read(n))).load()
        f.seek(-(len(_MAGIC) + 8 + n) % 64, os.SEEK_CUR)
        buffer = np.fromfile(f, dtype=np.uint8)
    # Views into a buffer this call owns: nothing else holds it.
    return unpack(Packed(skeleton, meta, buffer))  # type: ignore[no-any-return]


def load(path: Path) -> tuple[dict[str, Any], int, float]:
    """Read a checkpoint file. Returns (state, bytes, seconds)."""
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError(f"{path} is not a FailBench checkpoint (no packed-format header)")
    state = _load_packed(path)
    return state, path.stat().st_size, time.perf_counter() - t0


def latest_complete(
    run_dir: Path, shard_ids: Iterable[int], at_most: int | None = None
) -> int | None:
    """The highest step (no later than `at_most`) for which every shard's file exists."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return None
    needed = list(shard_ids)
    steps = sorted(
        (int(m.group(1)) for d in root.iterdir() if (m := _STEP_DIR.match(d.name))), reverse=True
    )
    for step in steps:
        if at_most is not None and step > at_most:
            continue
        if all(shard_path(run_dir, step, s).is_file() for s in needed):
            return step
    return None


def discard_after(run_dir: Path, step: int) -> list[int]:
    """Remove the checkpoints of steps after `step`: training rolled back past them to undo a
    silent corruption, so they hold state of a timeline that was thrown away (a later failure
    must not restore them before the replay writes them again). Returns the steps removed."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    gone = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and int(m.group(1)) > step:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(int(m.group(1)))
    return sorted(gone)
