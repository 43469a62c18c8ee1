"""Live metrics: what the workers and the controller export through Ray, scraped by a real
Prometheus server (Debian's `prometheus`, which `make test` installs) together with the API's
own `/metrics`, while an experiment runs."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from failbench_ray import telemetry
from failbench_ray.records import PHASES
from tests.service import Server, free_port

TOKEN = "metrics-token"


# -- what is exported, without Ray ---------------------------------------------------------
def test_every_metric_has_one_name_and_the_run_labels() -> None:
    names = [d.name for d in telemetry.DEFINITIONS]
    assert len(names) == len(set(names))
    for d in telemetry.DEFINITIONS:
        assert d.name.startswith("failbench_")
        assert set(telemetry.RUN_TAGS) <= set(d.tags), d.name
        assert (d.kind == "histogram") == bool(d.boundaries), d.name
        assert (d.kind == "counter") == d.name.endswith("_total"), d.name
    assert "ray_failbench_recovery_phase_seconds_bucket" in telemetry.exported_names()
    assert "ray_failbench_loss" in telemetry.exported_names()


class _Sink:
    """Stands in for Ray's metric objects: records what the recorder hands them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict[str, str]]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("set", value, tags))

    inc = observe = set


def _recorder(
    tags: dict[str, str], enabled: bool = True
) -> tuple[telemetry.Recorder, dict[str, _Sink]]:
    rec = telemetry.Recorder(tags, enabled=enabled)
    sinks = {d.name: _Sink() for d in telemetry.DEFINITIONS}
    rec._metrics = dict(sinks)
    return rec, sinks


def test_recovery_phases_last_from_the_phase_reached_before() -> None:
    run = telemetry.run_tags("e", "trial0", "ddp", "disk_ckpt")
    rec, sinks = _recorder(run)
    phases: dict[str, float | None] = dict.fromkeys(PHASES)
    # a cascading failure can leave a phase unreached: the next one lasts from the one before
    phases |= {"detected": 0.5, "quiesced": 0.75, "restored": 2.0, "resumed": 2.5}
    rec.recovery(phases, telemetry.LIVE_PHASES)
    got = sinks[telemetry.PHASE_SECONDS.name].calls
    assert [(v, t["phase"]) for _, v, t in got] == [
        (0.5, "detected"),
        (0.25, "quiesced"),
        (1.25, "restored"),
    ]
    assert sinks[telemetry.RECOVERY_SECONDS.name].calls == []  # not resumed yet
    got.clear()
    rec.recovery(phases, telemetry.LATE_PHASES)
    assert [(v, t["phase"]) for _, v, t in got] == [(0.5, "resumed")]
    assert sinks[telemetry.RECOVERY_SECONDS.name].calls == [("set", 2.5, run)]


def test_each_metric_gets_exactly_its_declared_tags() -> None:
    run = telemetry.run_tags("e", "trial0", "ddp", "none")
    rec, sinks = _recorder({**run, "rank": "-1"})
    rec.set_tag("rank", "3")  # a hot spare took rank 3
    rec.step(7, loss=1.5, seconds=0.25, samples=16, blocked_s=0.0)
    rec.state_transfer("save", 1024, 0.01)
    rec.failure("sigkill", 2)
    ranked = {**run, "rank": "3"}
    assert sinks[telemetry.SAMPLES_PER_SECOND.name].calls == [("set", 64.0, ranked)]
    assert sinks[telemetry.LOSS.name].calls == [("set", 1.5, ranked)]
    assert sinks[telemetry.STATE_BYTES_TOTAL.name].calls == [
        ("set", 1024, {**ranked, "kind": "save"})
    ]
    # run-level metrics carry no rank: Ray refuses a tag the metric did not declare
    assert sinks[telemetry.FAILURES_TOTAL.name].calls == [
        ("set", 1, {**run, "kill_kind": "sigkill"})
    ]
    assert sinks[telemetry.RANKS_KILLED_TOTAL.name].calls == [("set", 2, run)]
    # a blocked time of 0 is no increment (Ray's counters refuse 0)
    assert sinks[telemetry.BLOCKED_SECONDS_TOTAL.name].calls == []


