"""One DDP job under Ray Train, protected the way its users protect one: `TorchTrainer`, a
checkpoint reported every K steps (`ray.train.report(..., checkpoint=...)`) and
`FailureConfig(max_failures=1)`. One rank SIGKILLs itself at a given step; measured: the time
from the kill to the first step completed after Ray Train restarted the job, and the steps lost.

The goals that compare with Ray Train (`peers.py`, `reform.py`) describe their job with a
`RayTrainJob` of the same model, world size, optimizer, batch and kill as their own runs.
Ray and torch are imported inside functions (see `common.py`).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RayTrainJob:
    world: int
    model: dict[str, Any]  # a `ModelSpec`, as in our specs
    steps: int
    kill_rank: int
    kill_at: int  # the step in flight when `kill_rank` dies
    interval: int = 10  # a checkpoint every this many steps
    batch_size: int = 64
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "adam", "lr": 1e-3})


def _train_loop(config: dict[str, Any]) -> None:
    """Runs in each Ray Train worker: DDP on the job's model with the job's optimizer."""
    import ray.train
    import torch
    from ray.train import Checkpoint
    from ray.train.torch import prepare_model

    from failbench_ray.models import build_model
    from failbench_ray.optim import build_optimizer
    from failbench_ray.spec import ModelSpec, OptimizerSpec

    job = RayTrainJob(**config["job"])
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    marks = Path(config["marks"])
    spec = ModelSpec.model_validate(job.model)
    model = prepare_model(build_model(spec, seed=0))
    opt = build_optimizer(OptimizerSpec.model_validate(job.optimizer), model.parameters())
    start = 1
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    gen = torch.Generator().manual_seed(1)
    per_rank = job.batch_size // world
    for step in range(start, job.steps + 1):
        if step == job.kill_at and rank == job.kill_rank and restored is None:
            (marks / "killed").write_text(json.dumps({"t": time.time(), "step": step}))
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(per_rank, spec.input_dim, generator=gen)
        y = torch.randint(0, spec.num_classes, (per_rank,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if restored is not None and step == start and rank == 0:
            (marks / "resumed").write_text(json.dumps({"t": time.time(), "from": start - 1}))
        checkpoint = None
        if step % job.interval == 0 and rank == 0:
            d = tempfile.mkdtemp()
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                Path(d) / "state.pt",
            )
            checkpoint = Checkpoint.from_directory(d)
        ray.train.report({"step": step, "loss": loss.item()}, checkpoint=checkpoint)


def ray_train_recovery(tmp: Path, job: RayTrainJob, name: str) -> dict[str, float]:
    """Run `job` under Ray Train once (on the connected cluster); the kill -> first step after
    the restart, and the steps lost."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    marks = tmp / f"ray-train-marks-{name}"
    marks.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"marks": str(marks), "job": asdict(job)},
        scaling_config=ScalingConfig(
            num_workers=job.world, use_gpu=False, resources_per_worker={"CPU": 2 / job.world}
        ),
        run_config=RunConfig(
            name=f"ray-train-{name}",
            storage_path=str(tmp / "ray-train"),
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    trainer.fit()
    killed = json.loads((marks / "killed").read_text())
    resumed = json.loads((marks / "resumed").read_text())
    return {
        "recovery_s": resumed["t"] - killed["t"],
        "lost_steps": killed["step"] - resumed["from"],
    }
