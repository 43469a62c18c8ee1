"""Each synchronous architecture is correct (same losses as one process) and survives failures.

Real Ray actors over gloo, small models: world sizes 2-4, 20 steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from failbench_ray import results
from failbench_ray.data import SyntheticData
from failbench_ray.models import build_model, loss_fn
from failbench_ray.optim import build_optimizer
from failbench_ray.runner import baseline_key, run_experiment
from failbench_ray.spec import ExperimentSpec, parse_spec
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database

MLP = {"kind": "mlp", "input_dim": 16, "hidden_dim": 32, "depth": 3}
GPT = {"kind": "transformer", "vocab_size": 32, "d_model": 16, "n_heads": 4, "seq_len": 8}


def spec_for(arch: Any, world: int, model: dict[str, Any], **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "architecture": arch,
        "world_size": world,
        "model": model,
        "optimizer": {"name": "adam", "lr": 0.01},
        "steps": 20,
        "batch_size": 16,
        "mechanism": {"name": "disk_ckpt", "params": {"interval": 5}},
        "warmup_steps": 1,
        "pg_timeout_s": 60,
    }
    spec.update(over)
    return spec


def single_process_losses(spec: ExperimentSpec) -> list[float]:
    """The same model, data and global batch, trained in this process."""
    torch.set_num_threads(1)
    model = build_model(spec.model, spec.seed)
    opt = build_optimizer(spec.optimizer, model.parameters())
    data = SyntheticData(spec.model, spec.seed)
    losses = []
    for step in range(1, spec.steps + 1):
        x, y = data.global_batch(step, spec.batch_size)
        opt.zero_grad()
        loss = loss_fn(spec.model, model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


Shared = tuple[Database, dict[str, str]]


@pytest.fixture(scope="module")
def shared(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """One database for the module, and the first experiment of each baseline key: tests that
    differ only in mechanism and failures share one matched no-fault run (as a sweep's cells
    do), instead of each running the same baseline again."""
    db = Database(f"sqlite:///{tmp_path_factory.mktemp('archs') / 'archs.db'}")
    yield db, {}
    db.dispose()


def run(spec_dict: dict[str, Any], shared: Shared, tmp_path: Path) -> tuple[Any, list[float]]:
    db, baselines = shared
    spec = parse_spec(spec_dict)
    key = baseline_key(spec)
    result = run_experiment(spec, db=db, out_dir=tmp_path / "runs", baseline_of=baselines.get(key))
    if result.baseline is not None and result.baseline.status == "completed":
        baselines.setdefault(key, result.experiment_id)
    with db.session() as s:
        trial_ids = [t.id for t in repo.get_experiment(s, result.experiment_id).trials]
        records = repo.load_step_records(s, max(trial_ids))
    losses = results.step_losses(records)
    return result, [losses[s] for s in sorted(losses)]


CORRECTNESS = {
    "ddp": ("ddp", 4, MLP),
    "fsdp": ("fsdp", 4, MLP),
    "pipeline-gpipe": ({"name": "pipeline", "params": {"schedule": "gpipe"}}, 4, MLP),
    "pipeline-1f1b-gpt": (
        {"name": "pipeline", "params": {"schedule": "1f1b", "microbatches": 4}},
        3,
        GPT,
    ),
    "tensor-mlp": ("tensor", 2, MLP),
    "tensor-gpt": ("tensor", 4, GPT),
    "hybrid-2x2": ({"name": "hybrid", "params": {"dp": 2, "pp": 2}}, 4, MLP),
    "ps-sync-2-servers": ({"name": "ps", "params": {"servers": 2}}, 4, MLP),
    "hybrid-1x2x2-gpt": ({"name": "hybrid", "params": {"dp": 1, "pp": 2, "tp": 2}}, 4, GPT),
    "hybrid-1x2x2-mlp": (
        {"name": "hybrid", "params": {"dp": 1, "pp": 2, "tp": 2}},
        4,
        {**MLP, "depth": 5},
    ),
}


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("name", list(CORRECTNESS))
def test_loss_trajectory_equals_a_single_process(name: str, shared: Shared, tmp_path: Path) -> None:
    arch, world, model = CORRECTNESS[name]
    spec = spec_for(arch, world, model, baseline=False, mechanism="none")
    result, losses = run(spec, shared, tmp_path)
    assert result.status == "completed", result.trials[0].error
    reference = single_process_losses(parse_spec(spec))
    assert len(losses) == 20
    assert reference[-1] < reference[0]  # it learns: a trajectory worth comparing
    for step, (got, want) in enumerate(zip(losses, reference, strict=True), start=1):
        assert got == pytest.approx(want, rel=1e-5), f"step {step}: {got} vs {want}"


FAILURES = {
    # (architecture, world, model, mechanism, trace)
    "fsdp-single": ("fsdp", 4, MLP, "disk_ckpt", {"kind": "single", "rank": 1, "at_step": 12}),
    "tensor-concurrent": (
        "tensor", 4, GPT, "disk_ckpt", {"kind": "concurrent", "ranks": [1, 2], "at_step": 12},
    ),
    "pipeline-stage-cascading": (
        {"name": "pipeline"}, 4, MLP, "disk_ckpt",
        {"kind": "cascading",
         "events": [{"rank": 1, "at_step": 12}, {"rank": 3, "during": "restoring"}]},
    ),
    "ps-server-killed": (
        {"name": "ps", "params": {"servers": 2}}, 4, MLP, "disk_ckpt",
        {"kind": "single", "rank": 0, "at_step": 12},
    ),
    "hybrid-tp-slice-killed": (
        {"name": "hybrid", "params": {"dp": 1, "pp": 2, "tp": 2}}, 4, GPT, "disk_ckpt",
        {"kind": "single", "rank": 3, "at_step": 12},
    ),
    "hybrid-none-ray-kill": (
        {"name": "hybrid", "params": {"dp": 2, "pp": 2}}, 4, MLP, "none",
        {"kind": "single", "rank": 3, "at_step": 9, "kill": "ray_kill"},
    ),
}  # fmt: skip


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("name", list(FAILURES))
def test_survives_failures_and_matches_the_baseline(
    name: str, shared: Shared, tmp_path: Path
) -> None:
    arch, world, model, mechanism, trace = FAILURES[name]
    spec = spec_for(arch, world, model, mechanism=mechanism, failures=trace)
    result, _ = run(spec, shared, tmp_path)
    trial = result.trials[0]
    assert result.status == "completed" and trial.status == "completed", trial.error
    assert len(trial.failures) == len(spec["failures"].get("events", [None]))
    assert all(f.phases.caught_up_s is not None for f in trial.failures[-1:])
    # Survivors in torch's own collectives (FSDP, DTensor) are killed and replaced, and the
    # result says so; the parameter server's waits and pipeline messages (also hybrid's without
    # a tensor dimension) go through the abort handle.
    abortable = name.startswith(("ps", "pipeline", "hybrid-none"))
    assert trial.failures[0].quiesce.startswith("abort" if abortable else "kill_survivors")
    assert trial.matches_baseline is True
    extra = trial.model_extra or {}
    assert extra["state_bytes_per_rank"] > 0


def gossip(**params: Any) -> dict[str, Any]:
    return {"name": "gossip", "params": params}


@pytest.mark.usefixtures("no_leaks")
def test_gossip_replicas_converge_and_the_loss_falls(shared: Shared, tmp_path: Path) -> None:
    spreads = {}
    for period in (1, 1000):
        spec = spec_for(gossip(period=period), 4, MLP, steps=30, baseline=False, mechanism="none")
        result, losses = run(spec, shared, tmp_path)
        assert result.status == "completed"
        spreads[period] = (result.trials[0].model_extra or {})["replica_spread"]
        assert losses[-1] < losses[0]
    # Averaging with neighbours every step keeps the replicas an order of magnitude closer
    # than never averaging (same seeds, same data).
    assert spreads[1] * 10 < spreads[1000], spreads


@pytest.mark.usefixtures("no_leaks")
def test_gossip_goes_on_without_the_dead_worker(shared: Shared, tmp_path: Path) -> None:
    trace = {"kind": "single", "rank": 1, "at_step": 12}
    spec = spec_for(gossip(), 4, MLP, mechanism="disk_ckpt", failures=trace)
    result, _ = run(spec, shared, tmp_path)
    trial = result.trials[0]
    assert trial.status == "completed", trial.error
    (f,) = trial.failures
    extra = trial.model_extra or {}
    assert extra["ranks_at_end"] == [0, 2, 3]  # no replacement
    assert f.quiesce == "abort" and f.restore_source.startswith("survivors")
    assert f.restored_from_step is not None and f.restored_from_step >= 11  # no rollback
    assert trial.match_expected is False and trial.matches_baseline is None
    assert extra["samples_per_s_before_failure"] > 0 and extra["samples_per_s_after_recovery"] > 0


@pytest.mark.usefixtures("no_leaks")
def test_gossip_with_replacement_rolls_back_and_replays_exactly(
    shared: Shared, tmp_path: Path
) -> None:
    trace = {"kind": "single", "rank": 2, "at_step": 12}
    spec = spec_for(gossip(replace=True), 4, MLP, mechanism="disk_ckpt", failures=trace)
    result, _ = run(spec, shared, tmp_path)
    trial = result.trials[0]
    assert trial.status == "completed", trial.error
    assert trial.failures[0].restored_from_step == 10
    assert (trial.model_extra or {})["ranks_at_end"] == [0, 1, 2, 3]
    assert trial.matches_baseline is True


@pytest.mark.usefixtures("no_leaks")
def test_async_parameter_server_learns_and_survives_a_worker_kill(
    shared: Shared, tmp_path: Path
) -> None:
    arch = {"name": "ps", "params": {"servers": 1, "mode": "async"}}
    trace = {"kind": "single", "rank": 2, "at_step": 12}
    spec = spec_for(arch, 3, MLP, steps=30, mechanism="disk_ckpt", failures=trace)
    result, losses = run(spec, shared, tmp_path)
    trial = result.trials[0]
    assert trial.status == "completed", trial.error
    assert losses[-1] < losses[0]
    assert trial.failures[0].restored_from_step == 10
    assert trial.match_expected is False and trial.matches_baseline is None


ARCHS = {
    "fsdp": ("fsdp", 4, MLP),
    "tensor": ("tensor", 4, GPT),
    "pipeline": ({"name": "pipeline"}, 4, MLP),
    "hybrid": ({"name": "hybrid", "params": {"dp": 2, "pp": 2}}, 4, MLP),
    "ps": ({"name": "ps", "params": {"servers": 1}}, 4, {**MLP, "depth": 2}),
    "gossip": (gossip(), 4, MLP),
}
TRACES = {
    # concurrent kills under `none` (restart from step 0), a cascade under `disk_ckpt`
    "concurrent-none": ("none", {"kind": "concurrent", "ranks": [0, 2], "at_step": 9}),
    "cascading-disk_ckpt": (
        "disk_ckpt",
        {
            "kind": "cascading",
            "events": [{"rank": 1, "at_step": 12}, {"rank": 3, "during": "restoring"}],
        },
    ),
}


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("trace", list(TRACES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_survives_concurrent_and_cascading_failures(
    arch: str, trace: str, shared: Shared, tmp_path: Path
) -> None:
    architecture, world, model = ARCHS[arch]
    mechanism, failures = TRACES[trace]
    batch = 15 if arch == "ps" else 16  # ps splits the batch over its 3 workers
    spec = spec_for(
        architecture, world, model, mechanism=mechanism, failures=failures, batch_size=batch
    )
    result, losses = run(spec, shared, tmp_path)
    trial = result.trials[0]
    assert result.status == "completed" and trial.status == "completed", trial.error
    assert len(trial.failures) == len(failures.get("events", [None]))
    assert trial.failures[-1].phases.caught_up_s is not None
    assert len(losses) == 20
    if arch == "gossip":  # goes on without the dead: nothing to match
        assert trial.matches_baseline is None
        assert len((trial.model_extra or {})["ranks_at_end"]) == world - len(
            trial.failures[0].ranks
        ) - (len(trial.failures) - 1)
    else:  # rolled back (to step 0 or a checkpoint) and replayed: bit-identical
        assert trial.matches_baseline is True
