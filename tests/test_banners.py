"""Ray's crash banner only for deaths we did not cause (issue 16, item 7): the filter alone,
without Ray. tests/test_cli_run.py checks it in a real run with a real SIGKILL."""

from __future__ import annotations

import threading
from typing import Any

from failbench_ray.banners import BannerFilter


def banner(pid: int) -> str:
    return (
        "A worker died or was killed while executing a task by an unexpected system error. "
        f"Worker IP address: 127.0.0.1 Worker port: 1 Worker PID: {pid} Worker exit type: "
        "SYSTEM_ERROR"
    )


class Sink:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.got = threading.Event()

    def __call__(self, data: dict[str, Any], ignore_prefix: bool) -> None:
        self.lines += data["lines"]
        self.got.set()


def test_a_banner_for_an_injected_death_is_dropped_others_pass() -> None:
    sink = Sink()
    f = BannerFilter(sink, grace_s=0.05)
    f.injected([101])
    f({"lines": [banner(101), "an unrelated raylet line"], "pid": "raylet"}, False)
    assert sink.lines == ["an unrelated raylet line"] and f.dropped == 1
    sink.lines.clear()
    sink.got.clear()
    f({"lines": [banner(202)], "pid": "raylet"}, False)  # a death we did not cause
    assert sink.got.wait(5) and sink.lines == [banner(202)]


def test_a_banner_that_comes_before_the_death_is_matched_waits_for_it() -> None:
    """Ray's banner can beat the controller, which records the PID when it detects the
    death: the banner waits its grace, and the PID recorded meanwhile drops it."""
    sink = Sink()
    f = BannerFilter(sink, grace_s=0.3)
    f({"lines": [banner(303)], "pid": "raylet"}, False)
    f.injected([303])
    assert not sink.got.wait(1.0) and f.dropped == 1
