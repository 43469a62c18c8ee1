"""Beyond one machine: ranks placed with a placement group across Ray nodes (PACK or SPREAD),
and the `node` kill kind, which fails a whole node (its raylet) mid-run. Runs on a simulated
cluster of four raylets on loopback (`tests/multinode.py`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _spec(name: str, **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "architecture": "ddp",
        "world_size": 2,
        "model": {"kind": "mlp", "input_dim": 8, "hidden_dim": 16, "depth": 1},
        "steps": 16,
        "batch_size": 8,
        "warmup_steps": 1,
    }
    return spec | over


def _run(tmp_path: Path, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    paths = []
    for i, spec in enumerate(specs):
        paths.append(tmp_path / f"spec{i}.json")
        paths[-1].write_text(json.dumps(spec))
    log = tmp_path / "multinode.log"
    # Ray's files for this cluster in a folder of its own: `Cluster` writes its address to
    # <RAY_TMPDIR>/ray/ray_current_cluster, which a plain `ray.init()` on this machine would join
    # long after the cluster is killed. (Short: Ray's socket paths must fit in 107 bytes.)
    ray_tmp = tempfile.mkdtemp(prefix="fbmn", dir="/tmp")
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.multinode", str(tmp_path), *map(str, paths)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, "RAY_TMPDIR": ray_tmp},
            start_new_session=True,  # its raylets too: stopped together below
        )
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of its cluster is left
            proc.wait()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, log.read_text()[-4000:]
    return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


def test_pack_and_spread_place_ranks_and_a_node_kill_is_recovered(tmp_path: Path) -> None:
    node_kill = {"kind": "single", "rank": 0, "at_step": 9, "kill": "node"}
    specs = [
        _spec("pack", placement="pack", baseline=False),
        _spec("spread", placement="spread", baseline=False),
        _spec(
            "node-disk",
            placement="spread",
            mechanism={"name": "disk_ckpt", "params": {"interval": 4}},
            failures=node_kill,
        ),
        _spec(
            "node-inmem",
            placement="spread",
            mechanism={
                "name": "inmem_replica",
                "params": {"interval": 2, "placement": "peers", "disk_interval": 0},
            },
            failures=node_kill,
        ),
    ]
    pack, spread, disk, inmem = _run(tmp_path, specs)

    def nodes(run: dict[str, Any], kind: str = "trials") -> dict[str, str]:
        t = run["result"]["trials"][0] if kind == "trials" else run["result"]["baseline"]
        return dict(t["rank_nodes"])

    # the chaos actor lives on the head (no ranks there, never killed), or a node kill could
    # take it with its victim: Ray's soft affinity had put it on a worker node
    for run in (pack, spread, disk, inmem):
        assert run["chaos_nodes"] == [run["head"]], run["chaos_nodes"]
    # a node has 2 CPUs and a rank takes 1: PACK puts both on one node, SPREAD on two
    assert len(set(nodes(pack).values())) == 1
    assert len(set(nodes(spread).values())) == 2
    # inmem_replica's holders pull step 8's copy in the background: a node kill at step 9 can
    # take that pull in flight, and then step 6's copies are the newest whole ones.
    for run, restored_from in ((disk, {8}), (inmem, {6, 8})):
        result = run["result"]
        trial = result["trials"][0]
        assert result["status"] == "completed", trial.get("error")
        (f,) = trial["failures"]
        assert f["kill_kind"] == "node"
        assert f["ranks"] == [0]  # rank 1 runs on another node
        assert f["restored_from_step"] in restored_from
        assert trial["matches_baseline"] is True  # the exact state came back
        placed = nodes(run)
        assert placed["0"] != placed["1"]
        assert placed["0"] not in run["alive"]  # that node is gone for good
    assert disk["result"]["trials"][0]["failures"][0]["restore_source"].startswith("checkpoint")
    # the copy of rank 0's state lived on rank 1's node, which survived
    assert inmem["result"]["trials"][0]["failures"][0]["restore_source"].startswith("replica")
