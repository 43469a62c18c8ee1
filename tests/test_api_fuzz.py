"""Property-based fuzzing of the whole API from its OpenAPI schema (schemathesis) against a real
`failbench serve` on 127.0.0.1: no input gets a 500, every response fits its schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from tests.service import Server

TOKEN = "fuzz-token"
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


def test_no_input_breaks_the_api(tmp_path: Path) -> None:
    env = {"FAILBENCH_API_TOKEN": TOKEN, "FAILBENCH_MAX_BODY_BYTES": "200000"}
    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'fb.db'}", env=env)
    try:
        srv.wait_up()
        doc = httpx.get(f"{srv.url}/openapi.json", timeout=30).json()
        schema = schemathesis.openapi.from_dict(doc)
        checked = []
        for found in schema.get_all_operations():
            op = found.ok()

            @given(case=op.as_strategy())
            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
            def check(case: Any) -> None:
                # Cross-field rules (a failure's ranks inside world_size...) are not in the
                # schema, so schema-valid data may rightly get a 422: no 500, and every
                # response as documented, is what is checked.
                case.call_and_validate(
                    base_url=srv.url,
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    checks=CHECKS,
                )

            check()
            checked.append(op.label)
        assert len(checked) >= 8, checked  # every operation of the API was fuzzed
    finally:
        srv.stop()
