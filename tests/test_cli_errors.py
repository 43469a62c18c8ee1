"""The `failbench` command on bad input: exit code 2, one `error:` line on stderr, no traceback,
nothing started. Each case runs the real command in a subprocess (no Ray is ever started: every
case is refused before the runtime connects).

A subprocess costs ~2 s of CPU (torch and Ray imports), so the spec cases are one per kind of
check (tests/test_spec.py has every refusal, in process), and the refused `run`s are run two
at a time in one module fixture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.test_spec import BAD_SPECS

REPO = Path(__file__).resolve().parents[1]

# One bad spec per kind of check.
CLI_SPEC_CASES = [
    "unknown_architecture",  # a registry lookup in resolve (short message)
    "failure_past_the_end",  # a spec validator, through parse_spec
    "batch_not_divisible",  # the architecture's check, in resolve (long message)
]  # + json_unknown_field below: a JSON file, a field refused by extra="forbid"


FILE_CASES: dict[str, bytes | None] = {
    "missing_file": None,
    "unparsable_yaml": b"steps: [1, 2\nworld_size: 3\n",
    # not UTF-8: bad input like any other, but today a UnicodeDecodeError escapes load_spec
    # (a ValueError, not the OSError it catches): exit 1 and a traceback
    "binary_file": b"\xff\xfe\x00\x81binary",
}


@dataclass(frozen=True)
class Result:
    rc: int
    stdout: str
    stderr: str
    seconds: float


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # A real user's stderr: no forced width, no database or cluster from the environment.
    for var in ("COLUMNS", "LINES", "FAILBENCH_DB_URL", "RAY_ADDRESS"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def failbench(args: Sequence[str], cwd: Path, timeout: float = 120) -> Result:
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "failbench_ray.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return Result(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)


def _write_spec(directory: Path, name: str) -> Path:
    data, _ = BAD_SPECS[name]
    directory.mkdir(parents=True)
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def spec_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Result]]:
    """`failbench run FILE` for each refused file, each in its own directory."""
    root = tmp_path_factory.mktemp("cli_specs")
    jobs: dict[str, tuple[Path, list[str]]] = {}
    for name in CLI_SPEC_CASES:
        cwd = root / name
        _write_spec(cwd, name)
        jobs[name] = (cwd, ["run", "spec.yaml"])
    # a JSON file (here with an unknown field)
    cwd = root / "json_unknown_field"
    cwd.mkdir()
    (cwd / "spec.json").write_text(json.dumps(BAD_SPECS["unknown_field"][0]))
    jobs["json_unknown_field"] = (cwd, ["run", "spec.json"])
    # files that are no spec at all
    for name, content in FILE_CASES.items():
        cwd = root / name
        cwd.mkdir()
        if content is not None:
            (cwd / "spec.yaml").write_bytes(content)
        jobs[name] = (cwd, ["run", "spec.yaml"])

    with ThreadPoolExecutor(max_workers=2) as pool:  # more only fight over the CPUs
        futures = {n: pool.submit(failbench, args, cwd) for n, (cwd, args) in jobs.items()}
        return {n: (jobs[n][0], f.result()) for n, f in futures.items()}


def _one_line(text: str) -> str:
    """stderr with any wrapping undone, to look for phrases."""
    return " ".join(text.split())


def _assert_refused(r: Result) -> None:
    assert r.rc == 2, r
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: "), r.stderr
    assert r.stdout == ""


SPEC_CASE_IDS = [*CLI_SPEC_CASES, "json_unknown_field"]


def _phrases(case: str) -> list[str]:
    return BAD_SPECS["unknown_field" if case == "json_unknown_field" else case][1]


@pytest.mark.parametrize("case", SPEC_CASE_IDS)
def test_bad_spec_exits_2_with_an_error_and_starts_nothing(
    spec_runs: dict[str, tuple[Path, Result]], case: str
) -> None:
    cwd, r = spec_runs[case]
    _assert_refused(r)
    message = _one_line(r.stderr)
    for phrase in _phrases(case):
        assert phrase in message, f"{phrase!r} not in {message!r}"
    # refused before anything starts: no database file, no run directory
    assert sorted(p.name for p in cwd.iterdir()) in (["spec.yaml"], ["spec.json"])


@pytest.mark.parametrize("case", SPEC_CASE_IDS)
def test_bad_spec_error_is_exactly_one_line(
    spec_runs: dict[str, tuple[Path, Result]], case: str
) -> None:
    """One line whatever its length: the error is for grep and for CI logs.

    The CLI prints it through a rich Console, which wraps at the terminal width (80 columns
    when stderr is not a terminal), so a long message comes out on several lines.
    """
    _, r = spec_runs[case]
    lines = r.stderr.splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr: {r.stderr!r}"


FILE_MESSAGES = {
    "missing_file": "error: cannot read spec spec.yaml: No such file or directory",
    "unparsable_yaml": "error: cannot parse spec spec.yaml:",
    "binary_file": "error: ",
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_bad_spec_file(spec_runs: dict[str, tuple[Path, Result]], case: str) -> None:
    cwd, r = spec_runs[case]
    _assert_refused(r)
    assert r.stderr.startswith(FILE_MESSAGES[case]), r.stderr
    assert [p.name for p in cwd.iterdir()] == ([] if case == "missing_file" else ["spec.yaml"])
    assert len(r.stderr.splitlines()) == 1, r.stderr


def test_show_unknown_experiment(tmp_path: Path) -> None:
    r = failbench(["show", "no-such-id", "--db", f"sqlite:///{tmp_path}/x.db"], tmp_path)
    _assert_refused(r)
    assert r.stderr.splitlines() == ["error: no experiment with id no-such-id in this database"]


def test_run_with_an_unreachable_database_does_not_start_ray(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"world_size": 2, "steps": 3, "batch_size": 8}))
    r = failbench(["run", "spec.yaml", "--db", "postgresql://postgres@127.0.0.1:1/test"], tmp_path)
    _assert_refused(r)
    message = _one_line(r.stderr)
    assert "cannot connect to postgresql+psycopg://postgres@127.0.0.1:1/test" in message
    assert "connection refused" in message.lower()
    assert "--db" in message
    # refused before the runtime connects: a local Ray cluster takes seconds to start and
    # logs to stderr; this returns in the time of the imports, with the error line alone
    assert r.seconds < 10, r.seconds
    assert message.count("error:") == 1
    assert "ray" not in message.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_list_json(tmp_path: Path) -> None:
    r = failbench(["list", "--json"], tmp_path)
    assert r.rc == 0, r
    assert r.stderr == ""
    data = json.loads(r.stdout)
    names = {section: {item["name"] for item in items} for section, items in data.items()}
    assert {"ddp"} <= names["architectures"]
    assert {"none", "disk_ckpt"} <= names["mechanisms"]
    assert {"single", "concurrent", "cascading"} <= names["traces"]
    assert {"sigkill", "ray_kill", "exit"} <= names["kill_kinds"]
    disk = next(m for m in data["mechanisms"] if m["name"] == "disk_ckpt")
    assert disk["params"]["interval"]["default"] == 10


def test_unknown_command_is_a_usage_error(tmp_path: Path) -> None:
    r = failbench(["frobnicate"], tmp_path)
    assert r.rc == 2
    assert "Traceback" not in r.stderr
    assert "invalid choice" in r.stderr
