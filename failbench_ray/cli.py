"""The `failbench` command: run, show, list.

Bad input exits with code 2 and one line on stderr, before any actor starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="failbench", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    db_help = "SQLAlchemy URL (default: $FAILBENCH_DB_URL or sqlite:///failbench.db)"

    run = sub.add_parser("run", help="run an experiment spec (trials + matched baseline)")
    run.add_argument("spec", type=Path, help="experiment spec, YAML or JSON")
    run.add_argument("--db", help=db_help)
    run.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    run.add_argument("--out", type=Path, default=Path("runs"), help="directory for run files")
    run.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    run.add_argument("--keep-checkpoints", action="store_true", help="keep checkpoint files")
    run.add_argument("-v", "--verbose", action="store_true", help="show the workers' logs")

    show = sub.add_parser("show", help="show a stored experiment's result")
    show.add_argument("experiment_id")
    show.add_argument("--db", help=db_help)
    show.add_argument("--json", action="store_true", help="print the result JSON")

    ls = sub.add_parser("list", help="list architectures, mechanisms, traces and kill kinds")
    ls.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "ray_address", None):
        os.environ["RAY_ADDRESS"] = args.ray_address  # before Ray is imported (see __init__)
    from failbench_ray.errors import SpecError
    from failbench_ray.storage.db import DatabaseError
    from failbench_ray.storage.repo import ExperimentNotFound

    try:
        if args.command == "run":
            return _run(args)
        if args.command == "show":
            return _show(args)
        return _list(args)
    except (SpecError, DatabaseError, ExperimentNotFound) as e:
        print(f"error: {e}", file=sys.stderr)  # one line, never wrapped
        return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    from failbench_ray import runtime
    from failbench_ray.checks import resolve
    from failbench_ray.runner import baseline_spec, run_experiment
    from failbench_ray.spec import load_spec
    from failbench_ray.storage.db import Database

    spec = load_spec(args.spec)
    resolve(spec)
    resolve(baseline_spec(spec))
    db = Database(args.db)
    started = runtime.connect(args.ray_address, log_to_driver=args.verbose)
    created: list[str] = []
    # Ray prints its own messages (e.g. "(raylet) A worker died ...", which every kill causes)
    # to sys.stdout; stdout is for the result, so they go to stderr while the run lasts.
    result_out, sys.stdout = sys.stdout, sys.stderr
    try:
        with _progress() as progress:
            result = run_experiment(
                spec, db=db, out_dir=args.out, progress=progress, on_created=created.append
            )
    except KeyboardInterrupt:
        which = f"experiment {created[0]}" if created else "the experiment"
        err.print(f"interrupted: every actor stopped; {which} is marked interrupted")
        return EXIT_INTERRUPTED
    finally:
        if started:
            import ray

            ray.shutdown()
        db.dispose()
        sys.stdout = result_out
    return _report(result.model_dump(mode="json"), args.json)


def _show(args: argparse.Namespace) -> int:
    from failbench_ray.storage import repo
    from failbench_ray.storage.db import Database

    db = Database(args.db)
    try:
        with db.session() as s:
            result = repo.load_result(s, args.experiment_id)
    finally:
        db.dispose()
    return _report(result.model_dump(mode="json"), args.json)


def _report(result: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print_tables(result)
    code = EXIT_OK
    for t in result["trials"]:
        if t["matches_baseline"] is False:
            err.print(
                f"[bold red]MISMATCH[/]: trial {t['trial']} ended with parameters that differ from "
                "the baseline's, where an exact match is expected"
            )
            code = EXIT_FAILED
        if t["status"] != "completed" or t.get("error"):
            err.print(f"[bold red]trial {t['trial']} {t['status']}[/]: {t.get('error') or ''}")
            code = EXIT_FAILED
    if result["status"] != "completed":
        code = EXIT_FAILED
    return code


def _fmt(v: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _print_tables(r: dict[str, Any]) -> None:
    spec = r["spec"]
    out.print(
        f"experiment [bold]{r['experiment_id']}[/]  {r['status']}  "
        f"{spec['architecture']['name']} x {spec['mechanism']['name']} x "
        f"{spec['failures']['kind']}  world={spec['world_size']} steps={spec['steps']}"
    )
    t = Table(title="trials")
    for col in ("run", "status", "step ms (median)", "overhead %", "final loss", "digest", "match"):
        t.add_column(col)
    b = r["baseline"]
    if b:
        t.add_row(
            "baseline", b["status"], _fmt(b["step_time_s"], 1e3), "-", _fmt(b["final_loss"], 1, 4),
            (b["params_digest"] or "-")[:12], "-",
        )  # fmt: skip
    for tr in r["trials"]:
        match = {True: "[green]yes[/]", False: "[bold red]NO[/]", None: "n/a"}[
            tr["matches_baseline"]
        ]
        t.add_row(
            f"trial {tr['trial']}", tr["status"], _fmt(tr["step_time_s"], 1e3),
            _fmt(tr["overhead_pct"], 1, 1), _fmt(tr["final_loss"], 1, 4),
            (tr["params_digest"] or "-")[:12], match,
        )  # fmt: skip
    out.print(t)
    failures = [(tr["trial"], f) for tr in r["trials"] for f in tr["failures"]]
    if not failures:
        return
    ft = Table(title="recovery phases, seconds after the kill")
    ft.add_column("failure")
    for col in _PHASE_COLUMNS:
        ft.add_column(col.replace("_", " "), justify="right")
    for n, (trial, f) in enumerate(failures):
        ranks = ",".join(map(str, f["ranks"]))
        out.print(
            f"failure #{n} (trial {trial}): rank {ranks} {f['kill_kind']} at {f['trigger']}, "
            f"restored from step {f['restored_from_step']} ({f['lost_steps']} steps lost), "
            f"quiesce {f['quiesce']}"
            + (
                f", interrupted by #{f['interrupted_by']}"
                if f.get("interrupted_by") is not None
                else ""
            )
        )
        ft.add_row(f"#{n}", *(_fmt(f["phases"][f"{p}_s"], 1, 3) for p in _PHASE_COLUMNS))
    out.print(ft)


_PHASE_COLUMNS = ("detected", "quiesced", "reformed", "restored", "resumed", "caught_up")


def _list(args: argparse.Namespace) -> int:
    from failbench_ray.catalog import catalog

    data = catalog()
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    for section in ("architectures", "mechanisms", "traces", "kill_kinds"):
        t = Table(title=section.replace("_", " "))
        t.add_column("name")
        t.add_column("what")
        t.add_column("parameters")
        for item in data[section]:
            params = ", ".join(f"{k}={v.get('default')}" for k, v in item.get("params", {}).items())
            t.add_row(item["name"], item["summary"], params or "-")
        out.print(t)
    return EXIT_OK


class _progress:
    """A progress bar per trial on stderr."""

    def __enter__(self) -> _progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._p = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=err
        )
        self._p.start()
        self._tasks: dict[str, Any] = {}
        return self

    def __call__(self, label: str, step: int, total: int) -> None:
        if label not in self._tasks:
            self._tasks[label] = self._p.add_task(label, total=total)
        self._p.update(self._tasks[label], completed=step)

    def __exit__(self, *exc: object) -> None:
        self._p.stop()


if __name__ == "__main__":
    sys.exit(main())