def test_disabled_recorder_records_nothing() -> None:
    rec, sinks = _recorder({}, enabled=False)
    rec.step(1, 1.0, 0.1, 8, 0.01)
    rec.failure("exit", 1)
    assert all(s.calls == [] for s in sinks.values())


# -- a real Prometheus server scraping a real run ------------------------------------------
class Prometheus:
    def __init__(self, cwd: Path, api_port: int, sd_file: Path) -> None:
        binary = shutil.which("prometheus")
        assert binary, "Debian's prometheus is missing: `make test` installs it"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = cwd / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "failbench-api",
                            "static_configs": [{"targets": [f"127.0.0.1:{api_port}"]}],
                        },
                        {
                            "job_name": "ray",
                            "file_sd_configs": [
                                {"files": [str(sd_file)], "refresh_interval": "1s"}
                            ],
                        },
                    ],
                }
            )
        )
        self._log = open(cwd / "prometheus.log", "wb")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={cwd / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_up(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited: see prometheus.log"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready")

    def query(self, promql: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        r.raise_for_status()
        result: list[dict[str, Any]] = r.json()["data"]["result"]
        return result

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Server, Prometheus]]:
    sd_file = tmp_path / "ray_targets.json"
    env = {
        "FAILBENCH_API_TOKEN": TOKEN,
        # Ray's workers report their metrics every 10 s by default; a short run needs 1 s.
        "RAY_metrics_report_interval_ms": "1000",
    }
    srv = Server(
        tmp_path,
        f"sqlite:///{tmp_path / 'fb.db'}",
        dispatchers=1,
        env=env,
        extra=["--prometheus-sd", str(sd_file)],
    )
    prom = None
    try:
        srv.wait_up()
        prom = Prometheus(tmp_path, srv.port, sd_file)
        prom.wait_up()
        yield srv, prom
    finally:
        if prom is not None:
            prom.stop()
        srv.stop()


def _labels(series: list[dict[str, Any]], key: str) -> set[str]:
    return {s["metric"].get(key, "") for s in series}


