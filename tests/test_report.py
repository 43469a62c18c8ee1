"""`failbench report` on a small real sweep: its tables match the database, its PNGs are
images, and what was skipped is listed with the reason."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
from sqlalchemy import select

from failbench_ray import report
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.tables import SweepCell, Trial
from tests.test_sweep import TINY, failbench, write_sweep

SWEEP: dict[str, Any] = {
    "name": "report",
    "base": {
        "world_size": 2,
        "model": TINY,
        "optimizer": {"name": "adam", "lr": 0.01},
        "steps": 24,
        "batch_size": 8,
        "trials": 2,
        "warmup_steps": 2,
        "pg_timeout_s": 60,
    },
    "grid": {
        "architecture": ["ddp", "pipeline", "hybrid"],  # hybrid: skipped at world size 2
        "mechanism": [
            {"name": "disk_ckpt", "params": {"interval": 4}},
            {"name": "inmem_replica", "params": {"interval": 2}},
        ],
        "failures": ["single"],
    },
}


def test_report_tables_match_the_database_and_figures_are_images(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fb.db'}"
    ran = failbench(
        "sweep", str(write_sweep(tmp_path / "s.yaml", SWEEP)), "--db", url, cwd=tmp_path
    )
    assert ran.returncode == 0, ran.stderr
    out = tmp_path / "rep"
    made = failbench("report", "--db", url, "--out", str(out), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "<table>" in page

    with Database(url) as db:
        written = report.write(db, tmp_path / "again")
        with db.session() as s:
            cells = s.scalars(select(SweepCell).where(SweepCell.status == "completed")).all()
            assert len(cells) == 4
            for cell in cells:
                trials = s.scalars(
                    select(Trial).where(
                        Trial.experiment_id == cell.experiment_id, Trial.kind == "trial"
                    )
                ).all()
                assert len(trials) == 2
                mean = statistics.fmean(t.overhead_pct for t in trials)
                row = next(r for r in written["cells"] if r["cell"] == cell.key)
                assert row["overhead_pct"] == mean and row["trials"] == 2
                lo, hi = row["overhead_ci95"]
                assert lo <= mean <= hi
                result = repo.load_result(s, cell.experiment_id)
                lost = [f.lost_steps for t in result.trials for f in t.failures]
                assert row["lost_steps"] == statistics.median(lost)
                assert row["oracle"] == "exact"  # both roll back and replay exactly
                # Loss progress at matched samples, from the records in the database: an exact
                # replay sees the baseline's samples in the baseline's order.
                by_samples = row["loss_vs_baseline_samples"]
                assert by_samples is not None and by_samples.by == "samples"
                assert by_samples.n_trial > 0 and by_samples.n_baseline > 0
                # the markdown row says the same
                line = next(x for x in md.splitlines() if x.startswith(f"| {cell.key} |"))
                assert f"| {mean:.3g} (" in line and "| exact |" in line
    assert "| loss vs baseline (matched samples) |" in md
    assert "- hybrid/disk_ckpt/single: " in md and "world_size" in md  # not applicable, why
    # two trials a cell: a finding on ddp's overhead, "best" only where the intervals separate
    (ddp,) = [f for f in written["findings"] if f.startswith("ddp: ") and "overhead" in f]
    assert ddp.startswith(
        (
            "ddp: best by steady-state overhead: **",
            "ddp: by steady-state overhead, not distinguishable: ",
        )
    )
    # the paper's claims: none can be judged on a few KB of state, and each says why
    assert "## Paper vs this run" in md and "| claim | the paper | this run" in md
    assert "## Failure curves" in md and "| kokolis | 131,072 | projected job MTTF" in md
    claims = {c["text"].split(" (")[0]: c for c in written["paper"]}
    assert [c["claim"] for c in written["paper"]] == [1, 1, 1, 1, 2, 3]
    assert {c["verdict"] for c in written["paper"]} == {"not comparable"}
    assert "No architecture has disk_ckpt, inmem_replica, jit_ckpt" in md
    inmem = claims["in-memory replication's overhead depends strongly on the architecture"]
    assert (
        inmem["reason"].startswith("these cells hold ")
        and "MB of state per rank" in inmem["reason"]
    )
    assert set(inmem["cells"]) == {"ddp/inmem_replica/single", "pipeline/inmem_replica/single"}
    assert "paper_claim3.png" in written["figures"]
    assert set(written["figures"]) >= {
        "recovery_phases.png", "overhead_heatmap.png",
        "loss_throughput_ddp.png", "loss_throughput_pipeline.png",
    }  # fmt: skip
    for name in written["figures"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = mpimg.imread(out / name)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert f"![{name}]({name})" in md


def test_report_without_a_sweep_says_what_to_do(tmp_path: Path) -> None:
    r = failbench("report", "--db", f"sqlite:///{tmp_path / 'fb.db'}", "--out", "x", cwd=tmp_path)
    assert r.returncode == 2
    assert "no sweep in this database: run `failbench sweep FILE` first" in r.stderr
