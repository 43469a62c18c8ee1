"""Every example spec loads and passes every check; there is one per architecture.

Sweep files (a `grid` at the top level, e.g. paper_matrix.yaml) are tested in test_sweep.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from architectures import ARCHITECTURES
from failbench_ray.checks import resolve
from failbench_ray.spec import load_spec

EXAMPLES = [
    p
    for p in sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
    if "grid" not in yaml.safe_load(p.read_text())
]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_a_valid_spec(path: Path) -> None:
    resolve(load_spec(path))


def test_one_example_per_architecture() -> None:
    covered = {load_spec(p).architecture.name for p in EXAMPLES}
    assert covered == set(ARCHITECTURES.names())
