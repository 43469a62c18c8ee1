"""Just-in-time checkpointing: no periodic cost. After a failure a survivor that holds the same
state as a dead rank writes it to disk, and the replacement loads that file."""

from __future__ import annotations

from mechanisms import MECHANISMS
from mechanisms.base import FromLivePeer


@MECHANISMS.register("jit_ckpt")
class JitCkpt(FromLivePeer):
    name = "jit_ckpt"
    summary = "no periodic cost; after a failure a data-parallel peer checkpoints just in time"
    donor_kind = "jit"
    without_peer = "no data-parallel peer holds the same state to checkpoint"
