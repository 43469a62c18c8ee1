"""Durable checkpoint files: atomic writes and "latest complete" discovery.

Layout: RUN_DIR/ckpt/step_00000020/shard_00000.pt, one file per shard (a replica group writes
one). A file appears under its final name only after its bytes are fsynced (write to a temp
name, fsync, rename, fsync the directory), so a kill in the middle of a save leaves at most a
stray temp file and never a corrupt checkpoint. A step is complete when every shard is there.
"""

from __future__ import annotations

import io
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch

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


def save_atomic(
    state: dict[str, Any], path: Path, on_first_write: Callable[[], None] = lambda: None
) -> tuple[int, float]:
    """Write `state` durably to `path`. Returns (bytes, seconds)."""
    t0 = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb", buffering=1 << 22) as f:
        writer = _NotifyingWriter(f, on_first_write)
        torch.save(state, writer)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return writer.nbytes, time.perf_counter() - t0


def load(path: Path) -> tuple[dict[str, Any], int, float]:
    """Read a checkpoint file. Returns (state, bytes, seconds)."""
    t0 = time.perf_counter()
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state, path.stat().st_size, time.perf_counter() - t0


def latest_complete(run_dir: Path, shard_ids: Iterable[int]) -> int | None:
    """The highest step for which every shard's file exists."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return None
    needed = list(shard_ids)
    steps = sorted(
        (int(m.group(1)) for d in root.iterdir() if (m := _STEP_DIR.match(d.name))), reverse=True
    )
    for step in steps:
        if all(shard_path(run_dir, step, s).is_file() for s in needed):
            return step
    return None
