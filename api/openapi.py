"""The OpenAPI schema says what this server does: who may call each route, which names a
request may use, and how one response leads to the next request.

- Security. FastAPI marks every route whose dependencies read the bearer header as needing it;
  but reads are open on loopback, and with no token configured (loopback only) so are writes. A
  client generated from the plain schema would send a token nobody asked for, or demand one the
  operator never set. This sets each operation's `security` from the same rule `api/auth.py`
  applies: required (`[{"HTTPBearer": []}]`), optional (`[{}, {"HTTPBearer": []}]`) or none.
- Names. The spec models take architectures, mechanisms, traces and kill kinds as strings (the
  registries check them, with messages that list the valid ones); the schema enumerates them
  from the registries as it is generated, so a new architecture module shows up without an edit
  here, and generated clients offer exactly the names the server accepts.
- Errors. FastAPI's own 400 for a body it cannot parse is documented where a body is taken.
- Sweeps. A sweep's `base` and extra grid axes are the experiment's own fields, as the
  server checks them (the models take free dicts and check them as they expand the grid).
- Links. A submitted experiment's id leads to its detail, events and cancel; a sweep's id to its
  progress: generated clients and schemathesis' stateful tests follow them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from api.auth import require_reader, require_writer
from api.settings import Settings
from architectures import ARCHITECTURES
from failbench_ray.recommend import PRESETS
from failbench_ray.spec import RECOVERY_TRIGGERS, WORKER_TRIGGERS
from failbench_ray.storage.status import ExperimentStatus
from failbench_ray.sweep import GRID_AXES, TRACE_SHORTHANDS
from injector.kill_kinds import KILL_KINDS
from injector.traces import TRACE_KINDS
from mechanisms import MECHANISMS

BEARER: dict[str, list[str]] = {"HTTPBearer": []}
_REF = "#/components/schemas/"


def _who(route: APIRoute) -> str | None:
    calls = {d.call for d in route.dependant.dependencies}
    if require_writer in calls:
        return "writer"
    if require_reader in calls:
        return "reader"
    return None


def security_of(who: str | None, settings: Settings) -> list[dict[str, Any]]:
    """What `api/auth.py` asks of a caller, as an OpenAPI security requirement."""
    if who is None or settings.api_token is None:
        return []  # no token configured: `serve` allows that on loopback only
    if who == "reader" and settings.loopback:
        return [{}, BEARER]  # open on loopback; a token is accepted
    return [BEARER]


def _set_security(doc: dict[str, Any], routes: Iterable[Any], settings: Settings) -> None:
    for route in routes:
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue
        for method in route.methods or ():
            op = doc["paths"].get(route.path_format, {}).get(method.lower())
            if op is not None:
                op["security"] = security_of(_who(route), settings)


# -- names -----------------------------------------------------------------------------------
def _names() -> dict[str, list[str]]:
    """What each name a request takes may be, read from the registries now. Registries know
    their names without importing their modules, so this costs no torch import."""
    return {
        "architecture": ARCHITECTURES.names(),
        "mechanism": MECHANISMS.names(),
        "trace": TRACE_KINDS.names(),
        "trace_shorthand": list(TRACE_SHORTHANDS),
        "kill": KILL_KINDS.names(),
        "during": [*RECOVERY_TRIGGERS, *WORKER_TRIGGERS],
        "preset": list(PRESETS),
        "status": [s.value for s in ExperimentStatus],
    }


def _enum(schema: dict[str, Any], names: Sequence[str]) -> None:
    """Enumerate `names` on every string in `schema`, through arrays and unions (`str | None`,
    `list[str | dict]`)."""
    if schema.get("type") == "string":
        schema["enum"] = list(names)
    for branch in schema.get("anyOf", ()):
        _enum(branch, names)
    if isinstance(schema.get("items"), dict):
        _enum(schema["items"], names)


def _retarget(schema: dict[str, Any], old: str, new: str) -> None:
    """Point `schema`'s references to component `old` (directly or through an array or a
    union) to `new`."""
    if schema.get("$ref") == _REF + old:
        schema["$ref"] = _REF + new
    for branch in [*schema.get("anyOf", ()), *schema.get("allOf", ())]:
        _retarget(branch, old, new)
    if isinstance(schema.get("items"), dict):
        _retarget(schema["items"], old, new)


def _part(components: dict[str, Any], kind: str, names: Sequence[str]) -> str:
    """A copy of PartSpec whose `name` is one of `names`: architectures and mechanisms share
    the model but not the names. Returns the new component's name."""
    title = kind.capitalize()
    part = copy.deepcopy(components["PartSpec"])
    part["title"] = title
    part["description"] = f"A registered {kind} (by name) and its own parameters."
    _enum(part["properties"]["name"], names)
    components[title] = part
    return title


