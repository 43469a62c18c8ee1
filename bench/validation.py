"""Issue 20: `failbench validate` in `make bench`, short: DDP on 4 ranks under Poisson SIGKILLs,
three mechanisms of different shapes (a periodic disk checkpoint, in-memory copies, elastic
shrink), costs fitted on their own calibration runs. The goal: every measured ETTR within 3
percentage points of the model's and of the simulator's (replaying the run's failure times)
prediction, and the same ranking. The figure and the table are written beside the JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import REPO, log, with_status

if TYPE_CHECKING:
    from bench.common import BenchConfig, Env

MECHANISMS = ("disk_ckpt", "inmem_replica", "elastic")
# (mean seconds between failures, seconds of failure-free work per mechanism)
SHAPE = {True: (15.0, 60.0), False: (20.0, 240.0)}
RUNS = {True: 1, False: 3}  # validation runs per mechanism (each its own failure draw)


def job() -> dict[str, Any]:
    """The job docs/validation measures (one source for both)."""
    import yaml

    data: dict[str, Any] = yaml.safe_load((REPO / "examples" / "validate.yaml").read_text())
    return {**data, "name": "bench-validate"}


def goal_validation(env: Env, cfg: BenchConfig, out_dir: Path) -> dict[str, Any]:
    from failbench_ray import validate, validate_report
    from failbench_ray.runner import run_experiment
    from failbench_ray.spec import parse_spec

    mtbf_s, duration_s = SHAPE[cfg.quick]
    opts = validate.ValidateOptions(
        mtbf_s=mtbf_s,
        duration_s=duration_s,
        mechanisms=MECHANISMS,
        seed=0,
        calibration_steps=100,
        calibration_s=25.0,
        runs=RUNS[cfg.quick],
    )  # the command in examples/validate.yaml
    report = validate.run_validate(
        parse_spec(job()),
        opts,
        run=lambda data: run_experiment(parse_spec(data), db=env.db, out_dir=env.tmp / "val"),
        say=log,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    png = validate_report.figure(report, out_dir / "validation.png")
    (out_dir / "validation.md").write_text("\n".join(validate_report.markdown_report(report, png)))
    data = report.as_dict()
    agree = data["agreement"]
    met = all(
        agree[k]["within_goal"] and agree[k]["same_ranking"]
        for k in ("model", "simulator_same_failures")
    )
    return with_status(
        {
            "goal": "measured ETTR within 3 pp of the model's and the simulator's prediction "
            "(costs from separate calibration runs), and the same ranking",
            "met": met,
            "figure": str(out_dir / "validation.png"),
            **data,
        }
    )


def validation_text(m: dict[str, Any]) -> str:
    rows = [
        f"{r['mechanism']} {_pct(r['ettr'])} vs model {_pct(r['predicted'].get('model'))}"
        for r in m.get("mechanisms", [])
    ]
    a = m.get("agreement", {})
    keys = ("model", "model_same_failures", "simulator_same_failures")
    worst = {k: (a.get(k) or {}).get("max_error_pp") for k in keys}
    return (
        "; ".join(rows)
        + f"; largest error: model {_pp(worst['model'])}, model with the runs' failures "
        f"{_pp(worst['model_same_failures'])}, simulator with the same failures "
        f"{_pp(worst['simulator_same_failures'])}"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _pp(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} pp"
