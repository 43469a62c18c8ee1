"""Loss progress against the baseline: Welch's t-test at matched wall-clock time and samples."""

from __future__ import annotations

import numpy as np

from failbench_ray import stats
from failbench_ray.records import StepRecord


def _run(
    seed: int, steps: int = 200, pause_at: int | None = None, pause_s: float = 0.0, replay: int = 0
) -> list[StepRecord]:
    """Two ranks, 0.1 s per step, loss exp(-step/60) + noise; optionally a failure at
    `pause_at` that costs `pause_s` of downtime and rolls back `replay` steps."""
    rng = np.random.default_rng(seed)
    out, t, step, gen = [], 100.0, 1, 0
    while step <= steps:
        if step == pause_at and gen == 0:
            t += pause_s
            step, gen = step - replay, 1
        loss = float(np.exp(-step / 60) + rng.normal(0, 0.01))
        for rank in (0, 1):
            out.append(StepRecord(rank, step, gen, loss, t, t + 0.1, 8))
        t += 0.1
        step += 1
    return out


def test_curve_orders_steps_as_they_ran_and_counts_replayed_samples() -> None:
    c = stats.curve(_run(0, steps=10, pause_at=6, pause_s=1.0, replay=2))
    assert len(c.loss) == 12  # steps 4 and 5 ran twice
    assert c.samples[-1] == 12 * 16
    assert np.all(np.diff(c.wall_s) > 0) and abs(c.wall_s[0] - 0.1) < 1e-9


def test_same_progress_is_no_detectable_difference() -> None:
    trials = [stats.curve(_run(s)) for s in (1, 2)]
    base = [stats.curve(_run(10))]
    for by in ("wall_s", "samples"):
        for c in stats.progress(trials, base, by):
            assert c.verdict == "no detectable difference", c
            assert c.ci95 is not None and c.ci95[0] <= 0 <= c.ci95[1]


def test_a_failure_shows_as_higher_loss_at_matched_wall_clock_time() -> None:
    trials = [stats.curve(_run(s, pause_at=50, pause_s=5.0, replay=20)) for s in (1, 2)]
    base = [stats.curve(_run(10))]
    by_wall = stats.progress(trials, base, "wall_s")
    assert [c.verdict for c in by_wall[1:]] == ["higher"] * 3
    assert all(c.difference is not None and c.difference > 0 for c in by_wall[1:])
    # per sample consumed, replayed steps are work that did not lower the loss: still higher
    by_samples = stats.progress(trials, base, "samples")
    assert by_samples[1].verdict == "higher"


def test_too_few_steps_say_so() -> None:
    c = stats.compare(
        [stats.curve(_run(1, steps=3))],
        [stats.curve(_run(2, steps=3))],
        "wall_s",
        at=100.0,
        half_width=0.01,
    )
    assert c.verdict == "too few steps to compare" and c.difference is None


def test_ranks_that_never_see_the_loss_do_not_hide_it_and_a_nan_run_is_not_compared() -> None:
    """A pipeline's inner stages (and a parameter server) report NaN: the step's loss is the
    mean of the ranks that see it. A run whose loss went NaN has no difference to report."""
    seen = _run(3)
    inner = [StepRecord(2, r.step, r.generation, float("nan"), r.t_start, r.t_end, 0) for r in seen]
    c = stats.curve(seen + inner)
    assert np.isfinite(c.loss).all()
    base = [stats.curve(_run(10))]
    assert stats.compare([c], base, "samples", at=800, half_width=100).difference is not None
    diverged = [StepRecord(0, r.step, 0, float("nan"), r.t_start, r.t_end, 8) for r in seen]
    cmp = stats.compare([stats.curve(diverged)], base, "samples", at=800, half_width=100)
    assert cmp.difference is None and cmp.verdict.startswith("the loss is not finite")
