"""Live peer recovery (torchft): survivors never roll back; a replacement heals from a live
peer's state at the current step, sent through the object store."""

from __future__ import annotations

from mechanisms import MECHANISMS
from mechanisms.base import FromLivePeer


@MECHANISMS.register("live_recovery")
class LiveRecovery(FromLivePeer):
    name = "live_recovery"
    summary = "replacements heal from a live peer at the current step, no rollback (torchft)"
    donor_kind = "peer"
    without_peer = "no live peer holds the same state to heal from"
