"""Kill kinds: how a worker is made to fail-stop. Each is one entry in `KILL_KINDS`."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from typing import Any

from failbench_ray.registry import Registry


@dataclass(frozen=True)
class KillKind:
    name: str
    summary: str
    by_worker: bool  # True: the victim ends itself when told (it must reach a failpoint)

    def kill(self, pid: int, handle: Any) -> None:
        """Executed by the chaos actor for kinds that are not `by_worker`."""
        if self.name == "sigkill":
            with contextlib.suppress(ProcessLookupError):  # already gone: nothing to kill
                os.kill(pid, signal.SIGKILL)
        elif self.name == "ray_kill":
            import ray

            ray.kill(handle, no_restart=True)


KILL_KINDS: Registry[KillKind] = Registry("kill kind")
KILL_KINDS.add(
    "sigkill", KillKind("sigkill", "SIGKILL of the worker process (true fail-stop)", False)
)
KILL_KINDS.add("ray_kill", KillKind("ray_kill", "ray.kill of the worker actor", False))
KILL_KINDS.add("exit", KillKind("exit", "the worker calls os._exit(1) at the trigger", True))
