"""The paper's claims beside this run's numbers: the report's "Paper vs this run" section.

The paper (its abstract) measured 205 MB to 2.7 GB of checkpoint state per rank on 8 V100s and
claims: (1) no mechanism is universally best; on its architecture A2 disk checkpointing has the
lowest steady-state overhead (0.5%), in-memory replication restores fastest (~17 ms), and
just-in-time checkpointing avoids periodic cost but incurs ~0.9 s upon failure; when
re-formation takes seconds, mechanisms differ more in overhead than in restore speed. (2) Gossip
gains 17.9% sample throughput after losing a worker yet shows no detectable improvement in loss
progress over a matched no-fault baseline. (3) In-memory replication's overhead ranges from 3.7%
to 176% across architectures.

Each claim gets a verdict from this run's 95% intervals (`findings.estimate`): "holds", "does
not hold", or "not comparable" (cells missing or of one trial, far less state than the paper's,
or intervals that cannot decide), always with the reason. Absolute numbers stand beside the
paper's but are never judged against them: other hardware, other state sizes. Pure functions
of the report's rows (tested without Ray); the figures are drawn by the report.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from failbench_ray.findings import MIN_TRIALS, Estimate, estimate, pooled

HOLDS, FAILS, NOT_COMPARABLE = "holds", "does not hold", "not comparable"
PAPER_NOTE = (
    "The paper measured 205 MB to 2.7 GB of checkpoint state per rank on 8 V100s. Each claim of "
    "its abstract below, with this run's mean, 95% interval and trials; a verdict needs the "
    "intervals to decide, and cost claims need state of the paper's order. Absolute numbers "
    "are shown, not judged: other hardware."
)
PAPER_STATE_MB = (205.0, 2700.0)  # the paper's checkpoint state per rank
MIN_STATE_MB = 100.0  # below this per rank a checkpoint costs next to nothing: not the paper's
# The paper does not name A2; these are tried in order (data-parallel first: every mechanism of
# claim 1 applies there, and its numbers fit a data-parallel job).
A2_CANDIDATES = ("ddp", "fsdp", "hybrid", "tensor", "pipeline", "ps")
CLAIM1_MECHS = ("disk_ckpt", "inmem_replica", "jit_ckpt")
PERIODIC = ("disk_ckpt", "inmem_replica")  # restore from what was saved before the failure


@dataclass
class Verdict:
    """One claim: the paper's figure, ours (mean [95% interval], n), where, and the verdict.
    `plot`: what the claim's figure draws, label -> (estimate, the paper's value or None)."""

    claim: int  # 1-3, the abstract's numbering
    text: str
    paper: str
    ours: str
    cells: list[str]
    verdict: str
    reason: str
    plot: Mapping[str, tuple[Estimate, float | None]] = field(default_factory=dict)
    unit: str = ""


def _usable(r: dict[str, Any]) -> bool:
    """Cells a claim may rest on: two trials or more, the paper's (standard) re-formation."""
    return r["trials"] >= MIN_TRIALS and r.get("reform", "standard") == "standard"


def size_problem(rows: Sequence[dict[str, Any]]) -> str | None:
    """Why cells this small cannot speak to the paper's costs, if they are."""
    sizes = [r["state_bytes_per_rank"] for r in rows if r.get("state_bytes_per_rank")]
    if not sizes:
        return "the cells recorded no state size"
    mb = statistics.median(sizes) / 1e6
    if mb < MIN_STATE_MB:
        return (
            f"these cells hold {mb:.3g} MB of state per rank, the paper {PAPER_STATE_MB[0]:.0f} "
            f"MB to {PAPER_STATE_MB[1] / 1000:.1f} GB: a checkpoint costs next to nothing here "
            "(run examples/findings.yaml)"
        )
    return None


