"""The reference the harness's overhead is measured against: a plain torch DDP loop.

Same model, data split, optimizer and threads per process as the harness's `ddp` architecture, but
no Ray, no comm hook, no abort handle: processes started by `torch.multiprocessing` (spawn), gloo
rendezvous on a store rank 0 hosts on 127.0.0.1, `DistributedDataParallel(model)` with its
defaults. Each step is timed the way the harness times it (`failbench_ray/worker.py`: wall time of
data + forward + backward + optimizer step on one rank; `results.step_durations`: the slowest
rank's per step; `results.steady_state_steps`: the first `warmup_steps` left out; median).

No Ray import here: spawned children import this module (and `bench.run`, the main module).
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from failbench_ray.data import SyntheticData
from failbench_ray.models import build_model, loss_fn
from failbench_ray.optim import build_optimizer
from failbench_ray.spec import ExperimentSpec


@dataclass(frozen=True)
class PlainRun:
    step_time_s: float  # median over the steady-state steps of the slowest rank's step time
    mean_step_time_s: float
    steady_steps: int
    wall_s: float  # spawn to join, process start and rendezvous included


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank_main(rank: int, world: int, port: int, spec_json: str, out_dir: str) -> None:
    """One rank of the plain loop; writes [(step, t_start, t_end)] to out_dir/rank{rank}.json."""
    spec = ExperimentSpec.model_validate_json(spec_json)
    torch.set_num_threads(spec.threads_per_worker)
    # Rank 0 hosts the rendezvous on 127.0.0.1 only (torch's own server would listen on
    # every interface, and the bench checks that nothing of it does).
    if rank == 0:
        sock = socket.create_server(("127.0.0.1", port))
        store = dist.TCPStore("127.0.0.1", port, world, True, master_listen_fd=sock.detach())
    else:
        store = dist.TCPStore("127.0.0.1", port, world, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    module = build_model(spec.model, spec.seed)
    model = DistributedDataParallel(module)
    optimizer = build_optimizer(spec.optimizer, module.parameters())
    data = SyntheticData(spec.model, spec.seed)
    times: list[tuple[int, float, float]] = []
    for step in range(1, spec.steps + 1):
        t0 = time.time()
        x, y = data.shard(step, spec.batch_size, rank, world)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(spec.model, model(x), y)
        loss.backward()
        optimizer.step()
        float(loss.detach())  # the harness reads the loss too
        times.append((step, t0, time.time()))
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(times))


def run_plain_ddp(spec: ExperimentSpec, work_dir: Path, *, timeout_s: float) -> PlainRun:
    """Run the plain loop on `spec.world_size` spawned processes; raise if it fails or hangs."""
    work_dir.mkdir(parents=True, exist_ok=True)
    world = spec.world_size
    args = (world, free_port(), spec.model_dump_json(), str(work_dir))
    t0 = time.monotonic()
    ctx = mp.start_processes(_rank_main, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = t0 + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:  # only the processes started just above, by PID
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"the plain DDP loop did not finish within {timeout_s:.0f} s")
    wall = time.monotonic() - t0
    per_rank = [json.loads(Path(work_dir, f"rank{r}.json").read_text()) for r in range(world)]
    slowest: dict[int, float] = {}
    for rows in per_rank:
        for step, start, end in rows:
            slowest[step] = max(slowest.get(step, 0.0), end - start)
    steady = [d for step, d in sorted(slowest.items()) if step >= 1 + spec.warmup_steps]
    return PlainRun(
        step_time_s=statistics.median(steady),
        mean_step_time_s=statistics.fmean(steady),
        steady_steps=len(steady),
        wall_s=wall,
    )
