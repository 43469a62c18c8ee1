"""Published job failure rates against job size, as models the simulator plays.

A job of N GPUs fails when any of its nodes fails (each at its own rate) or when something
that does not scale with the job fails it (a software bug, shared storage, the scheduler): rate
`per_job + per_node * nodes`. A pure series system of nodes (`per_job = 0`) cannot give both
points Kokolis et al. publish (MTTF 7.9 h at 1,024 GPUs and 1.8 h at 16,384: 16 times the
nodes, 4.4 times the rate), so their curve has both terms, fitted to those two points; the
131,072-GPU projection is then what the fitted curve says, shown beside theirs.

`simulate_failures` draws a job's failures node by node (every node and the job-level process
each its own exponential clock) for the tests and the report to check against the published
numbers. Pure; no Ray.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from failbench_ray import markdown

GPUS_PER_NODE = 8
HOUR_S = 3600.0


@dataclass(frozen=True)
class FailureCurve:
    name: str
    per_job_per_h: float  # failures of a job whatever its size
    per_node_per_h: float  # failures of one node
    source: str
    gpus_per_node: int = GPUS_PER_NODE

    def nodes(self, gpus: int) -> int:
        return max(1, math.ceil(gpus / self.gpus_per_node))

    def rate_per_h(self, gpus: int) -> float:
        return self.per_job_per_h + self.per_node_per_h * self.nodes(gpus)

    def mttf_hours(self, gpus: int) -> float:
        """The job's mean time to failure at `gpus` GPUs."""
        return 1.0 / self.rate_per_h(gpus)

    @classmethod
    def through(
        cls, name: str, a: tuple[int, float], b: tuple[int, float], source: str
    ) -> FailureCurve:
        """The curve through two published (GPUs, MTTF hours) points."""
        (g1, m1), (g2, m2) = a, b
        n1, n2 = math.ceil(g1 / GPUS_PER_NODE), math.ceil(g2 / GPUS_PER_NODE)
        per_node = (1 / m2 - 1 / m1) / (n2 - n1)
        per_job = 1 / m1 - per_node * n1
        if per_node <= 0 or per_job < 0:
            raise ValueError(f"{name}: no curve of positive rates passes through {a} and {b}")
        return cls(name, per_job, per_node, source)


@dataclass(frozen=True)
class Published:
    """A number a paper states, to check the curves against."""

    curve: str
    gpus: int
    mttf_hours: float
    what: str


KOKOLIS_POINTS = (
    Published("kokolis", 1024, 7.9, "job MTTF at 1,024 GPUs"),
    Published("kokolis", 16_384, 1.8, "job MTTF at 16,384 GPUs"),
)
KOKOLIS_PROJECTION = Published("kokolis", 131_072, 0.23, "projected job MTTF at 131,072 GPUs")
LLAMA3_DAYS, LLAMA3_INTERRUPTIONS, LLAMA3_GPUS = 54, 419, 16_384
LLAMA3_POINT = Published(
    "llama3",
    LLAMA3_GPUS,
    LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS,
    f"{LLAMA3_INTERRUPTIONS} unexpected interruptions in {LLAMA3_DAYS} days",
)

CURVES: dict[str, FailureCurve] = {
    "kokolis": FailureCurve.through(
        "kokolis",
        (KOKOLIS_POINTS[0].gpus, KOKOLIS_POINTS[0].mttf_hours),
        (KOKOLIS_POINTS[1].gpus, KOKOLIS_POINTS[1].mttf_hours),
        "Kokolis et al., Revisiting Reliability in Large-Scale Machine Learning Research "
        "Clusters, HPCA 2025: job MTTF about 7.9 h at 1,024 GPUs and 1.8 h at 16,384; "
        "a per-job and a per-node rate fitted through both",
    ),
    "llama3": FailureCurve(
        "llama3",
        0.0,
        LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24) / (LLAMA3_GPUS // GPUS_PER_NODE),
        "Llama 3 pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs "
        "(Dubey et al., The Llama 3 Herd of Models, 2024, sec. 3.3.4); one rate per node",
    ),
}
PROJECTED_GPUS = (1024, 16_384, 131_072)


def simulate_failures(
    curve: FailureCurve, gpus: int, horizon_s: float, seed: int = 0
) -> list[tuple[float, int]]:
    """The job's failures within `horizon_s`: (seconds, node) with node -1 for a job-level
    failure. Each node and the job-level process has its own exponential clock; a failed
    node is replaced at once (a fresh clock), as a job restarted on a spare is."""
    rng = random.Random(seed)
    clocks: list[tuple[float, int]] = []
    if curve.per_job_per_h > 0:
        clocks.append((rng.expovariate(curve.per_job_per_h / HOUR_S), -1))
    rate_node = curve.per_node_per_h / HOUR_S
    clocks += [(rng.expovariate(rate_node), n) for n in range(curve.nodes(gpus))]
    heapq.heapify(clocks)
    out: list[tuple[float, int]] = []
    while clocks[0][0] < horizon_s:
        t, who = heapq.heappop(clocks)
        out.append((t, who))
        rate = curve.per_job_per_h / HOUR_S if who < 0 else rate_node
        heapq.heappush(clocks, (t + rng.expovariate(rate), who))
    return out


def simulated_mttf_hours(curve: FailureCurve, gpus: int, failures: int, seed: int = 0) -> float:
    """The mean time between the simulated failures of a job, over about `failures` of them."""
    horizon_s = failures * curve.mttf_hours(gpus) * HOUR_S
    got = simulate_failures(curve, gpus, horizon_s, seed)
    return horizon_s / HOUR_S / max(1, len(got))


def section(failures: int = 20_000, seed: int = 0) -> tuple[list[str], list[str], list[list[str]]]:
    """The report's section: published job MTTF against the curves and the simulator; its
    markdown lines, and the table's head and body (for HTML)."""
    head = ["curve", "GPUs", "published", "published MTTF h", "curve MTTF h", "simulated MTTF h"]
    body = []
    for p in (*KOKOLIS_POINTS, KOKOLIS_PROJECTION, LLAMA3_POINT):
        curve = CURVES[p.curve]
        sim = simulated_mttf_hours(curve, p.gpus, failures, seed)
        body.append(
            [p.curve, f"{p.gpus:,}", p.what, f"{p.mttf_hours:.3g}",
             f"{curve.mttf_hours(p.gpus):.3g}", f"{sim:.3g}"]
        )  # fmt: skip
    md = [
        "## Failure curves",
        "Job MTTF (hours) against job size: what the papers state, the curve the simulator "
        f"plays (`failbench_ray/failure_curves.py`), and the simulator over {failures:,} drawn "
        "failures. The 131,072-GPU row is a projection: Kokolis et al.'s and this curve's.",
        "",
        *markdown.table(head, body),
        *[f"- {c.name}: {c.source}." for c in CURVES.values()],
        "",
    ]
    return md, head, body