def test_prometheus_scrapes_training_and_service_metrics_during_a_run(
    watched: tuple[Server, Prometheus],
) -> None:
    srv, prom = watched
    spec = {
        "architecture": "ddp",
        "world_size": 2,
        "model": {"kind": "mlp", "input_dim": 16, "hidden_dim": 64, "depth": 2},
        "steps": 20000,  # long enough to be running while Prometheus looks; cancelled then
        "batch_size": 16,
        "mechanism": {"name": "disk_ckpt", "params": {"interval": 50}},
        "failures": {"kind": "single", "rank": 1, "at_step": 150},
        "baseline": False,
    }
    with srv.client(headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        r = api.post("/v1/experiments", json=spec)
        assert r.status_code == 201, r.text
        exp = r.json()["id"]
        sel = f'experiment="{exp}"'
        wanted = {
            "step": f"ray_failbench_step{{{sel}}}",
            "loss": f"ray_failbench_loss{{{sel}}}",
            "world": f"ray_failbench_world_size{{{sel}}}",
            "saved": f'ray_failbench_state_bytes_total{{{sel},kind="save"}}',
            "failures": f'ray_failbench_failures_injected_total{{{sel},kill_kind="sigkill"}}',
            "phases": f"ray_failbench_recovery_phase_seconds_count{{{sel}}}",
            "http": 'failbench_http_request_duration_seconds_count{route="/v1/experiments"}',
            "queue": "failbench_experiments",
        }
        seen: dict[str, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(seen) < len(wanted):
            running = api.get(f"/v1/experiments/{exp}").json()["status"] == "running"
            for key, q in wanted.items():
                if key not in seen and running:
                    got = prom.query(q)
                    if key == "step" and _labels(got, "rank") != {"0", "1"}:
                        continue  # each rank's worker reports on its own schedule
                    if got:
                        seen[key] = got  # seen while the experiment was still running
            time.sleep(0.5)
        status = api.get(f"/v1/experiments/{exp}").json()["status"]
        assert set(seen) == set(wanted), (
            f"not seen while running: {set(wanted) - set(seen)} (experiment {status})\n"
            + srv.output()[-3000:]
        )
        api.post(f"/v1/experiments/{exp}/cancel")
    step = seen["step"]
    assert _labels(step, "rank") == {"0", "1"}
    assert _labels(step, "architecture") == {"ddp"}
    assert _labels(step, "mechanism") == {"disk_ckpt"}
    assert _labels(step, "trial") == {"trial0"}
    assert _labels(step, "job") == {"ray"}
    assert float(seen["world"][0]["value"][1]) in (1.0, 2.0)
    assert {"detected", "quiesced", "reformed", "restored"} <= _labels(seen["phases"], "phase")
    assert _labels(seen["http"], "job") == {"failbench-api"}
    assert "running" in _labels(seen["queue"], "status")


@pytest.mark.usefixtures("no_leaks")
def test_the_dashboard_names_every_actor_of_a_run(sqlite_url: str, tmp_path: Path) -> None:
    """Ray's dashboard lists actors by name: every rank (and each replacement), the replica
    holders and the chaos actor of a trial carry the experiment and trial in theirs."""
    from ray._private import state

    from tests.test_engine import run, small

    spec = small(
        world_size=2,
        batch_size=16,
        baseline=False,
        mechanism={"name": "inmem_replica", "params": {"interval": 2}},
        failures={"kind": "single", "rank": 1, "at_step": 9},
    )
    result = run(spec, sqlite_url, tmp_path, reuse_workers=False)
    assert result.status == "completed"
    label = f"fb-{result.experiment_id[:8]}-trial0"
    names = {a.get("Name", "") for a in state.actors().values()}
    assert {
        f"{label}-rank0-i0",
        f"{label}-rank1-i0",
        f"{label}-rank1-i1",  # the replacement of the rank killed
        f"{label}-holder0",
        f"{label}-chaos",
    } <= names, sorted(n for n in names if n.startswith("fb-"))
    # Reusing started processes (the default), ranks (replacements too), holders and the
    # chaos actor are the pool's processes, named so (a rank's log says whose rank it is now).
    result = run(spec, sqlite_url, tmp_path)
    assert result.status == "completed"
    label = f"fb-{result.experiment_id[:8]}-trial0"
    names = {a.get("Name", "") for a in state.actors().values()}
    assert not any(n.startswith(label) for n in names)
    for kind in ("-w", "-chaos", "-holder"):
        assert any(n.startswith("fb-pool-") and kind in n for n in names), (kind, names)


def test_serve_dashboard_starts_rays_dashboard_on_loopback_with_token_auth(
    tmp_path: Path,
) -> None:
    dash = free_port()
    srv = Server(
        tmp_path,
        f"sqlite:///{tmp_path / 'fb.db'}",
        dispatchers=1,
        env={"FAILBENCH_API_TOKEN": TOKEN},
        extra=["--dashboard", "--dashboard-port", str(dash)],
    )
    try:
        srv.wait_up()
        deadline = time.monotonic() + 60
        answer = None
        while time.monotonic() < deadline and answer is None:
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.get(f"http://127.0.0.1:{dash}/api/actors", timeout=5)
            time.sleep(0.5)
        assert answer is not None, srv.output()
        assert answer.status_code == 401  # Ray's token authentication stays on
        assert f"Ray dashboard: http://127.0.0.1:{dash}" in srv.output()
        assert "ray get-auth-token" in srv.output()
    finally:
        srv.stop()
