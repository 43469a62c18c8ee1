"""The REST API over real HTTP: `failbench serve` on 127.0.0.1 (no dispatchers here, so nothing
leaves the queue), on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from failbench_ray.recommend import Question, recommend_stored
from tests.conftest import fresh_pg_database
from tests.service import Server
from tests.tcpproxy import Proxy

TINY: dict[str, Any] = {
    "architecture": "ddp",
    "world_size": 2,
    "model": {"kind": "mlp", "input_dim": 8, "hidden_dim": 8, "depth": 1},
    "steps": 4,
    "batch_size": 4,
    "mechanism": "none",
}
TOKEN = "s3cret-token"


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    cwd = tmp_path_factory.mktemp("serve")
    env = {"FAILBENCH_API_TOKEN": TOKEN, "FAILBENCH_MAX_BODY_BYTES": "20000"}
    if request.param == "sqlite":
        yield from _serve(cwd, f"sqlite:///{cwd / 'fb.db'}", env)
    else:
        with fresh_pg_database() as url:
            yield from _serve(cwd, url, env)


def _serve(cwd: Path, url: str, env: dict[str, str]) -> Iterator[Server]:
    srv = Server(cwd, url, env=env)
    try:
        srv.wait_up()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client(headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def submit(api: httpx.Client, spec: dict[str, Any], **headers: str) -> httpx.Response:
    return api.post("/v1/experiments", json=spec, headers=headers)


def test_submit_then_read_it_back(api: httpx.Client) -> None:
    r = submit(api, {**TINY, "name": "first"})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["status"] == "queued" and body["created"] is True
    got = api.get(f"/v1/experiments/{body['id']}").json()
    assert got["status"] == "queued" and got["name"] == "first" and got["result"] is None
    assert got["spec"]["world_size"] == 2 and got["attempts"] == 0
    events = api.get(f"/v1/experiments/{body['id']}/events").json()
    assert events == {"id": body["id"], "status": "queued", "trials": []}


def test_idempotency_key(api: httpx.Client) -> None:
    first = submit(api, {**TINY, "name": "idem"}, **{"Idempotency-Key": "abc-1"})
    again = submit(api, {**TINY, "name": "idem"}, **{"Idempotency-Key": "abc-1"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"] and again.json()["created"] is False
    other = submit(api, {**TINY, "name": "changed"}, **{"Idempotency-Key": "abc-1"})
    assert other.status_code == 409 and "different spec" in other.json()["detail"]
    empty = submit(api, {**TINY, "name": "idem"}, **{"Idempotency-Key": ""})
    assert empty.status_code == 422, empty.text
    assert "idempotency-key" in empty.text.lower() and "at least 1" in empty.text


def test_concurrent_retries_with_one_key_make_one_experiment(api: httpx.Client) -> None:
    ids: list[str] = []
    codes: list[int] = []

    def post() -> None:
        r = submit(api, {**TINY, "name": "race"}, **{"Idempotency-Key": "race-1"})
        codes.append(r.status_code)
        ids.append(r.json()["id"])

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and sorted(codes) == [200] * 7 + [201]


def test_list_filters_and_pages(api: httpx.Client) -> None:
    made = [submit(api, {**TINY, "name": f"page{i}"}).json()["id"] for i in range(5)]
    fsdp = submit(api, {**TINY, "architecture": "fsdp", "name": "f"}).json()["id"]
    page = api.get("/v1/experiments", params={"architecture": "ddp", "limit": 2}).json()
    assert page["limit"] == 2 and len(page["items"]) == 2 and page["total"] >= 5
    assert [e["id"] for e in page["items"]] == made[::-1][:2]  # newest first
    second = api.get("/v1/experiments", params={"architecture": "ddp", "limit": 2, "offset": 2})
    assert [e["id"] for e in second.json()["items"]] == made[::-1][2:4]
    only = api.get("/v1/experiments", params={"architecture": "fsdp"}).json()
    assert [e["id"] for e in only["items"]] == [fsdp]
    queued = api.get("/v1/experiments", params={"status": "queued", "limit": 500}).json()
    assert all(e["status"] == "queued" for e in queued["items"])
    bad = api.get("/v1/experiments", params={"status": "nope"})
    assert bad.status_code == 422 and "queued" in bad.json()["detail"][0]["msg"]


@pytest.mark.parametrize(
    ("change", "loc", "says"),
    [
        ({"world_size": 1}, ["body", "world_size"], "greater than or equal to 2"),
        ({"quiesce": "later"}, ["body", "quiesce"], "'abort', 'kill_survivors' or 'wait_timeout'"),
        ({"architecture": "nope"}, ["body", "architecture"], "ddp"),
        ({"mechanism": "jit_ckpt", "architecture": "ps", "world_size": 3}, ["body"], "applicable"),
        ({"world_size": 65}, ["body", "world_size"], "cap max_world_size=64"),
        ({"steps": 10**6}, ["body", "steps"], "cap max_steps"),
        ({"model": {"kind": "mlp", "hidden_dim": 20000, "depth": 8}}, ["body", "model"], "MB"),
        ({"model": {"kind": "mlp", "depth": 10**27}}, ["body", "model"], "max_state_mb"),
        ({"unknown_field": 1}, ["body", "unknown_field"], "not permitted"),
    ],
)
def test_a_bad_spec_is_422_with_the_field_and_what_is_allowed(
    api: httpx.Client, change: dict[str, Any], loc: list[str], says: str
) -> None:
    r = submit(api, {**TINY, **change})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(d["loc"][: len(loc)] == loc and says in d["msg"] for d in detail), detail


def test_not_json_and_too_large_bodies(api: httpx.Client) -> None:
    r = api.post(
        "/v1/experiments", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422
    big = {**TINY, "name": "x" * 30_000}
    r = submit(api, big)
    assert r.status_code == 413 and "max_body_bytes=20000" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts what arrives
        yield json.dumps(big).encode()

    r = api.post("/v1/experiments", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_unknown_ids_are_404(api: httpx.Client) -> None:
    for path in ("/v1/experiments/nope", "/v1/experiments/nope/events", "/v1/sweeps/nope"):
        assert api.get(path).status_code == 404, path
    assert api.post("/v1/experiments/nope/cancel").status_code == 404


def test_cancel_a_queued_experiment_then_again(api: httpx.Client) -> None:
    exp = submit(api, TINY).json()["id"]
    r = api.post(f"/v1/experiments/{exp}/cancel")
    assert r.status_code == 202 and r.json() == {"id": exp, "status": "cancelled"}
    assert api.get(f"/v1/experiments/{exp}").json()["status"] == "cancelled"
    again = api.post(f"/v1/experiments/{exp}/cancel")
    assert again.status_code == 409 and "is cancelled" in again.json()["detail"]


def test_a_read_right_after_a_cancel_sees_it(api: httpx.Client) -> None:
    # The cancel's commit must happen before its 202 is sent (CI once read 'queued' here):
    # repeated, since the race it guards against is a matter of microseconds.
    for _ in range(30):
        exp = submit(api, TINY).json()["id"]
        assert api.post(f"/v1/experiments/{exp}/cancel").status_code == 202
        assert api.get(f"/v1/experiments/{exp}").json()["status"] == "cancelled"


def test_mutations_need_the_token_reads_do_not_on_loopback(server: Server) -> None:
    with server.client() as anon:
        assert submit(anon, TINY).status_code == 401
        r = submit(anon, TINY, Authorization="Bearer wrong")
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert anon.post("/v1/sweeps", json={}).status_code == 401
        assert anon.get("/v1/experiments").status_code == 200
        assert anon.get("/v1/registry").status_code == 200


def test_sweeps(api: httpx.Client) -> None:
    sweep = {
        "name": "api-sweep",
        "base": {k: v for k, v in TINY.items() if k not in ("architecture", "mechanism")},
        "grid": {
            "architecture": ["ddp", "hybrid"],  # hybrid's 2 x 2 needs 4 ranks: skipped
            "mechanism": ["none", "jit_ckpt"],
            "failures": ["single"],
        },
    }
    r = api.post("/v1/sweeps", json=sweep)
    assert r.status_code == 201, r.text
    body = r.json()
    queued = {c["key"] for c in body["experiments"]}
    skipped = {c["key"]: c["reason"] for c in body["skipped"]}
    assert queued == {"ddp/none/single", "ddp/jit_ckpt/single"}
    assert set(skipped) == {"hybrid/none/single", "hybrid/jit_ckpt/single"}
    assert "4 != world_size=2" in skipped["hybrid/none/single"]
    progress = api.get(f"/v1/sweeps/{body['sweep_id']}").json()
    assert progress["progress"] == {
        "pending": 2, "running": 0, "completed": 0, "failed": 0, "skipped": 2
    }  # fmt: skip
    assert progress["status"] == "running"
    listed = api.get("/v1/experiments", params={"sweep": body["sweep_id"]}).json()
    assert {e["id"] for e in listed["items"]} == {c["experiment_id"] for c in body["experiments"]}
    # the same sweep again: nothing new is queued
    again = api.post("/v1/sweeps", json=sweep).json()
    assert again["sweep_id"] == body["sweep_id"] and again["experiments"] == []
    bad = api.post("/v1/sweeps", json={**sweep, "grid": {"architecture": ["nope"]}})
    assert bad.status_code == 422


def test_a_sweep_over_the_cell_cap_is_refused_before_it_is_expanded(api: httpx.Client) -> None:
    """A body of a few KB naming 64 million cells: refused from the axes' lengths (expanding
    it first took seconds and hundreds of MB for 160,000 cells; here it would exhaust memory)."""
    grid = {
        "architecture": ["ddp"],
        "mechanism": ["none"],
        "failures": ["none"],
        "seed": list(range(400)),
        "steps": list(range(1, 401)),
        "batch_size": list(range(1, 401)),
    }
    sweep = {"name": "huge", "base": {"world_size": 2}, "grid": grid}
    r = api.post("/v1/sweeps", json=sweep)
    assert r.status_code == 422, r.text
    assert "64000000 cells is over the cap max_sweep_cells=1000" in r.text
    assert "FAILBENCH_MAX_SWEEP_CELLS" in r.text


def test_registry_health_and_metrics(api: httpx.Client) -> None:
    reg = api.get("/v1/registry").json()
    assert {a["name"] for a in reg["architectures"]} >= {"ddp", "fsdp", "ps", "gossip"}
    assert {"sigkill"} <= {k["name"] for k in reg["kill_kinds"]}
    cell = next(
        c for c in reg["matrix"] if (c["architecture"], c["mechanism"]) == ("ps", "jit_ckpt")
    )
    assert cell["applicable"] is False and cell["reason"]
    assert api.get("/healthz").json() == {"status": "ok", "database": "ok", "dispatchers": 0}
    submit(api, TINY)
    text = api.get("/metrics").text
    assert "failbench_queue_depth " in text
    assert 'failbench_experiments{status="queued"}' in text
    posted = 'failbench_http_request_duration_seconds_count{method="POST",route="/v1/experiments"'
    assert posted in text
    doc = api.get("/openapi.json").json()
    assert "/v1/experiments/{experiment_id}/cancel" in doc["paths"]


def test_serve_refuses_a_public_address_without_a_token(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "failbench_ray.cli", "serve", "--host", "0.0.0.0",
         "--dispatchers", "0", "--db", f"sqlite:///{tmp_path / 'x.db'}"],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2
    assert "refusing to serve on 0.0.0.0 without a token" in r.stderr
    assert "FAILBENCH_API_TOKEN" in r.stderr


def test_serve_on_a_busy_port_says_so_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "failbench_ray.cli", "serve", "--port", str(port),
             "--dispatchers", "1", "--db", f"sqlite:///{tmp_path / 'x.db'}"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "--port" in r.stderr
    # refused before the database or a Ray cluster was started
    assert not (tmp_path / "x.db").exists()
    assert "Started a local Ray instance" not in r.stderr


def test_recommend_answers_like_the_cli_and_refuses_bad_questions(
    api: httpx.Client, server: Server
) -> None:
    q = {"architecture": "ddp", "state_gb": 10, "world": 64, "mtbf_hours": 5e4}
    r = api.get("/v1/recommend", params={**q, "simulate_runs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    # the typed response drops and changes nothing: the CLI's answer (`recommend --json`
    # runs the same function on the same database), field for field
    cli = recommend_stored(server.db_url, Question.model_validate({**q, "simulate_runs": 2}))
    assert body == json.loads(json.dumps(cli))
    assert body["ranking"][0]["ettr"] >= body["ranking"][-1]["ettr"]
    assert body["question"]["world"] == 64
    policy = body["policy"]  # issue 20: what to set, with the ETTR to expect
    assert policy["mechanism"] == body["ranking"][0]["mechanism"]
    assert policy["ettr"] == body["ranking"][0]["ettr"] and len(policy["ettr_interval95"]) == 2
    assert policy["spares"] >= 0 and policy["hang_timeout_s"] >= 1.5
    for bad, says in [
        ({**q, "world": 1}, "--world must be at least 2"),
        ({**q, "mtbf_hours": 0}, "--mtbf-hours must be at least 0.001"),
        ({**q, "architecture": "resnet"}, "unknown architecture 'resnet'"),
        ({**q, "bogus": 1}, "bogus"),
    ]:
        r = api.get("/v1/recommend", params=bad)
        assert r.status_code == 422 and says in r.text, r.text


@pytest.mark.parametrize(
    ("body", "where", "says"),
    [
        ('"optimizer": {"lr": Infinity}', ["body", "optimizer", "lr"], "finite number"),
        ('"seed": NaN', ["body", "seed"], "finite number"),
        ('"name": "\\ud800"', ["body"], "lone UTF-16 surrogates"),
        (
            '"mechanism": {"name": "disk_ckpt", "params": ' + '{"a": ' * 300 + "1" + "}" * 301,
            ["body", "mechanism", "params"],
            "more than 8 levels deep",
        ),
        ('"batch_size": 1000000000000', ["body", "batch_size"], "less than or equal"),
        ('"threads_per_worker": 1000000', ["body", "threads_per_worker"], "less than or equal"),
        ('"pg_timeout_s": 1e300', ["body", "pg_timeout_s"], "less than or equal to 86400"),
        ('"max_recoveries": 1000000000000', ["body", "max_recoveries"], "less than or equal"),
        ('"batch_size": 100000', ["body", "batch_size"], "max_batch_size=65536"),
        ('"threads_per_worker": 17', ["body", "threads_per_worker"], "max_threads_per_worker=16"),
    ],
    ids=[
        "inf",
        "nan",
        "surrogate",
        "deep-params",
        "batch",
        "threads",
        "timeout",
        "recoveries",
        "batch-cap",
        "threads-cap",
    ],  # fmt: skip
)
def test_malformed_and_unbounded_values_are_422_not_500(
    api: httpx.Client, body: str, where: list[str], says: str
) -> None:
    """Issue 16: each of these was a 500 (PostgreSQL refused the JSON, a 422 that echoed NaN
    could not be rendered, a surrogate could not be encoded, deep params overflowed the stack)
    or was accepted without bound."""
    spec = json.dumps({k: v for k, v in TINY.items()})[:-1] + ", " + body + "}"
    r = api.post("/v1/experiments", content=spec, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(d["loc"][: len(where)] == where and says in d["msg"] for d in detail), detail


@pytest.mark.postgres
def test_a_database_outage_is_503_naming_nothing_internal(tmp_path: Path) -> None:
    """Issue 16: the 503 bodies once quoted the driver's error (host, port, database name) to
    any reader. The database goes away behind a proxy (the shared server keeps running)."""
    with fresh_pg_database() as url:
        proxy = Proxy(("127.0.0.1", 5432))
        name = url.rsplit("/", 1)[1]
        srv = Server(tmp_path, url.replace(":5432/", f":{proxy.port}/"))
        try:
            srv.wait_up()
            with srv.client() as api:
                assert api.get("/v1/experiments").status_code == 200
                proxy.cut()
                down = [api.get("/v1/experiments"), api.get("/healthz")]
                proxy.restore()
                up = api.get("/v1/experiments")
        finally:
            srv.stop()
            proxy.close()
    assert [r.status_code for r in down] == [503, 503], [r.text for r in down]
    for r in down:
        for secret in ("127.0.0.1", "5432", str(proxy.port), name, "postgres"):
            assert secret not in r.text, (secret, r.text)
    assert down[0].json()["detail"] == "the database is unavailable; retry shortly"
    assert down[0].headers["retry-after"] == "2"
    assert down[1].json()["database"] == "unavailable"
    assert up.status_code == 200, up.text
    assert "database unavailable" in srv.output()  # the operator's log has the reason


def test_the_schema_says_which_routes_need_the_token_as_the_server_decides(
    server: Server,
) -> None:
    """Issue 16, item 6: reads are open on loopback, so the schema makes their token optional;
    writes need it. Each claim is checked against the server, without a token."""
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    security = {
        (method, path): op.get("security")
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
    }
    bearer = {"HTTPBearer": []}
    assert security[("get", "/v1/experiments")] == [{}, bearer]
    assert security[("post", "/v1/experiments")] == [bearer]
    assert security[("get", "/healthz")] == []
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for (method, path), needs in security.items():
            if "{" in path:
                path = path.replace("{experiment_id}", "0" * 32).replace("{sweep_id}", "0" * 32)
            r = anonymous.request(method.upper(), path, json={} if method == "post" else None)
            if needs == [bearer]:
                assert r.status_code == 401, (method, path, r.status_code)
            else:
                assert r.status_code != 401, (method, path, r.text)