# (component, property) -> which names; a missing one is a KeyError, so the schema cannot drift
# from the models unnoticed (tests/test_api_fuzz.py reads /openapi.json).
_BODY_NAMES = [
    ("FailureTrace", "kind", "trace"),
    ("FailureEvent", "kill", "kill"),
    ("FailureEvent", "during", "during"),
    ("Grid", "failures", "trace_shorthand"),
]
# (method, path, query parameter) -> which names
_QUERY_NAMES = [
    ("get", "/v1/experiments", "status", "status"),
    ("get", "/v1/experiments", "architecture", "architecture"),
    ("get", "/v1/experiments", "mechanism", "mechanism"),
    ("get", "/v1/recommend", "architecture", "architecture"),
    ("get", "/v1/recommend", "preset", "preset"),
]


def _set_names(doc: dict[str, Any]) -> None:
    names = _names()
    components = doc["components"]["schemas"]
    for kind in ("architecture", "mechanism"):
        part = _part(components, kind, names[kind])
        for model in ("ExperimentSpec", "Grid"):
            _retarget(components[model]["properties"][kind], "PartSpec", part)
    for model, field, kind in _BODY_NAMES:
        _enum(components[model]["properties"][field], names[kind])
    for method, path, param, kind in _QUERY_NAMES:
        params = doc["paths"][path][method]["parameters"]
        (found,) = [p for p in params if p["name"] == param and p["in"] == "query"]
        _enum(found["schema"], names[kind])
    if _REF + "PartSpec" not in json.dumps(doc):
        del components["PartSpec"]  # nothing refers to the generic one any more


# -- sweeps ----------------------------------------------------------------------------------
def _set_sweep_fields(doc: dict[str, Any]) -> None:
    """A sweep's `base` and the grid's other axes are experiment fields (the grid's as lists),
    and its traces FailureTraces: the models take them as free dicts and check them later."""
    components = doc["components"]["schemas"]
    spec = components["ExperimentSpec"]["properties"]
    fields = {k: v for k, v in spec.items() if k not in ("name", *GRID_AXES)}
    base = components["SweepSpec"]["properties"]["base"]
    base.update(properties=copy.deepcopy(fields), additionalProperties=False)
    grid = components["Grid"]
    for field, schema in fields.items():
        grid["properties"][field] = {"type": "array", "minItems": 1, "items": copy.deepcopy(schema)}
    grid["additionalProperties"] = False
    for axis in grid["properties"].values():
        axis["uniqueItems"] = True  # a value listed twice is refused
    for branch in grid["properties"]["failures"]["items"]["anyOf"]:
        if branch.get("type") == "object":
            branch.clear()
            branch["$ref"] = _REF + "FailureTrace"


# -- what FastAPI leaves out -----------------------------------------------------------------
def _set_unparsable(doc: dict[str, Any]) -> None:
    """A body that is not JSON text (bytes that are not UTF-8, say) is FastAPI's 400 before
    any validation; FastAPI does not document it."""
    error = {"application/json": {"schema": {"$ref": _REF + "Error"}}}
    for ops in doc["paths"].values():
        for op in ops.values():
            if "requestBody" in op:
                op["responses"].setdefault(
                    "400", {"description": "The body could not be parsed", "content": error}
                )


# -- links -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """A response of `source` leads to `target`, whose path parameter comes from the body."""

    name: str
    source: tuple[str, str]  # (method, path)
    statuses: tuple[str, ...]
    target: tuple[str, str]
    parameters: dict[str, str]  # target's path parameter -> runtime expression


_EXPERIMENT = "/v1/experiments/{experiment_id}"
_SUBMITTED_ID = {"experiment_id": "$response.body#/id"}
LINKS = [
    *(
        Link(name, ("post", "/v1/experiments"), ("201", "200"), target, _SUBMITTED_ID)
        for name, target in [
            ("GetExperiment", ("get", _EXPERIMENT)),
            ("GetExperimentEvents", ("get", _EXPERIMENT + "/events")),
            ("CancelExperiment", ("post", _EXPERIMENT + "/cancel")),
        ]
    ),
    Link(
        "GetSweep",
        ("post", "/v1/sweeps"),
        ("201",),
        ("get", "/v1/sweeps/{sweep_id}"),
        {"sweep_id": "$response.body#/sweep_id"},
    ),
]


def _set_links(doc: dict[str, Any]) -> None:
    def op(where: tuple[str, str]) -> dict[str, Any]:
        method, path = where
        found: dict[str, Any] = doc["paths"][path][method]
        return found

    for link in LINKS:
        responses = op(link.source)["responses"]
        target = op(link.target)["operationId"]
        for code in link.statuses:
            responses[code].setdefault("links", {})[link.name] = {
                "operationId": target,
                "parameters": dict(link.parameters),
            }


def install(app: FastAPI, settings: Settings, routers: Iterable[APIRouter]) -> None:
    """`routers`: those the app includes (their routes carry the dependencies)."""
    generate = app.openapi  # FastAPI's own (it caches its result in app.openapi_schema)
    routes = [r for router in routers for r in router.routes]

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            _set_security(doc, routes, settings)
            _set_names(doc)
            _set_sweep_fields(doc)
            _set_unparsable(doc)
            _set_links(doc)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