def pick_a2(rows: Sequence[dict[str, Any]]) -> tuple[str | None, str]:
    """The architecture claim 1 is compared on, and why."""
    have: dict[str, set[str]] = {}
    for r in rows:
        if _usable(r):
            have.setdefault(r["architecture"], set()).add(r["mechanism"])
    for arch in A2_CANDIDATES:
        if set(CLAIM1_MECHS) <= have.get(arch, set()):
            return arch, (
                f"The paper does not say which architecture A2 is: claim 1 is compared on "
                f"{arch}, the first of {', '.join(A2_CANDIDATES)} (data-parallel first, where "
                f"every mechanism of the claim applies) with {', '.join(CLAIM1_MECHS)} run at "
                f"{MIN_TRIALS} trials or more."
            )
    return None, (
        f"No architecture has {', '.join(CLAIM1_MECHS)} with {MIN_TRIALS} trials or more: "
        "claim 1 cannot be compared."
    )


def _pooled(rows: Sequence[dict[str, Any]], by: str, key: str) -> dict[str, Estimate]:
    """Estimates of `key`'s samples grouped by the row field `by` (those with an interval)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r[by], []).append(r)
    return {k: e for k, rs in groups.items() if (e := pooled(rs, key)) and e.ci95 is not None}


def lowest(ests: dict[str, Estimate], who: str) -> tuple[str, str]:
    """Whether `who` is lowest: its interval wholly below every other's (holds), another's
    wholly below its own (does not hold), else they overlap (not comparable)."""
    mine = ests[who].ci95
    assert mine is not None
    others = {m: e.ci95 for m, e in ests.items() if m != who and e.ci95 is not None}
    if not others:
        return NOT_COMPARABLE, "no other mechanism to compare it with"
    below = sorted(m for m, ci in others.items() if ci[1] < mine[0])
    if below:
        return FAILS, f"{', '.join(below)} lower, with intervals wholly below {who}'s"
    tied = sorted(m for m, ci in others.items() if ci[0] <= mine[1])
    if tied:
        return NOT_COMPARABLE, f"{who} cannot be told apart from {', '.join(tied)}"
    return HOLDS, f"{who}'s interval lies below every other mechanism's"


def _texts(ests: dict[str, Estimate], unit: str) -> str:
    return "; ".join(f"{m} {ests[m].text(unit)}" for m in sorted(ests, key=lambda m: ests[m].mean))


def _lowest_claim(
    rows: list[dict[str, Any]], text: str, paper: tuple[str, float], key: str, who: str, unit: str
) -> Verdict:
    ests = _pooled(rows, "mechanism", key)
    cells = [r["cell"] for r in rows if r["mechanism"] in ests]
    if who not in ests:
        return Verdict(1, text, paper[0], "-", cells, NOT_COMPARABLE, f"no {who} cell ran twice")
    verdict, reason = lowest(ests, who)
    plot = {m: (e, paper[1] if m == who else None) for m, e in ests.items()}
    return Verdict(1, text, paper[0], _texts(ests, unit), cells, verdict, reason, plot, unit)


def claim_jit(rows: list[dict[str, Any]], where: str) -> Verdict:
    """jit_ckpt saves nothing periodically (by design; its overhead is shown) and pays upon
    failure: its restore, which waits for the just-in-time save, lies above the periodic
    mechanisms' restores."""
    text = f"on A2 ({where}) just-in-time checkpointing avoids periodic cost but pays on failure"
    paper = "jit_ckpt ~0.9 s upon failure"
    over = _pooled(rows, "mechanism", "overhead_samples")
    rest = _pooled(rows, "mechanism", "restore_samples")
    cells = [r["cell"] for r in rows if r["mechanism"] == "jit_ckpt"]
    if "jit_ckpt" not in rest:
        return Verdict(1, text, paper, "-", cells, NOT_COMPARABLE, "no jit_ckpt cell ran twice")
    jr = rest["jit_ckpt"]
    assert jr.ci95 is not None
    periodic = {m: ci for m in PERIODIC if m in rest and (ci := rest[m].ci95) is not None}
    cheap = sorted(m for m, ci in periodic.items() if jr.ci95[1] < ci[0])
    ours = f"restore {jr.text(' s')}" + (
        f"; overhead {over['jit_ckpt'].text('%')}" if "jit_ckpt" in over else ""
    )
    if not periodic:
        verdict, reason = NOT_COMPARABLE, "no periodic mechanism's restore to compare with"
    elif cheap:
        verdict, reason = FAILS, f"its restore lies below {', '.join(cheap)}'s"
    elif all(jr.ci95[0] > ci[1] for ci in periodic.values()):
        verdict, reason = HOLDS, "its restore lies above every periodic mechanism's"
    else:
        verdict, reason = NOT_COMPARABLE, "its restore cannot be told apart from a periodic one's"
    plot = {"jit_ckpt": (jr, 0.9)} | {m: (rest[m], None) for m in periodic}
    return Verdict(1, text, paper, ours, cells, verdict, reason, plot, " s")


