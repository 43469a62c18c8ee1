"""What is registered, for `failbench list` (and later the REST registry endpoint)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from architectures import ARCHITECTURES
from injector.kill_kinds import KILL_KINDS
from injector.traces import TRACE_KINDS
from mechanisms import MECHANISMS


def _params(model: type[BaseModel]) -> dict[str, Any]:
    return {
        name: {"default": f.default, "description": f.description or ""}
        for name, f in model.model_fields.items()
    }


def catalog() -> dict[str, list[dict[str, Any]]]:
    return {
        "architectures": [
            {"name": n, "summary": a.summary, "params": _params(a.Params)}
            for n, a in ARCHITECTURES.items()
        ],
        "mechanisms": [
            {"name": n, "summary": m.summary, "params": _params(m.Params)}
            for n, m in MECHANISMS.items()
        ],
        "traces": [{"name": n, "summary": t.summary} for n, t in TRACE_KINDS.items()],
        "kill_kinds": [{"name": n, "summary": k.summary} for n, k in KILL_KINDS.items()],
    }
