"""Issue 19: `failbench search` over every applicable pair of the paper matrix, time-bounded.

Each pair (architecture x mechanism, 4 ranks, a small MLP, the mechanism saving or copying every
5 steps, rank 1 SIGKILLed at step 12) gets an equal share of the budget: its windows run in
order (recovery phases, its own windows, one seeded random step) until its share is spent.
Findings (a recovery that hung or failed, lost data, a broken oracle) are listed with the
smallest spec that reproduces each, its YAML kept in the JSON (the files are in a temporary
directory). The goal: no finding, and the coverage said (windows run of those found).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import log, with_status

if TYPE_CHECKING:
    from bench.common import BenchConfig, Env

BUDGET_S = {True: 600.0, False: 1800.0}  # quick, full
# Each on 4 ranks; batch 48 splits over 4 ranks, 3 ps workers and 2 or 4 microbatches.
ARCH_PARAMS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "fsdp": {},
    "tensor": {},
    "pipeline": {"microbatches": 4},
    "hybrid": {"dp": 2, "pp": 2, "microbatches": 2},
    "gossip": {},
    "ps": {"servers": 1},
}


def pair_spec(arch: str, mech: str) -> dict[str, Any]:
    from mechanisms import MECHANISMS

    params = {"interval": 5} if "interval" in MECHANISMS.get(mech).Params.model_fields else {}
    return {
        "name": f"bench-search-{arch}-{mech}",
        "architecture": {"name": arch, "params": ARCH_PARAMS[arch]},
        "world_size": 4,
        "model": {"kind": "mlp", "input_dim": 16, "hidden_dim": 32, "depth": 4},
        "steps": 30,
        "batch_size": 48,
        "mechanism": {"name": mech, "params": params},
        "failures": {"kind": "single", "rank": 1, "at_step": 12},
    }


def _pairs() -> list[tuple[str, str]]:
    from failbench_ray.catalog import mechanism_names
    from failbench_ray.checks import resolve
    from failbench_ray.errors import NotApplicableError
    from failbench_ray.spec import parse_spec

    out = []
    for arch in ARCH_PARAMS:
        for mech in mechanism_names():
            if mech == "none":
                continue  # no recovery to search: its first failure already ends the trial
            try:
                resolve(parse_spec(pair_spec(arch, mech)))
            except NotApplicableError:
                continue
            out.append((arch, mech))
    return out


def goal_search(env: Env, cfg: BenchConfig) -> dict[str, Any]:
    from failbench_ray.search import SearchOptions, run_search
    from failbench_ray.spec import parse_spec

    pairs = _pairs()
    share = BUDGET_S[cfg.quick] / len(pairs)
    rows: dict[str, Any] = {}
    t0 = time.monotonic()
    for arch, mech in pairs:
        started = time.monotonic()
        report = run_search(
            parse_spec(pair_spec(arch, mech)),
            db=env.db,
            out_dir=env.tmp / "search",
            options=SearchOptions(random_points=1, seed=0, time_limit_s=share),
            say=log,
        )
        rows[f"{arch}/{mech}"] = {
            "windows_run": len(report.outcomes),
            "stopped_early": report.stopped_early,
            "verdicts": {o.window: o.verdict for o in report.outcomes},
            "findings": [
                {
                    "window": o.window,
                    "verdict": o.verdict,
                    "detail": o.detail,
                    "experiment": o.experiment_id,
                    "smallest_spec": Path(o.repro).read_text() if o.repro else None,
                }
                for o in report.findings()
            ],
            "wall_s": time.monotonic() - started,
        }
    findings = sum(len(r["findings"]) for r in rows.values())
    complete = sum(r["stopped_early"] is None for r in rows.values())
    return with_status(
        {
            "goal": "a second failure in every window of every applicable pair of the paper "
            "matrix: no recovery hangs, fails, loses data or breaks the oracle",
            "met": findings == 0,
            "pairs": len(pairs),
            "pairs_searched_whole": complete,
            "windows_run": sum(r["windows_run"] for r in rows.values()),
            "findings": findings,
            "budget_s": BUDGET_S[cfg.quick],
            "wall_s": time.monotonic() - t0,
            "by_pair": rows,
        }
    )


def search_text(m: dict[str, Any]) -> str:
    found = [
        f"{pair} {f['window']}: {f['verdict']}"
        for pair, r in m.get("by_pair", {}).items()
        for f in r["findings"]
    ]
    return (
        f"{m.get('windows_run')} windows over {m.get('pairs')} pairs "
        f"({m.get('pairs_searched_whole')} searched whole in the {m.get('budget_s'):g} s budget); "
        f"{m.get('findings')} finding(s)" + (": " + "; ".join(found) if found else "")
    )