def claim_reform(rows: list[dict[str, Any]], where: str) -> Verdict:
    """Re-formation takes seconds (its interval lies above 1 s) and the mechanisms' restore
    times spread less than its lower end: restore speed hides behind it."""
    text = (
        f"on A2 ({where}), when re-formation takes seconds, mechanisms differ more in overhead "
        "than in restore speed"
    )
    paper = "re-formation takes seconds"
    restores = _pooled(rows, "mechanism", "restore_samples")
    rest = {m: e.mean for m, e in restores.items()}
    est = estimate([s for r in rows for s in r.get("reform_samples", [])])
    cells = [r["cell"] for r in rows]
    if est is None or est.ci95 is None or len(rest) < 2:
        return Verdict(1, text, paper, "-", cells, NOT_COMPARABLE, "too few recoveries")
    spread = max(rest.values()) - min(rest.values())
    ours = f"re-formation {est.text(' s')}; restore means spread {spread:.3g} s"
    plot = {"re-formation": (est, None)} | {f"{m} restore": (e, None) for m, e in restores.items()}
    if est.ci95[0] < 1.0:
        verdict, reason = NOT_COMPARABLE, "re-formation here does not take seconds"
    elif spread < est.ci95[0]:
        verdict, reason = HOLDS, "restore times spread less than re-formation takes"
    else:
        verdict, reason = FAILS, "restore times spread as much as re-formation takes"
    return Verdict(1, text, paper, ours, cells, verdict, reason, plot, " s")


def claim_gossip(rows: list[dict[str, Any]]) -> Verdict:
    """Gossip after losing a worker: throughput up (its interval above 0%), no loss progress
    over the matched no-fault baseline (no lower loss at matched time)."""
    text = (
        "gossip gains sample throughput after losing a worker, with no detectable improvement "
        "in loss progress over a matched no-fault baseline"
    )
    paper = "+17.9% throughput; no detectable loss improvement"
    here = [r for r in rows if r["architecture"] == "gossip" and r["throughput_ratios"]]
    cells = [r["cell"] for r in here]
    est = estimate([100 * (x - 1) for r in here for x in r["throughput_ratios"]])
    if est is None or est.ci95 is None:
        return Verdict(2, text, paper, "-", cells, NOT_COMPARABLE, "no gossip cell ran twice")
    loss = [r["loss_vs_baseline"] for r in here if r["loss_vs_baseline"] is not None]
    verdicts = sorted({c.verdict for c in loss})
    ours = f"throughput {est.text('%')}; loss at matched time: {', '.join(verdicts) or '-'}"
    plot = {"throughput change": (est, 17.9)}
    up, down = est.ci95[0] > 0, est.ci95[1] < 0
    improved = "lower" in verdicts
    if down or improved:
        reason = "throughput fell" if down else "loss is lower than the baseline's at matched time"
        return Verdict(2, text, paper, ours, cells, FAILS, reason, plot, "%")
    if up and loss:
        reason = "throughput rose, and loss shows no improvement at matched time"
        return Verdict(2, text, paper, ours, cells, HOLDS, reason, plot, "%")
    reason = "no detectable throughput change" if not up else "no loss comparison"
    return Verdict(2, text, paper, ours, cells, NOT_COMPARABLE, reason, plot, "%")


