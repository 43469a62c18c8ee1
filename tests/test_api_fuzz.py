"""Property-based fuzzing of the whole API from its OpenAPI schema (schemathesis) against a real
`failbench serve` on 127.0.0.1: no input gets a 500, every response fits its schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.service import Server

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cwd = tmp_path_factory.mktemp("fuzz")
    env = {"FAILBENCH_API_TOKEN": TOKEN, "FAILBENCH_MAX_BODY_BYTES": "200000"}
    srv = Server(cwd, f"sqlite:///{cwd / 'fb.db'}", env=env)
    try:
        srv.wait_up()
        yield schemathesis.openapi.from_url(f"{srv.url}/openapi.json")
    finally:
        srv.stop()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_input_breaks_the_api(case: Any) -> None:
    # not_a_server_error plus status-code, content-type, header and response-schema checks
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"})
