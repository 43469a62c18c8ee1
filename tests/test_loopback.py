"""Issue 15: a local run listens on loopback only, however it is entered.

Checked by PID, not by port: every listening socket of the driver (this pytest process) and of
every process below it (the local Ray cluster's GCS, raylet, agents and workers), sampled while
a run trains through a failure and a re-formation."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from failbench_ray import network, runtime
from failbench_ray.comm import rendezvous_store
from failbench_ray.errors import ClusterError
from failbench_ray.runner import run_experiment
from failbench_ray.spec import parse_spec
from failbench_ray.storage.db import Database
from tests.own_cluster import run_snippet


@pytest.mark.parametrize(
    ("ip", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),  # a dual-stack socket bound to 127.0.0.1
        ("0.0.0.0", False),
        ("::", False),
        ("192.0.2.2", False),
        ("::ffff:192.0.2.2", False),
        ("fe80::1%eth0", False),
    ],
)
def test_what_counts_as_loopback(ip: str, loopback: bool) -> None:
    assert network.is_loopback(ip) is loopback


def test_the_check_sees_a_socket_that_listens_wide() -> None:
    """The checker itself: a socket on every interface is reported, one on 127.0.0.1 is not."""
    me = [psutil.Process()]
    with socket.create_server(("0.0.0.0", 0)) as wide, network.listen_socket("127.0.0.1") as lo:
        found = {x.port: x for x in network.listeners(me)}
        assert found[wide.getsockname()[1]].ip == "0.0.0.0"
        assert found[lo.getsockname()[1]].ip == "127.0.0.1"
        assert [x.port for x in network.wide_listeners(me)].count(wide.getsockname()[1]) == 1
        assert lo.getsockname()[1] not in [x.port for x in network.wide_listeners(me)]


def test_the_rendezvous_store_listens_on_its_host_only() -> None:
    store = rendezvous_store("127.0.0.1")
    try:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        client.set("k", "v")
        assert store.get("k") == b"v"
        mine = [x for x in network.listeners([psutil.Process()]) if x.port == store.port]
        assert [x.ip for x in mine] == ["127.0.0.1"], mine
    finally:
        del store


def test_the_interface_that_carries_an_address() -> None:
    """What gloo is told to listen on (GLOO_SOCKET_IFNAME): the node address's interface."""
    lo = network.interface_of("127.0.0.1")
    assert lo is not None and "127.0.0.1" in {
        a.address for a in psutil.net_if_addrs()[lo] if a.family == socket.AF_INET
    }
    assert network.interface_of("203.0.113.77") is None  # TEST-NET-3: no interface here


def test_a_cluster_that_advertises_another_address_is_refused() -> None:
    before = runtime._RunningBefore.now()
    with pytest.raises(ClusterError, match=r"advertises '192.0.2.2', not 127.0.0.1.*RAY_ADDRESS"):
        runtime.check_loopback("192.0.2.2", before)
    runtime.check_loopback("127.0.0.1", before)  # nothing started since: nothing to refuse


@pytest.mark.usefixtures("no_leaks")
def test_a_local_run_listens_on_loopback_only_while_it_trains(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Fails on a driver whose rendezvous store listens on every interface (torch's default),
    and on a cluster started after `import ray` without the setting applied at start."""
    spec = parse_spec(
        {
            "architecture": "ddp",
            "world_size": 2,
            "model": {"kind": "mlp", "input_dim": 8, "hidden_dim": 16, "depth": 2},
            "steps": 24,
            "batch_size": 8,
            "warmup_steps": 1,
            "baseline": False,
            "mechanism": {"name": "disk_ckpt", "params": {"interval": 4}},
            "failures": {"kind": "single", "rank": 1, "at_step": 10},
        }
    )
    db = Database(sqlite_url)
    steps: list[int] = []
    with network.ListenWatch(every_s=0.2) as watch:

        def during_training(label: str, step: int, total: int) -> None:
            watch.sample()
            steps.append(step)

        try:
            result = run_experiment(
                spec, db=db, out_dir=tmp_path / "runs", progress=during_training
            )
        finally:
            db.dispose()
    assert result.status == "completed" and len(result.trials[0].failures) == 1
    assert steps, "no progress was reported: nothing was sampled while it trained"
    assert any(p.startswith("ray::") for p in watch.processes), watch.processes  # the workers
    assert any(p == "raylet" for p in watch.processes), watch.processes
    assert not watch.wide, "listening beyond loopback:\n" + "\n".join(map(str, watch.wide))


_IMPORT_RAY_FIRST = """
import json, ray  # Ray first: it reads its cluster setting now, before failbench_ray loads
from failbench_ray import network, runtime
runtime.connect()
@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address()
node = ray.get(where.remote())
wide = [str(x) for x in network.wide_listeners(network.process_tree())]
ray.shutdown()
print(json.dumps({"node": node, "wide": wide}))
"""


def test_importing_ray_first_still_starts_a_loopback_cluster() -> None:
    """Its own process, where nothing imported failbench_ray before Ray (the CLI, the service,
    the bench and the tests all once depended on that order)."""
    out = run_snippet(_IMPORT_RAY_FIRST, drop_env=("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",))
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"node": "127.0.0.1", "wide": []}, got
