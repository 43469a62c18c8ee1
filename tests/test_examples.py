"""Every example spec loads and passes every check; there is one per architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from architectures import ARCHITECTURES
from failbench_ray.checks import resolve
from failbench_ray.spec import load_spec

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_a_valid_spec(path: Path) -> None:
    resolve(load_spec(path))


def test_one_example_per_architecture() -> None:
    covered = {load_spec(p).architecture.name for p in EXAMPLES}
    assert covered == set(ARCHITECTURES.names())
