"""Sweeps: the expansion (pure, no Ray), the sweep tables on SQLite and PostgreSQL, and
`failbench sweep` / `failbench list --matrix` run as a user runs them (subprocesses, each with
its own local Ray cluster): resume, an interrupted cell, a failed cell, Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import select

from architectures import ARCHITECTURES
from failbench_ray import catalog
from failbench_ray import sweep as sw
from failbench_ray.checks import resolve
from failbench_ray.errors import NotApplicableError, SpecError
from failbench_ray.models import param_count
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.tables import Experiment, SweepCell
from mechanisms import MECHANISMS
from mechanisms.base import FailureContext, Mechanism, RecoveryPlan
from tests.test_cli_errors import REPO, _env
from tests.test_cli_run import session_processes

# Every rank holds at least 256 parameter values (the controller samples 256 per rank).
TINY = {"kind": "mlp", "input_dim": 8, "hidden_dim": 32, "depth": 2}


def sweep_data(grid: dict[str, Any], **base: Any) -> dict[str, Any]:
    return {
        "name": "t",
        "base": {"steps": 10, "batch_size": 8, "model": TINY, **base},
        "grid": {"architecture": ["ddp"], "mechanism": ["none"], "failures": ["single"], **grid},
    }


def expand(data: dict[str, Any]) -> list[sw.Cell]:
    return sw.expand(sw.parse_sweep(data))


# ---------------------------------------------------------------------------------------------
# Expansion


def test_cells_vary_architecture_then_mechanism_then_trace_then_the_rest() -> None:
    cells = expand(
        sweep_data(
            {
                "architecture": ["ddp", {"name": "hybrid", "params": {"dp": 2, "pp": 2}}],
                "mechanism": ["none", {"name": "disk_ckpt", "params": {"interval": 4}}],
                "failures": ["single", {"kind": "single", "rank": 3, "at_step": 3}],
                # given before world_size in the file; keys follow the spec's field order
                "seed": [7],
                "world_size": [2, 4],
            }
        )
    )
    keys = [c.key for c in cells]
    assert keys[:8] == [
        "ddp/none/single/world_size=2/seed=7",
        "ddp/none/single/world_size=4/seed=7",
        "ddp/none/single(3@step=3)/world_size=2/seed=7",
        "ddp/none/single(3@step=3)/world_size=4/seed=7",
        "ddp/disk_ckpt/single/world_size=2/seed=7",
        "ddp/disk_ckpt/single/world_size=4/seed=7",
        "ddp/disk_ckpt/single(3@step=3)/world_size=2/seed=7",
        "ddp/disk_ckpt/single(3@step=3)/world_size=4/seed=7",
    ]
    assert len(keys) == len(set(keys)) == 16
    assert [c.key for c in expand(sweep_data({"world_size": [2, 4], "seed": [7]}))] == [
        "ddp/none/single/world_size=2/seed=7",
        "ddp/none/single/world_size=4/seed=7",
    ]
    by_key = {c.key: c for c in cells}

    runnable = by_key["ddp/disk_ckpt/single/world_size=4/seed=7"]
    assert runnable.reason is None and runnable.spec is not None
    spec = runnable.spec
    assert spec.name == "t/ddp/disk_ckpt/single/world_size=4/seed=7"
    assert (spec.world_size, spec.seed, spec.steps, spec.batch_size) == (4, 7, 10, 8)
    assert spec.mechanism.params == {"interval": 4}
    # the shorthand, made concrete: rank 1, 60% into the run
    assert spec.failures.kind == "single"
    assert [(e.ranks, e.at_step) for e in spec.failures.events] == [([1], 6)]

    # a failure rank outside a small world: refused by the spec itself
    outside = by_key["ddp/none/single(3@step=3)/world_size=2/seed=7"]
    assert outside.spec is None
    assert outside.reason == (
        "invalid spec: spec: failure rank(s) [3] outside the world: ranks are 0..1"
    )
    # a hybrid shape that does not fit the world: refused by the architecture's check
    shape = by_key["hybrid/none/single/world_size=2/seed=7"]
    assert shape.spec is not None and shape.reason is not None
    assert "hybrid dp x pp x tp = 2 x 2 x 1 = 4 != world_size=2" in shape.reason
    assert not by_key["hybrid/disk_ckpt/single/world_size=4/seed=7"].skipped

    again = expand(
        sweep_data(
            {
                "architecture": ["ddp", {"name": "hybrid", "params": {"dp": 2, "pp": 2}}],
                "mechanism": ["none", {"name": "disk_ckpt", "params": {"interval": 4}}],
                "failures": ["single", {"kind": "single", "rank": 3, "at_step": 3}],
                "world_size": [2, 4],
                "seed": [7],
            }
        )
    )
    assert [(c.key, c.spec, c.reason) for c in again] == [(c.key, c.spec, c.reason) for c in cells]
    assert sw.spec_hash(again) == sw.spec_hash(cells)


def test_shorthand_traces_fit_the_world_and_the_steps() -> None:
    assert sw.standard_trace("single", 4, 20) == {"kind": "single", "rank": 1, "at_step": 12}
    assert sw.standard_trace("concurrent", 4, 20)["ranks"] == [1, 2]
    assert sw.standard_trace("concurrent", 2, 20)["ranks"] == [0, 1]
    assert sw.standard_trace("cascading", 8, 60)["events"] == [
        {"rank": 1, "at_step": 36},
        {"rank": 2, "during": "restoring"},
    ]
    assert sw.standard_trace("none", 4, 20) == {"kind": "none"}
    cells = expand(sweep_data({"failures": ["none", "single", "concurrent", "cascading"]}))
    assert [c.key for c in cells] == [
        "ddp/none/none",
        "ddp/none/single",
        "ddp/none/concurrent",
        "ddp/none/cascading",
    ]
    assert all(c.spec is not None and not c.skipped for c in cells), [c.reason for c in cells]


def test_a_part_listed_with_several_parameter_sets_is_keyed_by_them() -> None:
    cells = expand(
        sweep_data(
            {
                "mechanism": [
                    {"name": "disk_ckpt", "params": {"interval": 2}},
                    {"name": "disk_ckpt", "params": {"interval": 5}},
                ]
            }
        )
    )
    assert [c.key for c in cells] == [
        "ddp/disk_ckpt(interval=2)/single",
        "ddp/disk_ckpt(interval=5)/single",
    ]
    assert {c.mechanism for c in cells} == {"disk_ckpt"}


class _OnlyOnDDP(Mechanism):
    name = "_test_only_on_ddp"
    summary = "test only: applies to ddp, and recovers from a survivor"
    needs_survivor = True

    def not_applicable(self, arch: Any) -> str | None:
        return None if arch.name == "ddp" else f"needs a ddp replica, {arch.name} has none"

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        return RecoveryPlan(tuple(sorted(failure.dead)), "scratch", 0)


@pytest.fixture
def only_on_ddp() -> Iterator[str]:
    MECHANISMS.add(_OnlyOnDDP.name, _OnlyOnDDP)
    try:
        yield _OnlyOnDDP.name
    finally:
        MECHANISMS._items.pop(_OnlyOnDDP.name)


def test_a_mechanism_that_does_not_apply_is_skipped_with_its_reason(only_on_ddp: str) -> None:
    cells = expand(
        sweep_data(
            {
                "architecture": ["ddp", "gossip"],
                "mechanism": [only_on_ddp],
                "failures": ["single", "concurrent"],
            },
            world_size=2,
        )
    )
    reasons = {c.key: c.reason for c in cells}
    name = only_on_ddp
    assert reasons[f"ddp/{name}/single"] is None
    # at world size 2 the concurrent shorthand kills both ranks: no survivor to recover from
    assert "kills every rank" in str(reasons[f"ddp/{name}/concurrent"])
    assert reasons[f"gossip/{name}/single"] == (
        f"{name} on gossip: not applicable: needs a ddp replica, gossip has none"
    )
    spec = next(c.spec for c in cells if c.key == f"gossip/{name}/single")
    assert spec is not None
    with pytest.raises(NotApplicableError):  # what `failbench run` of that spec refuses
        resolve(spec)


BAD_SWEEPS: dict[str, tuple[dict[str, Any], str]] = {
    "unknown_mechanism": (
        sweep_data({"mechanism": ["none", "nope"]}),
        "invalid sweep: grid.mechanism[1]: unknown mechanism 'nope'; valid: ",
    ),
    "unknown_architecture": (
        sweep_data({"architecture": ["ddp", {"name": "ring"}]}),
        "invalid sweep: grid.architecture[1]: unknown architecture 'ring'; valid: ddp, ",
    ),
    "bad_shorthand": (
        sweep_data({"failures": ["singel"]}),
        "invalid sweep: grid.failures: [0] 'singel' is not a trace shorthand",
    ),
    "bad_trace": (
        sweep_data({"failures": [{"kind": "single", "rank": 1}]}),
        "exactly one of at_step, at_seconds, during",
    ),
    "axis_in_base": (
        {**sweep_data({}), "base": {"mechanism": "none"}},
        "invalid sweep: base.mechanism: put it in the grid as a list",
    ),
    "unknown_base_field": (
        sweep_data({}, stepz=3),
        "invalid sweep: base.stepz is not an experiment field; valid: world_size, ",
    ),
    "bad_base_value": (sweep_data({}, steps="many"), "invalid sweep: base.steps: "),
    "not_a_list": (sweep_data({"seed": 3}), "seed must be a non-empty list of values"),
    "in_base_and_grid": (sweep_data({"seed": [1, 2]}, seed=0), "seed is both in base and"),
    "repeated_value": (sweep_data({"seed": [1, 1]}), "grid.seed lists seed=1 twice"),
    "repeated_part": (sweep_data({"mechanism": ["none", "none"]}), "lists none twice"),
    "missing_axis": (
        {"name": "t", "grid": {"architecture": ["ddp"], "failures": ["single"]}},
        "grid.mechanism: Field required",
    ),
    "name_in_grid": (sweep_data({"name": ["a"]}), "`name` cannot vary"),
    "an_experiment_spec": (
        {"architecture": "ddp", "steps": 10},
        "invalid sweep: no grid; this looks like an experiment spec (run it with `failbench run`)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SWEEPS))
def test_a_bad_sweep_is_refused_with_one_line(case: str) -> None:
    data, phrase = BAD_SWEEPS[case]
    with pytest.raises(SpecError) as info:
        expand(data)
    message = str(info.value)
    assert "\n" not in message and phrase in message, message


def test_unknown_names_list_the_registered_ones() -> None:
    with pytest.raises(SpecError) as info:
        expand(BAD_SWEEPS["unknown_mechanism"][0])
    assert str(info.value).endswith("valid: " + ", ".join(MECHANISMS.names()))


PAPER_MATRIX = REPO / "examples" / "paper_matrix.yaml"


def test_paper_matrix_expands_to_every_pair_and_trace() -> None:
    """7 architectures x 9 mechanisms x 3 traces; each cell a spec that passes every check, or
    skipped with the reason. Fails until all nine mechanism names are registered."""
    cells = sw.expand(sw.load_sweep(PAPER_MATRIX))
    assert len(cells) == 7 * 9 * 3 == len({c.key for c in cells})
    assert {c.architecture for c in cells} == set(ARCHITECTURES.names())
    assert {c.trace for c in cells} == {"single", "concurrent", "cascading"}
    assert len({c.mechanism for c in cells}) == 9
    for c in cells:
        assert c.spec is not None, c  # every cell is a well-formed spec
        assert c.reason is None or c.reason.strip(), c
        assert c.spec.world_size == 4 and c.spec.trials == 1
    # the base fits every architecture: the baselines of the paper never skip
    assert all(not c.skipped for c in cells if c.mechanism in ("none", "disk_ckpt")), [
        (c.key, c.reason) for c in cells if c.skipped and c.mechanism in ("none", "disk_ckpt")
    ]


def test_the_findings_sweep_is_sized_for_the_papers_claims() -> None:
    """Issue 18: state of the paper's order (500 MB of parameters and Adam state per rank on
    the replicated layouts, 1 GB did not fit this machine with replicas; over 100 MB on the
    sharded ones), 3 trials a cell, the steady state spanning 3 checkpoint intervals or more,
    and the cells each claim needs."""
    cells = sw.expand(sw.load_sweep(REPO / "examples" / "findings.yaml"))
    ran = [c for c in cells if not c.skipped]
    assert all(c.spec is not None for c in ran)
    spec = ran[0].spec
    assert spec is not None
    whole = 3 * 4 * param_count(spec.model)  # fp32 parameters + Adam's two moments
    assert whole >= 500e6 and whole / spec.world_size >= 100e6  # ddp's and a quarter shard's
    for c in ran:
        assert c.spec is not None and c.spec.trials >= 3
        interval = c.spec.mechanism.params.get("interval")
        if interval:
            steady = c.spec.failures.model_dump()["events"][0]["at_step"] - c.spec.warmup_steps
            assert steady >= 3 * interval, c.key
    have = {(c.architecture, c.mechanism) for c in ran}
    assert {("ddp", m) for m in ("disk_ckpt", "inmem_replica", "jit_ckpt")} <= have  # claim 1
    assert any(a == "gossip" for a, _ in have)  # claim 2
    assert {a for a, m in have if m == "inmem_replica"} == set(ARCHITECTURES.names())  # claim 3
    # The top of the range: 1 GB per rank on ddp, in a file of its own (its cells fit apart).
    big = [c for c in sw.expand(sw.load_sweep(REPO / "examples" / "findings_1gb.yaml"))]
    assert big and not any(c.skipped for c in big)
    for c in big:
        assert c.spec is not None and c.spec.trials >= 3
        assert 3 * 4 * param_count(c.spec.model) >= 1e9 and c.architecture == "ddp"


# ---------------------------------------------------------------------------------------------
# Storage, on SQLite and PostgreSQL


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    url = f"sqlite:///{tmp_path / 'fb.db'}" if request.param == "sqlite" else None
    url = url or request.getfixturevalue("pg_url")
    with Database(url) as database:
        yield database


def new_cells(n: int, skipped: tuple[int, ...] = ()) -> list[repo.NewCell]:
    return [
        repo.NewCell(f"ddp/m{i}/single", "ddp", f"m{i}", "single", "n/a" if i in skipped else None)
        for i in range(n)
    ]


def test_get_or_create_finds_the_same_sweep_by_name_and_hash(db: Database) -> None:
    with db.session() as s:
        a, created = repo.get_or_create_sweep(
            s, name="s", spec={"x": 1}, spec_hash="h1", cells=new_cells(3, skipped=(1,))
        )
        assert created
    with db.session() as s:
        assert repo.get_or_create_sweep(
            s, name="s", spec={"x": 1}, spec_hash="h1", cells=new_cells(3)
        ) == (a, False)
        b, created = repo.get_or_create_sweep(
            s, name="s", spec={"x": 2}, spec_hash="h2", cells=new_cells(2)
        )
        c, _ = repo.get_or_create_sweep(s, name="t", spec={}, spec_hash="h1", cells=new_cells(1))
        assert created and len({a, b, c}) == 3
    with db.session() as s:
        sweep = repo.get_sweep(s, a)
        assert (sweep.name, sweep.spec, sweep.status) == ("s", {"x": 1}, "pending")
        cells = repo.list_sweep_cells(s, a)
        assert [(c.key, c.status, c.reason) for c in cells] == [
            ("ddp/m0/single", "pending", None),
            ("ddp/m1/single", "skipped", "n/a"),
            ("ddp/m2/single", "pending", None),
        ]
        assert repo.sweep_progress(s, a) == {
            "pending": 2, "running": 0, "completed": 0, "failed": 0, "skipped": 1
        }  # fmt: skip


def test_cell_lifecycle(db: Database) -> None:
    with db.session() as s:
        sweep_id, _ = repo.get_or_create_sweep(
            s, name="s", spec={}, spec_hash="h", cells=new_cells(4, skipped=(3,))
        )
        exp = repo.create_experiment(s, spec={}, architecture="ddp", mechanism="m0")
    with db.session() as s:
        assert repo.claim_cell(s, sweep_id, "ddp/m0/single")
        assert not repo.claim_cell(s, sweep_id, "ddp/m0/single")  # already running
        assert not repo.claim_cell(s, sweep_id, "ddp/m3/single")  # skipped
        repo.set_experiment_sweep(s, exp, sweep_id)
        repo.set_cell_status(s, sweep_id, "ddp/m0/single", "running", experiment_id=exp)
        repo.set_cell_status(s, sweep_id, "ddp/m0/single", "completed")
        repo.set_cell_status(s, sweep_id, "ddp/m1/single", "failed", reason="boom")
        repo.set_cell_status(s, sweep_id, "ddp/m2/single", "running")
        with pytest.raises(ValueError, match="unknown cell status 'done'"):
            repo.set_cell_status(s, sweep_id, "ddp/m2/single", "done")
        with pytest.raises(LookupError):
            repo.set_cell_status(s, sweep_id, "no/such/cell", "failed")
    with db.session() as s:
        assert repo.get_experiment(s, exp).sweep_id == sweep_id
        cells = {c.key: c for c in repo.list_sweep_cells(s, sweep_id)}
        assert cells["ddp/m0/single"].experiment_id == exp  # kept by a later status change
        assert cells["ddp/m1/single"].reason == "boom"
        assert repo.reset_cells(s, sweep_id, ["running"]) == ["ddp/m2/single"]
        assert repo.sweep_progress(s, sweep_id) == {
            "pending": 1, "running": 0, "completed": 1, "failed": 1, "skipped": 1
        }  # fmt: skip
        # today's expansion: m3 now applies, m2 no longer does; run cells are left alone
        today = {"ddp/m0/single": "n/a", "ddp/m1/single": None, "ddp/m2/single": "gone"}
        repo.refresh_skipped(s, sweep_id, {**today, "ddp/m3/single": None})
        states = {c.key: (c.status, c.reason) for c in repo.list_sweep_cells(s, sweep_id)}
        assert states == {
            "ddp/m0/single": ("completed", None),
            "ddp/m1/single": ("failed", "boom"),
            "ddp/m2/single": ("skipped", "gone"),
            "ddp/m3/single": ("pending", None),
        }
        repo.set_sweep_status(s, sweep_id, "completed")
    with db.session() as s:  # deleting an experiment leaves its cell, without the link
        s.delete(repo.get_experiment(s, exp))
    with db.session() as s:
        cell = s.scalars(select(SweepCell).where(SweepCell.key == "ddp/m0/single")).one()
        assert cell.experiment_id is None and cell.status == "completed"
        assert repo.get_sweep(s, sweep_id).status == "completed"


def test_experiment_ids_by_prefix(db: Database) -> None:
    with db.session() as s:
        ids = [repo.create_experiment(s, spec={}, architecture="a", mechanism="m") for _ in "ab"]
        assert repo.find_experiment_id(s, ids[0]) == ids[0]
        assert repo.find_experiment_id(s, ids[1][:8]) == ids[1]
        with pytest.raises(repo.ExperimentNotFound, match="no experiment with id ab_%"):
            repo.find_experiment_id(s, "ab_%")
        with pytest.raises(repo.ExperimentNotFound):
            repo.find_experiment_id(s, ids[0][:2])  # too short to mean one


def test_prepare_finds_the_sweep_again_and_resets_interrupted_cells(db: Database) -> None:
    sweep = sw.parse_sweep(sweep_data({"mechanism": ["none", "disk_ckpt"], "seed": [0, 1]}))
    cells = sw.expand(sweep)
    sweep_id = sw.prepare(db, sweep, cells, retry_failed=False)
    assert sw.prepare(db, sweep, sw.expand(sweep), retry_failed=False) == sweep_id
    other = sw.parse_sweep(sweep_data({"mechanism": ["none", "disk_ckpt"], "seed": [0, 2]}))
    assert sw.prepare(db, other, sw.expand(other), retry_failed=False) != sweep_id
    with db.session() as s:
        repo.set_cell_status(s, sweep_id, "ddp/none/single/seed=0", "completed")
        repo.set_cell_status(s, sweep_id, "ddp/none/single/seed=1", "failed", reason="x")
        repo.set_cell_status(s, sweep_id, "ddp/disk_ckpt/single/seed=0", "running")
    assert sw.prepare(db, sweep, cells, retry_failed=False) == sweep_id
    assert sw.pending_keys(db, sweep_id) == [
        "ddp/disk_ckpt/single/seed=0",  # was running: cut off, so it runs again
        "ddp/disk_ckpt/single/seed=1",
    ]
    sw.prepare(db, sweep, cells, retry_failed=True)
    assert sw.pending_keys(db, sweep_id) == [
        "ddp/none/single/seed=1",
        "ddp/disk_ckpt/single/seed=0",
        "ddp/disk_ckpt/single/seed=1",
    ]


# ---------------------------------------------------------------------------------------------
# `failbench sweep` and `failbench list --matrix`, as a user runs them


def failbench(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "failbench_ray.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def write_sweep(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


SMALL: dict[str, Any] = {
    "name": "small",
    "base": {
        "world_size": 2,
        "model": TINY,
        "optimizer": {"name": "adam", "lr": 0.01},
        "steps": 10,
        "batch_size": 8,
        "warmup_steps": 1,
        "pg_timeout_s": 60,
    },
    "grid": {
        # hybrid's default 2 x 2 shape needs 4 ranks: skipped at world size 2
        "architecture": ["ddp", "pipeline", "hybrid"],
        "mechanism": ["none", {"name": "disk_ckpt", "params": {"interval": 4}}],
        "failures": ["single"],
    },
}


def cell_rows(db_url: str) -> dict[str, tuple[str, str | None]]:
    with Database(db_url) as db, db.session() as s:
        (sweep_id,) = s.scalars(select(SweepCell.sweep_id).distinct())
        return {c.key: (c.status, c.experiment_id) for c in repo.list_sweep_cells(s, sweep_id)}


def experiments(db_url: str) -> dict[str, tuple[str, str | None]]:
    with Database(db_url) as db, db.session() as s:
        return {e.id: (e.status, e.sweep_id) for e in s.scalars(select(Experiment))}


def test_sweep_runs_every_cell_then_resumes_where_it_stopped(tmp_path: Path) -> None:
    path = write_sweep(tmp_path / "small.yaml", SMALL)
    url = f"sqlite:///{tmp_path / 'fb.db'}"
    log = tmp_path / "resources.jsonl"
    first = failbench(
        "sweep", str(path), "--db", url, "--json", "--resource-log", str(log), cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["status"] == "completed"
    # Trials reused started processes, and no cell left an actor behind.
    assert report["pool"]["reused"] > 0
    samples = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["cell"] for s in samples] == [
        "ddp/none/single", "ddp/disk_ckpt/single", "pipeline/none/single",
        "pipeline/disk_ckpt/single",
    ]  # fmt: skip
    for s in samples:
        assert s["other_actors_alive"] == [], s
        assert s["driver"]["rss_bytes"] > 0 and s["driver"]["threads"] > 0
        assert all(w["open_files"] > 0 for w in s["pooled"]) and s["idle"] == len(s["pooled"])
    assert report["progress"] == {
        "pending": 0, "running": 0, "completed": 4, "failed": 0, "skipped": 2
    }  # fmt: skip
    cells = {c["key"]: c for c in report["cells"]}
    assert list(cells) == [
        "ddp/none/single", "ddp/disk_ckpt/single", "pipeline/none/single",
        "pipeline/disk_ckpt/single", "hybrid/none/single", "hybrid/disk_ckpt/single",
    ]  # fmt: skip
    for key in ("ddp/disk_ckpt/single", "pipeline/disk_ckpt/single"):
        assert cells[key]["matches_baseline"] is True  # rolled back and replayed exactly
        assert cells[key]["recovery_s"] > 0 and cells[key]["overhead_pct"] is not None
    assert "4 != world_size=2" in cells["hybrid/none/single"]["reason"]
    assert "sweep small" in first.stderr and "4/4" in first.stderr  # the progress bar

    rows = cell_rows(url)
    exps = experiments(url)
    assert {k: s for k, (s, _) in rows.items()} == {k: c["status"] for k, c in cells.items()}
    run_ids = {k: str(e) for k, (s, e) in rows.items() if s == "completed"}
    assert set(exps) == set(run_ids.values())
    assert all(exp == ("completed", report["sweep_id"]) for exp in exps.values())
    # One baseline per architecture: the second cell copies the first's (same digest)
    for arch in ("ddp", "pipeline"):
        assert cells[f"{arch}/none/single"]["baseline_from"] is None
        assert cells[f"{arch}/disk_ckpt/single"]["baseline_from"] == run_ids[f"{arch}/none/single"]
    with Database(url) as db, db.session() as s:
        result = repo.load_result(s, run_ids["ddp/disk_ckpt/single"])
    assert result.spec["name"] == "small/ddp/disk_ckpt/single"
    assert result.trials[0].failures[0].ranks == [1]

    # Again: everything is done, nothing runs (not even Ray), the same table comes back.
    second = failbench("sweep", str(path), "--db", url, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert cell_rows(url) == rows and experiments(url) == exps
    assert "sweep small: 4 completed, 2 skipped" in second.stdout
    assert run_ids["pipeline/none/single"][:8] in second.stdout
    assert "4 != world_size=2" in " ".join(second.stdout.split())

    # A cell left `running` (its process died): the next run runs that cell and only it.
    with Database(url) as db, db.session() as s:
        repo.set_cell_status(s, report["sweep_id"], "pipeline/none/single", "running")
    third = failbench("sweep", str(path), "--db", url, "--json", cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    after = cell_rows(url)
    new_id = after["pipeline/none/single"][1]
    assert after["pipeline/none/single"][0] == "completed"
    assert new_id not in exps
    assert {k: v for k, v in after.items() if k != "pipeline/none/single"} == {
        k: v for k, v in rows.items() if k != "pipeline/none/single"
    }
    assert set(experiments(url)) == set(exps) | {new_id}
    third_cells = {c["key"]: c for c in json.loads(third.stdout)["cells"]}
    assert json.loads(third.stdout)["status"] == "completed"
    # the re-run shares the baseline its architecture's completed cells ran first
    assert third_cells["pipeline/none/single"]["baseline_from"] == run_ids["pipeline/none/single"]


@pytest.mark.postgres
def test_a_failed_cell_stays_failed_unless_retried(tmp_path: Path, pg_url: str) -> None:
    """On PostgreSQL: the whole path (cells, experiments, the report) on the shared database."""
    data = {
        **SMALL,
        "name": "failing",
        "base": {**SMALL["base"], "max_recoveries": 0, "baseline": False},
        "grid": {"architecture": ["ddp"], "mechanism": ["none"], "failures": ["single"]},
    }
    path = write_sweep(tmp_path / "failing.yaml", data)
    url = pg_url
    first = failbench("sweep", str(path), "--db", url, cwd=tmp_path)
    assert first.returncode == 1, first.stderr
    assert "1 failed" in first.stdout and "max_recoveries" in first.stdout
    (before,) = cell_rows(url).values()
    assert before[0] == "failed"
    again = failbench("sweep", str(path), "--db", url, "--json", cwd=tmp_path)
    assert again.returncode == 1
    (cell,) = json.loads(again.stdout)["cells"]
    assert (cell["status"], cell["experiment_id"]) == before
    assert "gave up after 0 recoveries" in cell["reason"]
    retried = failbench("sweep", str(path), "--db", url, "--retry-failed", cwd=tmp_path)
    assert retried.returncode == 1
    (after,) = cell_rows(url).values()
    assert after[0] == "failed" and after[1] != before[1]
    assert len(experiments(url)) == 2


def test_ctrl_c_puts_the_running_cell_back_to_pending(tmp_path: Path) -> None:
    data = {
        **SMALL,
        "name": "endless",
        "base": {**SMALL["base"], "steps": 100000, "baseline": False},
        "grid": {"architecture": ["ddp"], "mechanism": ["none"], "failures": ["none"]},
    }
    path = write_sweep(tmp_path / "endless.yaml", data)
    url = f"sqlite:///{tmp_path / 'fb.db'}"
    Database(url).dispose()  # migrated before the sweep starts: the test polls it meanwhile
    proc = subprocess.Popen(
        [sys.executable, "-m", "failbench_ray.cli", "sweep", str(path), "--db", url],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        # and Ctrl-C's default action, even when this suite runs as a background job (which
        # a shell starts with SIGINT ignored, and children would inherit that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if any(e for _, e in cell_rows_or_empty(url).values()):
                break
            time.sleep(0.5)
        time.sleep(3)  # let the trial train for a while
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        assert "interrupted" in stderr
        with Database(url) as db, db.session() as s:
            (cell,) = s.scalars(select(SweepCell))
            assert (cell.status, cell.reason) == ("pending", "interrupted (Ctrl-C)")
            assert repo.get_sweep(s, cell.sweep_id).status == "interrupted"
            assert cell.experiment_id is not None
            assert repo.get_experiment(s, cell.experiment_id).status == "interrupted"
        deadline = time.monotonic() + 20
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert session_processes(proc.pid) == [], "processes of the sweep outlived it"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def cell_rows_or_empty(url: str) -> dict[str, tuple[str, str | None]]:
    """The cells of every sweep (none before the sweep is in the database)."""
    with Database(url) as db, db.session() as s:
        return {c.key: (c.status, c.experiment_id) for c in s.scalars(select(SweepCell))}


def test_dry_run_prints_the_grid_and_runs_nothing(tmp_path: Path) -> None:
    path = write_sweep(tmp_path / "small.yaml", SMALL)
    r = failbench("sweep", str(path), "--dry-run", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cells = json.loads(r.stdout)
    assert [(c["key"], c["skipped"]) for c in cells] == [
        ("ddp/none/single", False), ("ddp/disk_ckpt/single", False),
        ("pipeline/none/single", False), ("pipeline/disk_ckpt/single", False),
        ("hybrid/none/single", True), ("hybrid/disk_ckpt/single", True),
    ]  # fmt: skip
    assert cells[1]["spec"]["failures"]["events"][0]["ranks"] == [1]
    table = failbench("sweep", str(path), "--dry-run", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "6 cells, 4 to run" in table.stdout and "skip [1]" in table.stdout
    assert "[1] hybrid dp x pp x tp" in table.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.yaml"]  # no database, no runs


def test_an_unknown_mechanism_exits_2_with_one_line(tmp_path: Path) -> None:
    data = {**SMALL, "grid": {**SMALL["grid"], "mechanism": ["none", "no_such_mechanism"]}}
    path = write_sweep(tmp_path / "bad.yaml", data)
    r = failbench("sweep", str(path), cwd=tmp_path)
    assert r.returncode == 2, r
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        "error: invalid sweep: grid.mechanism[1]: unknown mechanism 'no_such_mechanism'; "
        f"valid: {', '.join(MECHANISMS.names())}"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # refused before anything


def test_list_matrix(tmp_path: Path) -> None:
    rows = catalog.matrix()
    mechs = catalog.mechanism_names()
    assert mechs[0] == "none" and sorted(mechs) == MECHANISMS.names()
    assert [(r["architecture"], r["mechanism"]) for r in rows] == [
        (a, m) for a in ARCHITECTURES.names() for m in mechs
    ]
    for r in rows:
        assert r["applicable"] is (r["reason"] is None), r
        assert r["reason"] is None or r["reason"].strip(), r
    # the baseline mechanisms apply to every architecture's example
    assert all(r["applicable"] for r in rows if r["mechanism"] in ("none", "disk_ckpt"))

    as_json = failbench("list", "--matrix", "--json", cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == rows
    table = failbench("list", "--matrix", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    text = " ".join(table.stdout.split())
    for arch in ARCHITECTURES.names():
        assert any(line.startswith(arch + " ") for line in lines), arch
    for m in mechs:
        assert all(part in table.stdout for part in m.split("_")), m
    for r in rows:
        if not r["applicable"]:
            assert f"{r['mechanism']} on {r['architecture']}" in text
            assert " ".join(r["reason"].split()) in text
