"""Registries: parts loaded on first use, also when several threads use one at once."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from failbench_ray.errors import SpecError
from failbench_ray.registry import Registry


def test_threads_that_use_a_name_first_together_all_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service's dispatchers start together and each resolves its spec: while one thread
    imports the part's module, the others must wait for it, not find the name missing."""
    (tmp_path / "fb_lazy_host.py").write_text(
        "from failbench_ray.registry import Registry\n"
        "PARTS = Registry('part', {'slow': 'fb_lazy_slow'})\n"
    )
    (tmp_path / "fb_lazy_slow.py").write_text(
        "import time\ntime.sleep(0.3)\nfrom fb_lazy_host import PARTS\nPARTS.add('slow', 42)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("fb_lazy_host", "fb_lazy_slow"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    from fb_lazy_host import PARTS  # type: ignore[import-not-found]

    start = threading.Barrier(8)
    got: list[object] = []

    def use() -> None:
        start.wait(timeout=10)
        try:
            got.append(PARTS.get("slow"))
        except SpecError as err:
            got.append(err)

    threads = [threading.Thread(target=use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [42] * 8


def test_names_are_known_before_their_modules_load() -> None:
    reg: Registry[int] = Registry("part", {"b": "no_such_module_is_imported_for_this"})
    reg.add("a", 1)
    assert reg.names() == ["a", "b"] and "b" in reg and "c" not in reg
    with pytest.raises(SpecError, match="unknown part 'c'; valid: a, b"):
        reg.get("c")
