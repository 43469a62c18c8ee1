"""How the API answers: bodies serialised once, JSON without NaN, and 422s in FastAPI's own
shape; ids checked before they reach the database; the operator's caps on a spec."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi import HTTPException, Response, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError

from api.settings import Settings
from failbench_ray.checks import resolve
from failbench_ray.errors import SpecError
from failbench_ray.models import param_count
from failbench_ray.spec import ExperimentSpec

_BYTES_PER_PARAM = 4 * 3  # fp32 weights + Adam's two moments


def json_response(model: BaseModel, status_code: int = 200) -> Response:
    """`model` serialised once, by pydantic-core. Returning the model itself would make FastAPI
    validate it against the response model and serialise it again (most of the CPU a small
    request costs). The route's `response_model` still documents the body."""
    return Response(model.model_dump_json(), status_code, media_type="application/json")


def _finite_json(obj: Any) -> Any:
    """NaN and infinities (a diverged loss) as null: JSON has no such numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite_json(v) for v in obj]
    return obj


class FiniteJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        content = _finite_json(content)
        try:
            return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:  # a lone surrogate echoed back: \\u escapes are valid JSON
            return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


_ID = re.compile(r"[0-9a-f]{1,32}")


def known_id(value: str, missing: Exception) -> str:
    """Ids are hex: anything else names nothing (and never reaches the database)."""
    if not _ID.fullmatch(value):
        raise missing
    return value


def _detail(loc: list[Any], msg: str, kind: str) -> list[dict[str, Any]]:
    return [{"loc": loc, "msg": msg, "type": kind}]


def unprocessable(loc: list[Any], msg: str, kind: str = "value_error") -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, _detail(loc, msg, kind))


def check_caps(spec: ExperimentSpec, settings: Settings) -> None:
    """Raise 422 naming the cap a spec goes over (the operator sets the caps)."""
    state_mb = param_count(spec.model) * _BYTES_PER_PARAM / 1e6
    for field, value, cap, name in [
        ("world_size", spec.world_size, settings.max_world_size, "max_world_size"),
        ("steps", spec.steps, settings.max_steps, "max_steps"),
        ("trials", spec.trials, settings.max_trials, "max_trials"),
        ("batch_size", spec.batch_size, settings.max_batch_size, "max_batch_size"),
        (
            "threads_per_worker",
            spec.threads_per_worker,
            settings.max_threads_per_worker,
            "max_threads_per_worker",
        ),
        ("model", state_mb, settings.max_state_mb, "max_state_mb"),
    ]:
        if value > cap:
            shown = f"{value:.0f} MB of state" if field == "model" else f"{field}={value}"
            raise unprocessable(
                ["body", field],
                f"{shown} is over the cap {name}={cap} of this service (FAILBENCH_{name.upper()})",
                "cap",
            )


def no_nul(model: BaseModel) -> None:
    """Strings a database can store: PostgreSQL text cannot hold NUL, and no database (nor
    UTF-8) a lone UTF-16 surrogate. Refused here rather than failing in the database."""
    try:
        text = model.model_dump_json()
    except PydanticSerializationError:
        raise unprocessable(
            ["body"], "strings in a spec may not contain lone UTF-16 surrogates (\\ud800-\\udfff)"
        ) from None
    if "\\u0000" in text:
        raise unprocessable(["body"], "strings in a spec may not contain NUL (\\u0000)")


def check_runnable(spec: ExperimentSpec, settings: Settings, loc: list[Any]) -> None:
    no_nul(spec)
    check_caps(spec, settings)
    try:
        resolve(spec)  # unknown params, not-applicable pairs: refused now, not at run time
    except SpecError as err:
        raise unprocessable([*loc, *err.loc], str(err), "spec") from None