def claim_inmem_range(rows: list[dict[str, Any]]) -> Verdict:
    """In-memory replication's overhead depends strongly on the architecture: the lowest
    architecture's interval lies wholly below the highest's."""
    text = "in-memory replication's overhead depends strongly on the architecture"
    paper = "3.7% to 176%"
    here = [r for r in rows if r["mechanism"] == "inmem_replica"]
    ests = _pooled(here, "architecture", "overhead_samples")
    cells = [r["cell"] for r in here if r["architecture"] in ests]
    if len(ests) < 2:
        reason = "inmem_replica ran twice on fewer than 2 architectures"
        return Verdict(3, text, paper, "-", cells, NOT_COMPARABLE, reason)
    lo = min(ests, key=lambda a: ests[a].mean)
    hi = max(ests, key=lambda a: ests[a].mean)
    lo_ci, hi_ci = ests[lo].ci95, ests[hi].ci95
    assert lo_ci is not None and hi_ci is not None
    ours = f"{ests[lo].text('%')} ({lo}) to {ests[hi].text('%')} ({hi})"
    plot = {a: (e, None) for a, e in ests.items()}
    if lo_ci[1] < hi_ci[0]:
        verdict, reason = HOLDS, f"{lo}'s interval lies wholly below {hi}'s"
    else:
        verdict, reason = NOT_COMPARABLE, f"the intervals of {lo} and {hi} overlap"
    return Verdict(3, text, paper, ours, cells, verdict, reason, plot, "%")


def compare(rows: list[dict[str, Any]]) -> tuple[str, list[Verdict]]:
    """Every claim's verdict (cost claims on cells far smaller than the paper's are not
    comparable), after a sentence on which architecture stands for A2."""
    usable = [r for r in rows if _usable(r)]
    a2, why = pick_a2(usable)
    on_a2 = [r for r in usable if r["architecture"] == a2 and r["mechanism"] in CLAIM1_MECHS]
    where = a2 or "-"
    out = [
        _lowest_claim(
            on_a2,
            f"on A2 ({where}) disk checkpointing has the lowest steady-state overhead",
            ("disk_ckpt 0.5%", 0.5),
            "overhead_samples",
            "disk_ckpt",
            "%",
        ),
        _lowest_claim(
            on_a2,
            f"on A2 ({where}) in-memory replication restores fastest",
            ("inmem_replica ~17 ms", 0.017),
            "restore_samples",
            "inmem_replica",
            " s",
        ),
        claim_jit(on_a2, where),
        claim_reform(on_a2, where),
        claim_gossip(usable),
        claim_inmem_range(usable),
    ]
    for v in out:
        small = None if v.claim == 2 else size_problem([r for r in rows if r["cell"] in v.cells])
        if small is not None and v.cells:
            v.verdict, v.reason = NOT_COMPARABLE, f"{small} ({v.verdict}: {v.reason})"
    return why, out


def explain(v: Verdict, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where a claim does not hold: what its cells measured that says why (the recovery phase
    that dominated, how fast state was written and how long each save held the step)."""
    out = []
    for r in rows:
        if r["cell"] not in v.cells:
            continue
        parts = []
        phases = {p: s for p, s in r["phases_s"].items() if s is not None}
        if phases:
            top = max(phases, key=phases.__getitem__)
            parts.append(
                f"recovery dominated by {top} ({phases[top]:.3g} s of "
                f"{sum(phases.values()):.3g} s to resumed)"
            )
        if r.get("write_mb_s"):
            parts.append(f"state written at {r['write_mb_s']:.4g} MB/s")
        if r.get("stall_s_per_save") is not None:
            parts.append(f"a save holds its step {r['stall_s_per_save']:.3g} s")
        if r.get("state_bytes_per_rank"):
            parts.append(f"{r['state_bytes_per_rank'] / 1e6:.4g} MB of state per rank")
        if parts:
            out.append(f"{r['cell']}: {'; '.join(parts)}")
    return out
