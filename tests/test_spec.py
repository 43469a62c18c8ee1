"""The spec: parsing, shorthands, defaults, and every refusal, with the message it gives.

No Ray: `parse_spec`/`load_spec` and `checks.resolve` are pure functions of the spec and the
registries.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from architectures.ddp import DDP
from failbench_ray.checks import Resolved, resolve
from failbench_ray.errors import NotApplicableError, SpecError
from failbench_ray.spec import (
    ExperimentSpec,
    FailureEvent,
    FailureTrace,
    ModelSpec,
    OptimizerSpec,
    PartSpec,
    load_spec,
    parse_spec,
)
from mechanisms import MECHANISMS
from mechanisms.base import FailureContext, Mechanism, RecoveryPlan
from mechanisms.disk_ckpt import DiskCkpt, DiskCkptParams
from mechanisms.none import NoFT


def check(data: Any) -> Resolved:
    """What `failbench run` does with a spec before any actor starts."""
    return resolve(parse_spec(data))


# ---------------------------------------------------------------------------------------------
# Defaults and shorthands


def test_empty_spec_takes_every_default() -> None:
    spec = parse_spec({})
    assert spec.architecture == PartSpec(name="ddp", params={})
    assert spec.mechanism == PartSpec(name="none", params={})
    assert spec.world_size == 4
    assert spec.steps == 60
    assert spec.batch_size == 64
    assert spec.trials == 1
    assert spec.seed == 0
    assert spec.failures == FailureTrace(kind="none", events=[])
    assert spec.pg_timeout_s == 1800.0
    assert spec.quiesce == "abort"
    assert spec.warmup_steps == 3
    assert spec.baseline is True
    assert spec.model == ModelSpec(kind="mlp", input_dim=64, hidden_dim=256, depth=4)
    assert spec.optimizer == OptimizerSpec(name="sgd", lr=0.05, momentum=0.9)

    resolved = resolve(spec)
    assert isinstance(resolved.arch, DDP)
    assert isinstance(resolved.mech, NoFT)
    assert resolved.spec is spec


def test_part_string_shorthand_equals_the_mapping_form() -> None:
    short = parse_spec({"architecture": "ddp", "mechanism": "disk_ckpt"})
    long = parse_spec({"architecture": {"name": "ddp"}, "mechanism": {"name": "disk_ckpt"}})
    assert short == long
    assert short.architecture == PartSpec(name="ddp", params={})
    resolved = resolve(short)
    assert isinstance(resolved.mech, DiskCkpt)
    assert isinstance(resolved.mech.params, DiskCkptParams)
    assert resolved.mech.params.interval == 10  # the mechanism's own default


def test_mechanism_params_reach_the_mechanism() -> None:
    resolved = check({"mechanism": {"name": "disk_ckpt", "params": {"interval": 7}}})
    assert resolved.mech.params == DiskCkptParams(interval=7)


def test_single_failure_shorthand() -> None:
    spec = parse_spec({"failures": {"kind": "single", "rank": 3, "at_step": 25}})
    explicit = parse_spec(
        {"failures": {"kind": "single", "events": [{"ranks": [3], "at_step": 25}]}}
    )
    assert spec == explicit
    (event,) = spec.failures.events
    assert event == FailureEvent(ranks=[3], at_step=25)
    assert event.kill == "sigkill"
    assert event.trigger == "step=25"
    assert event.worker_point == ("step", 25)
    check({"failures": {"kind": "single", "rank": 3, "at_step": 25}})


def test_concurrent_ranks_shorthand() -> None:
    spec = parse_spec(
        {"failures": {"kind": "concurrent", "ranks": [1, 2], "at_step": 25, "kill": "exit"}}
    )
    assert spec.failures.kind == "concurrent"
    assert spec.failures.events == [FailureEvent(ranks=[1, 2], at_step=25, kill="exit")]
    check(spec.model_dump())


def test_time_trigger() -> None:
    spec = parse_spec({"failures": {"kind": "single", "rank": 0, "at_seconds": 4.0}})
    (event,) = spec.failures.events
    assert event.trigger == "t=4s"
    assert event.worker_point is None  # the chaos actor's timer fires it, not a worker
    resolve(spec)


def test_cascading_trace() -> None:
    data = {
        "mechanism": "disk_ckpt",
        "failures": {
            "kind": "cascading",
            "events": [{"rank": 3, "at_step": 25}, {"rank": 1, "during": "restoring"}],
        },
    }
    spec = check(data).spec
    first, second = spec.failures.events
    assert first.ranks == [3] and first.trigger == "step=25"
    assert second.ranks == [1] and second.trigger == "during=restoring"
    assert second.worker_point is None


def test_kill_during_checkpoint_write() -> None:
    spec = check(
        {
            "mechanism": "disk_ckpt",
            "failures": {"kind": "single", "rank": 0, "at_step": 20, "during": "checkpoint_write"},
        }
    ).spec
    (event,) = spec.failures.events
    assert event.worker_point == ("checkpoint_write", 20)
    assert event.trigger == "during=checkpoint_write@20"


def test_spec_round_trips_through_its_dump() -> None:
    spec = parse_spec(
        {
            "name": "rt",
            "world_size": 8,
            "batch_size": 64,
            "mechanism": {"name": "disk_ckpt", "params": {"interval": 5}},
            "failures": {"kind": "concurrent", "ranks": [1, 5], "at_step": 25},
            "model": {"kind": "transformer", "d_model": 32, "n_heads": 4},
        }
    )
    assert parse_spec(spec.model_dump(mode="json")) == spec


# ---------------------------------------------------------------------------------------------
# Refusals: (spec, phrases the one-line message must contain). Shared with test_cli_errors.

BAD_SPECS: dict[str, tuple[Any, list[str]]] = {
    "unknown_architecture": (
        {"architecture": "ring"},
        ["unknown architecture 'ring'", "valid: ddp"],
    ),
    "unknown_mechanism": (
        {"mechanism": {"name": "magic", "params": {}}},
        ["unknown mechanism 'magic'", "valid:", "disk_ckpt", "none"],
    ),
    "unknown_kill_kind": (
        {"failures": {"kind": "single", "rank": 1, "at_step": 5, "kill": "zap"}},
        ["unknown kill kind 'zap'", "valid:", "exit", "ray_kill", "sigkill"],
    ),
    "unknown_trace_kind": (
        {"failures": {"kind": "random", "rank": 1, "at_step": 5}},
        ["unknown trace kind 'random'", "valid:", "cascading", "concurrent", "single"],
    ),
    "exit_kill_on_a_timer": (
        {"failures": {"kind": "single", "rank": 1, "at_seconds": 2.0, "kill": "exit"}},
        ["kill=exit needs a trigger inside the worker", "t=2s", "use sigkill or ray_kill"],
    ),
    "exit_kill_during_a_phase": (
        {
            "failures": {
                "kind": "cascading",
                "events": [
                    {"rank": 1, "at_step": 5},
                    {"rank": 2, "during": "resuming", "kill": "exit"},
                ],
            }
        },
        ["kill=exit needs a trigger inside the worker", "during=resuming"],
    ),
    "cascading_kill_of_a_rank_still_dead": (
        {
            "failures": {
                "kind": "cascading",
                "events": [{"rank": 1, "at_step": 5}, {"rank": 1, "during": "reforming"}],
            }
        },
        ["events[1] fires during reforming", "rank(s) [1]", "still dead", "restoring or resuming"],
    ),
    "hybrid_shape_does_not_fit": (
        {
            "world_size": 6,
            "batch_size": 12,
            "architecture": {"name": "hybrid", "params": {"dp": 2, "pp": 2}},
        },
        ["dp x pp x tp = 2 x 2 x 1 = 4 != world_size=6", "1x6, 2x3, 3x2"],
    ),
    "hybrid_tp_does_not_divide_hidden": (
        {
            "world_size": 12,
            "batch_size": 16,
            "model": {"hidden_dim": 32},
            "architecture": {"name": "hybrid", "params": {"dp": 2, "pp": 2, "tp": 3}},
        },
        ["degree 3 does not divide model.hidden_dim=32"],
    ),
    "more_stages_than_layers": (
        {"world_size": 6, "batch_size": 12, "architecture": "pipeline", "model": {"depth": 2}},
        ["6 pipeline stages", "has 3 layers", "at most 3 stages"],
    ),
    "tp_degree_does_not_divide_hidden": (
        {"world_size": 3, "batch_size": 12, "architecture": "tensor", "model": {"hidden_dim": 32}},
        ["degree 3 does not divide model.hidden_dim=32", "degrees that fit: 1, 2, 4, 8, 16, 32"],
    ),
    "tp_degree_does_not_divide_heads": (
        {
            "world_size": 3,
            "architecture": "tensor",
            "batch_size": 12,
            "model": {"kind": "transformer", "n_heads": 4, "d_model": 48},
        },
        ["does not divide model.n_heads=4"],
    ),
    "microbatches_do_not_divide_batch": (
        {
            "world_size": 2,
            "batch_size": 12,
            "architecture": {"name": "pipeline", "params": {"microbatches": 5}},
        },
        ["microbatches=5 does not divide the batch of 12", "1, 2, 3, 4, 6, 12"],
    ),
    "one_f_one_b_needs_enough_microbatches": (
        {
            "world_size": 4,
            "batch_size": 8,
            "architecture": {"name": "pipeline", "params": {"schedule": "1f1b", "microbatches": 2}},
        },
        ["1f1b", "microbatches=2 < 4 stages", "microbatches >= 4"],
    ),
    "ps_without_workers": (
        {"world_size": 2, "architecture": {"name": "ps", "params": {"servers": 2}}},
        ["leaves no worker", "servers <= 1"],
    ),
    "world_size_1": (
        {"world_size": 1},
        ["world_size", "greater than or equal to 2"],
    ),
    "steps_0": (
        {"steps": 0},
        ["steps", "greater than or equal to 1"],
    ),
    "failure_past_the_end": (
        {"steps": 10, "failures": {"kind": "single", "rank": 1, "at_step": 11}},
        ["at_step=11", "past the end", "steps=10", "1..10"],
    ),
    "rank_outside_world": (
        {"world_size": 4, "failures": {"kind": "single", "rank": 4, "at_step": 5}},
        ["rank(s) [4]", "outside the world", "0..3"],
    ),
    "negative_rank": (
        {"world_size": 4, "failures": {"kind": "single", "rank": -1, "at_step": 5}},
        ["rank(s) [-1]", "0..3"],
    ),
    "batch_not_divisible": (
        {"world_size": 4, "batch_size": 10},
        ["batch_size=10", "world_size=4", "multiple of 4", "8, 12"],
    ),
    "unknown_field": (
        {"stepz": 5},
        ["stepz", "Extra inputs are not permitted"],
    ),
    "unknown_model_field": (
        {"model": {"kind": "mlp", "widht": 3}},
        ["model.widht", "Extra inputs are not permitted"],
    ),
    "disk_ckpt_interval_0": (
        {"mechanism": {"name": "disk_ckpt", "params": {"interval": 0}}},
        ["mechanism.params.interval", "greater than or equal to 1"],
    ),
    "unknown_mechanism_param": (
        {"mechanism": {"name": "disk_ckpt", "params": {"intervall": 5}}},
        ["mechanism.params.intervall", "Extra inputs are not permitted"],
    ),
    "unknown_architecture_param": (
        {"architecture": {"name": "ddp", "params": {"buckets": 2}}},
        ["architecture.params.buckets", "Extra inputs are not permitted"],
    ),
    "single_with_two_ranks": (
        {"failures": {"kind": "single", "ranks": [1, 2], "at_step": 5}},
        ["failures.kind=single", "one rank", "use concurrent"],
    ),
    "concurrent_with_one_rank": (
        {"failures": {"kind": "concurrent", "ranks": [1], "at_step": 5}},
        ["failures.kind=concurrent", "at least 2 ranks"],
    ),
    "cascading_later_event_at_a_time": (
        {
            "failures": {
                "kind": "cascading",
                "events": [{"rank": 1, "at_step": 5}, {"rank": 2, "at_seconds": 7}],
            }
        },
        ["failures.events[1]", "needs `during`", "restoring", "not at_seconds"],
    ),
    "cascading_single_event": (
        {"failures": {"kind": "cascading", "events": [{"rank": 1, "at_step": 5}]}},
        ["failures.kind=cascading", "at least 2 events"],
    ),
    "single_triggered_by_during": (
        {"failures": {"kind": "single", "rank": 1, "during": "restoring"}},
        ["first single event needs at_step or at_seconds"],
    ),
    "unknown_phase": (
        {
            "failures": {
                "kind": "cascading",
                "events": [{"rank": 1, "at_step": 5}, {"rank": 2, "during": "lunch"}],
            }
        },
        ["failures.events.1", "during='lunch'", "valid:", "quiescing", "restoring"],
    ),
    "checkpoint_write_without_at_step": (
        {"failures": {"kind": "single", "rank": 0, "during": "checkpoint_write"}},
        ["failures.events.0", "checkpoint_write needs at_step"],
    ),
    "two_triggers": (
        {"failures": {"kind": "single", "rank": 0, "at_step": 5, "at_seconds": 1.0}},
        ["exactly one of at_step, at_seconds, during"],
    ),
    "no_trigger": (
        {"failures": {"kind": "single", "rank": 0}},
        ["exactly one of at_step, at_seconds, during"],
    ),
    "events_with_kind_none": (
        {"failures": {"rank": 0, "at_step": 3}},
        ["failures.kind=none takes no events"],
    ),
    "heads_do_not_divide": (
        {"model": {"kind": "transformer", "d_model": 10, "n_heads": 4}},
        ["n_heads=4", "d_model=10"],
    ),
    "bad_quiesce": (
        {"quiesce": "pray"},
        ["quiesce", "abort", "kill_survivors", "wait_timeout"],
    ),
    "not_a_mapping": (
        ["world_size", 4],
        ["expected a mapping"],
    ),
}


@pytest.mark.parametrize("name", list(BAD_SPECS))
def test_bad_spec_is_refused_with_one_line(name: str) -> None:
    data, phrases = BAD_SPECS[name]
    with pytest.raises(SpecError) as info:
        check(data)
    message = str(info.value)
    assert "\n" not in message, message
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in {message!r}"


def test_batch_size_suggestion_when_batch_is_smaller_than_world() -> None:
    with pytest.raises(SpecError) as info:
        check({"world_size": 8, "batch_size": 4})
    message = str(info.value)
    assert "multiple of 8" in message
    assert "e.g. 8, 16" in message


def test_concurrent_with_a_repeated_rank_is_refused() -> None:
    """`ranks: [1, 1]` kills one rank, not two: it is not a concurrent failure.

    The trace check counts list entries (`len(ranks) < 2`), so this spec is accepted and labelled
    concurrent, and the chaos actor signals rank 1's process twice.
    """
    with pytest.raises(SpecError):
        check({"failures": {"kind": "concurrent", "ranks": [1, 1], "at_step": 5}})


# ---------------------------------------------------------------------------------------------
# A mechanism that recovers from a surviving rank


class _NeedsSurvivor(Mechanism):
    name = "_test_needs_survivor"
    summary = "test only: recovers from a surviving replica"
    needs_survivor = True

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        return RecoveryPlan(tuple(sorted(failure.dead)), "scratch", 0)


@pytest.fixture(scope="module")
def needs_survivor() -> Iterator[str]:
    name = _NeedsSurvivor.name
    MECHANISMS.add(name, _NeedsSurvivor)
    try:
        yield name
    finally:
        MECHANISMS._items.pop(name)


def test_needs_survivor_refuses_a_trace_that_kills_every_rank(needs_survivor: str) -> None:
    spec = parse_spec(
        {
            "world_size": 2,
            "mechanism": needs_survivor,
            "failures": {"kind": "concurrent", "ranks": [0, 1], "at_step": 5},
        }
    )
    with pytest.raises(NotApplicableError) as info:
        resolve(spec)
    message = str(info.value)
    assert "\n" not in message
    assert needs_survivor in message
    assert "kills every rank" in message
    assert "step=5" in message
    assert "kill at most 1 ranks at once" in message


def test_needs_survivor_accepts_a_trace_that_leaves_a_survivor(needs_survivor: str) -> None:
    resolved = check(
        {
            "world_size": 3,
            "batch_size": 63,
            "mechanism": needs_survivor,
            "failures": {"kind": "concurrent", "ranks": [0, 2], "at_step": 5},
        }
    )
    assert isinstance(resolved.mech, _NeedsSurvivor)


def test_a_mechanism_without_needs_survivor_accepts_killing_every_rank() -> None:
    resolved = check(
        {"world_size": 2, "failures": {"kind": "concurrent", "ranks": [0, 1], "at_step": 5}}
    )
    assert isinstance(resolved.mech, NoFT)


# ---------------------------------------------------------------------------------------------
# Files

SPEC_DATA: dict[str, Any] = {
    "name": "file",
    "world_size": 8,
    "steps": 40,
    "mechanism": {"name": "disk_ckpt", "params": {"interval": 10}},
    "failures": {"kind": "single", "rank": 3, "at_step": 25, "kill": "exit"},
    "model": {"kind": "mlp", "hidden_dim": 32, "depth": 2},
}


def test_yaml_and_json_files_load_the_same_spec(tmp_path: Path) -> None:
    y = tmp_path / "spec.yaml"
    y.write_text(yaml.safe_dump(SPEC_DATA))
    yml = tmp_path / "spec.yml"
    yml.write_text(yaml.safe_dump(SPEC_DATA))
    j = tmp_path / "spec.json"
    j.write_text(json.dumps(SPEC_DATA))
    expected = parse_spec(SPEC_DATA)
    for path in (y, yml, str(j)):
        spec = load_spec(path)
        assert isinstance(spec, ExperimentSpec)
        assert spec == expected
    assert expected.failures.events == [FailureEvent(ranks=[3], at_step=25, kill="exit")]


def test_readme_quickstart_yaml_loads(tmp_path: Path) -> None:
    path = tmp_path / "quickstart.yaml"
    path.write_text(
        "architecture: ddp\n"
        "world_size: 8\n"
        "model: {kind: mlp, hidden_dim: 256, depth: 4}\n"
        "optimizer: {name: sgd, lr: 0.05, momentum: 0.9}\n"
        "steps: 60\n"
        "batch_size: 64\n"
        "mechanism: {name: disk_ckpt, params: {interval: 10}}\n"
        "failures: {kind: single, rank: 3, at_step: 25, kill: sigkill}\n"
        "quiesce: abort\n"
    )
    resolved = resolve(load_spec(path))
    assert resolved.spec.world_size == 8
    assert resolved.spec.failures.events[0].ranks == [3]


def test_bad_field_in_a_file_is_a_spec_error(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("world_size: 1\n")
    with pytest.raises(SpecError, match="world_size"):
        load_spec(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "nope.yaml")
    message = str(info.value)
    assert message.startswith("cannot read spec")
    assert "nope.yaml" in message
    assert "No such file or directory" in message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path)


def test_unparsable_yaml(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("world_size: [1, 2\nsteps: 3\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert message.startswith("cannot parse spec")
    assert "\n" not in message


def test_unparsable_json(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text('{"world_size": 4,}')
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith("cannot parse spec")


@pytest.mark.parametrize("text", ["", "- 1\n- 2\n", "just a string\n"])
def test_yaml_that_is_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(path)


def test_file_that_is_not_utf8_is_a_spec_error(tmp_path: Path) -> None:
    """A binary file (a wrong path, a zip) is bad input like any other: SpecError.

    `load_spec` catches only OSError around `read_text()`, so a UnicodeDecodeError (a
    ValueError) escapes and the CLI prints a traceback instead of one `error:` line.
    """
    path = tmp_path / "spec.yaml"
    path.write_bytes(b"\xff\xfe\x00\x81binary")
    with pytest.raises(SpecError):
        load_spec(path)
