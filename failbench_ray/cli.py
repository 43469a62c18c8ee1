"""The `failbench` command: run, sweep, show, list, serve, dispatch.

Bad input exits with code 2 and one line on stderr, before any actor starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


_FRESH_HELP = (
    "start new worker processes for every trial instead of reusing started ones "
    "(a replacement for a dead rank is a new process either way)"
)
_DB_HELP = "SQLAlchemy URL (default: $FAILBENCH_DB_URL or sqlite:///failbench.db)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="failbench", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_sweep(sub)
    _add_show(sub)
    _add_serve(sub)
    _add_dispatch(sub)
    _add_report(sub)
    _add_recommend(sub)
    _add_search(sub)
    _add_validate(sub)
    _add_list(sub)
    return p


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser("run", help="run an experiment spec (trials + matched baseline)")
    run.add_argument("spec", type=Path, help="experiment spec, YAML or JSON")
    run.add_argument("--db", help=_DB_HELP)
    run.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    run.add_argument("--out", type=Path, default=Path("runs"), help="directory for run files")
    run.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    run.add_argument("--keep-checkpoints", action="store_true", help="keep checkpoint files")
    run.add_argument("-v", "--verbose", action="store_true", help="show the workers' logs")
    run.add_argument("--fresh-workers", action="store_true", help=_FRESH_HELP)
    run.add_argument(
        "--db-retry-s",
        type=float,
        default=30.0,
        help="how long the run's writes retry while the database is unreachable (30)",
    )


def _add_search(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    search = sub.add_parser(
        "search",
        help="a second failure in every window of a run (each recovery phase, a checkpoint "
        "write, a replica transfer, a regrow, random steps): where recovery breaks",
    )
    search.add_argument("spec", type=Path, help="spec with one failure at a step, YAML or JSON")
    search.add_argument("--db", help=_DB_HELP)
    search.add_argument(
        "--out", type=Path, default=Path("search"), help="where the reproducing specs go"
    )
    search.add_argument("--random", type=int, default=3, help="seeded random windows (3)")
    search.add_argument("--seed", type=int, default=0, help="seed of the random windows (0)")
    search.add_argument("--kill", default="sigkill", help="kill kind of the second failure")
    search.add_argument("--time-limit-s", type=float, help="start no trial after this long")
    search.add_argument("--no-shrink", action="store_true", help="write findings unshrunk")
    search.add_argument(
        "--only", default="", help="just the windows whose name contains one of these (a,b)"
    )
    search.add_argument("--json", action="store_true", help="print the report JSON on stdout")
    search.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")


def _add_validate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    val = sub.add_parser(
        "validate",
        help="measured ETTR under Poisson failures against what the model and the simulator "
        "predict from costs fitted on separate calibration runs",
    )
    val.add_argument("spec", type=Path, help="the job: an experiment spec, YAML or JSON")
    val.add_argument("--mtbf-s", type=float, required=True, help="mean seconds between failures")
    val.add_argument(
        "--duration-s", type=float, required=True, help="seconds of failure-free work per mechanism"
    )
    val.add_argument("--mechanisms", default="", help="a,b (default: every one that applies)")
    val.add_argument("--seed", type=int, default=0, help="seed of the failure draws (0)")
    val.add_argument(
        "--mix", default="sigkill=1", help="kill kinds and their weights (sigkill=0.8,hang=0.2)"
    )
    val.add_argument(
        "--calibration-steps", type=int, default=40, help="steps of each calibration run (40)"
    )
    val.add_argument(
        "--calibration-s",
        type=float,
        default=12.0,
        help="the steady and the failing calibration runs train at least this long, s (12)",
    )
    val.add_argument(
        "--calibration-failures",
        type=int,
        default=2,
        help="kills in the failing calibration run; the costs per failure are their mean (2)",
    )
    val.add_argument("--sim-runs", type=int, default=200, help="seeded simulator runs (200)")
    val.add_argument(
        "--runs",
        type=int,
        default=1,
        help="validation runs per mechanism, each its own failure draw (seeds --seed, +1, ...): "
        "their mean is held against the Poisson predictions, with its 95%% interval (1)",
    )
    val.add_argument("--db", help=_DB_HELP)
    val.add_argument(
        "--out", type=Path, default=Path("validate"), help="validation.md, .png, .json go here"
    )
    val.add_argument("--json", action="store_true", help="print the report JSON on stdout")
    val.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")


def _add_sweep(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sweep = sub.add_parser("sweep", help="run a grid of experiments; run it again to resume")
    sweep.add_argument("sweep", type=Path, help="sweep file (name, base, grid), YAML or JSON")
    sweep.add_argument("--db", help=_DB_HELP)
    sweep.add_argument("--out", type=Path, default=Path("runs"), help="directory for run files")
    sweep.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    sweep.add_argument("--json", action="store_true", help="print the cells as JSON on stdout")
    sweep.add_argument(
        "--dry-run", action="store_true", help="print the expanded grid and run nothing"
    )
    sweep.add_argument(
        "--retry-failed", action="store_true", help="run the cells that failed again"
    )
    sweep.add_argument("--fresh-workers", action="store_true", help=_FRESH_HELP)
    sweep.add_argument(
        "--resource-log",
        type=Path,
        help="append a JSON line after each cell: the driver's and every idle pooled "
        "worker's memory, threads and open files, and any actor still alive (a leak check)",
    )


def _add_show(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    show = sub.add_parser("show", help="show a stored experiment's result")
    show.add_argument("experiment_id", help="the id, or its first characters")
    show.add_argument("--db", help=_DB_HELP)
    show.add_argument("--json", action="store_true", help="print the result JSON")


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="the REST API and N dispatchers running its queue")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--db", help=_DB_HELP)
    serve.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    serve.add_argument("--dispatchers", type=int, default=1, help="experiments run at once")
    serve.add_argument("--out", type=Path, default=Path("runs"), help="directory for run files")
    serve.add_argument(
        "--prometheus-sd",
        type=Path,
        help="keep this file listing the Ray nodes' metrics endpoints (Prometheus file_sd)",
    )
    serve.add_argument("--lease-s", type=float, default=30.0, help="queue lease, seconds")
    serve.add_argument("--max-attempts", type=int, default=3, help="runs before giving up")
    serve.add_argument(
        "--dashboard",
        action="store_true",
        help="the local Ray cluster runs Ray's dashboard on loopback (token auth stays on)",
    )
    serve.add_argument("--dashboard-port", type=int, default=8265, help="Ray dashboard's port")
    serve.add_argument("--fresh-workers", action="store_true", help=_FRESH_HELP)


def _add_dispatch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    disp = sub.add_parser("dispatch", help="dispatchers only: run what the queue holds")
    disp.add_argument("--db", help=_DB_HELP)
    disp.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    disp.add_argument("-n", "--dispatchers", type=int, default=1, help="experiments run at once")
    disp.add_argument("--out", type=Path, default=Path("runs"), help="directory for run files")
    disp.add_argument(
        "--prometheus-sd",
        type=Path,
        help="keep this file listing the Ray nodes' metrics endpoints (Prometheus file_sd)",
    )
    disp.add_argument("--lease-s", type=float, default=30.0, help="queue lease, seconds")
    disp.add_argument("--max-attempts", type=int, default=3, help="runs before giving up")
    disp.add_argument("--fresh-workers", action="store_true", help=_FRESH_HELP)


def _add_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rep = sub.add_parser("report", help="a sweep's results as report.md, report.html and PNGs")
    rep.add_argument("--db", help=_DB_HELP)
    rep.add_argument("--sweep", help="the sweep's id (default: the newest sweep)")
    rep.add_argument("--out", type=Path, required=True, help="directory to write into")


def _add_recommend(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rec = sub.add_parser(
        "recommend", help="rank the mechanisms for a job by expected useful / wall time"
    )
    rec.add_argument("--architecture", required=True, help="e.g. ddp, fsdp (`failbench list`)")
    rec.add_argument("--state-gb", type=float, required=True, help="model + optimizer state, GB")
    rec.add_argument("--world", type=int, required=True, help="workers (ranks)")
    rates = rec.add_mutually_exclusive_group(required=True)
    rates.add_argument("--mtbf-hours", type=float, help="one worker's mean time between failures")
    rates.add_argument(
        "--preset", help="published failure statistics: llama3, kokolis (by job size), ..."
    )
    rec.add_argument(
        "--repair-hours",
        type=float,
        default=4.0,
        help="hours until a failed machine is back; sizes the spares (default 4)",
    )
    rec.add_argument("--step-s", type=float, default=1.0, help="time of one training step, s")
    rec.add_argument("--job-days", type=float, default=30.0, help="failure-free job length")
    rec.add_argument(
        "--correlated",
        type=float,
        default=0.01,
        help="share of failures that also take the copies on other nodes (0..1)",
    )
    rec.add_argument("--db", help=_DB_HELP + "; measured costs are read from it when present")
    rec.add_argument("--json", action="store_true")


def _add_list(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ls = sub.add_parser("list", help="list architectures, mechanisms, traces and kill kinds")
    ls.add_argument("--json", action="store_true")
    ls.add_argument(
        "--matrix", action="store_true", help="which mechanism applies to which architecture"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "ray_address", None):
        os.environ["RAY_ADDRESS"] = args.ray_address  # before Ray is imported (see __init__)
    from failbench_ray.errors import FailBenchError

    try:
        if args.command == "run":
            return _run(args)
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "show":
            return _show(args)
        if args.command in ("serve", "dispatch"):
            return _service(args)
        if args.command == "recommend":
            return _recommend(args)
        if args.command == "validate":
            return _validate(args)
        if args.command == "report":
            return _write_report(args)
        if args.command == "search":
            return _search(args)
        return _list(args)
    except FailBenchError as e:  # one tree: each error knows its exit code
        print(f"error: {e}", file=sys.stderr)  # one line, never wrapped
        return e.exit_code


def _service(args: argparse.Namespace) -> int:
    import logging

    from service import serve as service

    if args.dispatchers < 0 or (args.command == "dispatch" and args.dispatchers < 1):
        raise _usage(f"--dispatchers {args.dispatchers}: give a number of at least 1")
    if args.lease_s <= 0 or args.max_attempts < 1:
        raise _usage("--lease-s must be > 0 and --max-attempts >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = service.Dispatching(
        db_url=args.db,
        ray_address=args.ray_address,
        n=args.dispatchers,
        out_dir=args.out,
        lease_s=args.lease_s,
        max_attempts=args.max_attempts,
        dashboard=getattr(args, "dashboard", False),
        dashboard_port=getattr(args, "dashboard_port", 8265),
        prometheus_sd=args.prometheus_sd,
        reuse_workers=not args.fresh_workers,
    )
    if args.command == "serve":
        return service.serve(host=args.host, port=args.port, cfg=cfg)
    return service.dispatch(cfg)


def _usage(message: str) -> Exception:
    from failbench_ray.errors import UsageError

    return UsageError(message)


def _run(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import OperationalError

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
                spec,
                db=db,
                out_dir=args.out,
                progress=progress,
                on_created=created.append,
                reuse_workers=not args.fresh_workers,
                db_retry_s=args.db_retry_s,
            )
    except KeyboardInterrupt:
        which = f"experiment {created[0]}" if created else "the experiment"
        err.print(f"interrupted: every actor stopped; {which} is marked interrupted")
        return EXIT_INTERRUPTED
    except OperationalError:
        raise _database_lost(db, created, args.db_retry_s) from None
    finally:
        if started:
            import ray

            ray.shutdown()
        db.dispose()
        sys.stdout = result_out
    return _report(result.model_dump(mode="json"), args.json)


_LOST_DB_WAIT_S = 300.0


@contextlib.contextmanager
def _ray_session(args: argparse.Namespace) -> Iterator[Any]:
    """The database and a Ray cluster (joined, or started and ended here) for a command that
    runs many experiments; Ray's messages go to stderr meanwhile, not into the report."""
    from failbench_ray import runtime
    from failbench_ray.storage.db import Database

    db = Database(args.db)
    started = runtime.connect(args.ray_address)
    result_out, sys.stdout = sys.stdout, sys.stderr
    try:
        yield db
    finally:
        if started:
            import ray

            ray.shutdown()
        db.dispose()
        sys.stdout = result_out


def _validate(args: argparse.Namespace) -> int:
    from failbench_ray import validate, validate_report
    from failbench_ray.runner import run_experiment
    from failbench_ray.spec import load_spec, parse_spec

    if args.calibration_steps < 10:
        raise _usage(f"--calibration-steps {args.calibration_steps}: give 10 or more")
    if not args.calibration_s > 0:
        raise _usage(f"--calibration-s {args.calibration_s:g}: give a positive number of seconds")
    if args.sim_runs < 1:
        raise _usage(f"--sim-runs {args.sim_runs}: give 1 or more")
    spec = load_spec(args.spec)
    opts = validate.ValidateOptions(
        mtbf_s=args.mtbf_s,
        duration_s=args.duration_s,
        mechanisms=tuple(m.strip() for m in args.mechanisms.split(",") if m.strip()),
        seed=args.seed,
        mix=validate.parse_mix(args.mix),
        calibration_steps=args.calibration_steps,
        calibration_s=args.calibration_s,
        calibration_failures=args.calibration_failures,
        sim_runs=args.sim_runs,
        runs=args.runs,
    )
    validate.check_options(spec, opts)  # bad input: one line, before anything starts
    with _ray_session(args) as db:
        report = validate.run_validate(
            spec,
            opts,
            run=lambda data: run_experiment(parse_spec(data), db=db, out_dir=args.out / "runs"),
            say=lambda line: err.print(line, markup=False),
        )
    args.out.mkdir(parents=True, exist_ok=True)
    data = report.as_dict()
    (args.out / "validation.json").write_text(json.dumps(data, indent=2))
    png = validate_report.figure(report, args.out / "validation.png") if report.mechanisms else None
    md = validate_report.markdown_report(report, png)
    (args.out / "validation.md").write_text("\n".join(md))
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        out.print("\n".join(md), markup=False)
    failed = [m for m in report.mechanisms if m.measured_ettr is None]
    return EXIT_FAILED if failed else EXIT_OK


def _search(args: argparse.Namespace) -> int:
    from failbench_ray.search import SearchOptions, run_search
    from failbench_ray.spec import load_spec
    from injector.kill_kinds import KILL_KINDS

    if args.random < 0:
        raise _usage(f"--random {args.random}: give 0 or more random windows")
    if args.time_limit_s is not None and args.time_limit_s <= 0:
        raise _usage(f"--time-limit-s {args.time_limit_s:g}: give a positive number of seconds")
    KILL_KINDS.get(args.kill)  # an unknown kind: one line naming the valid ones
    spec = load_spec(args.spec)
    with _ray_session(args) as db:
        report = run_search(
            spec,
            db=db,
            out_dir=args.out,
            options=SearchOptions(
                random_points=args.random,
                seed=args.seed,
                kill=args.kill,
                time_limit_s=args.time_limit_s,
                shrink=not args.no_shrink,
                only=tuple(part for part in args.only.split(",") if part),
            ),
            say=lambda line: err.print(line, markup=False),
        )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return EXIT_FAILED if report.findings() else EXIT_OK
    t = Table(title=f"failbench search: {report.architecture} / {report.mechanism}")
    for col in ("window", "verdict", "detail", "smallest spec"):
        t.add_column(col)
    for o in report.outcomes:
        t.add_row(o.window, o.verdict, o.detail, o.repro or "-")
    out.print(t)
    if report.stopped_early:
        out.print(f"stopped early: {report.stopped_early}")
    out.print(f"{len(report.findings())} finding(s) in {len(report.outcomes)} window(s)")
    return EXIT_FAILED if report.findings() else EXIT_OK


def _database_lost(db: Any, created: list[str], retry_s: float) -> Exception:
    """The database stayed down past the run's retries: the run is over. Its row would say
    `running` for ever: wait a while longer for the database to mark it failed."""
    from failbench_ray.errors import DatabaseError
    from failbench_ray.runner import mark_database_lost

    where = db.display_url
    if not created:
        return DatabaseError(f"{where} became unreachable before the run was stored")
    exp_id = created[0]
    err.print(
        f"the database at {where} stayed unreachable for more than {retry_s:g} s: the run "
        f"stopped. Waiting up to {_LOST_DB_WAIT_S:g} s more to mark experiment {exp_id} "
        "failed (Ctrl-C to give up)"
    )
    try:
        marked = mark_database_lost(db, exp_id, retry_s, _LOST_DB_WAIT_S)
    except KeyboardInterrupt:
        marked = False
    if marked:
        return DatabaseError(
            f"{where} was unreachable for more than {retry_s:g} s during the run; experiment "
            f"{exp_id} is marked failed: run the spec again (--db-retry-s waits longer)"
        )
    return DatabaseError(
        f"{where} is still unreachable; experiment {exp_id} stays 'running' there: run the "
        "spec again once it is back"
    )


def _after_cell(
    done: Callable[[Any, str], None], resource_log: Path | None
) -> Callable[[Any, str], None]:
    """`done`, then (with a resource log) one JSON line of `WorkerPool.resources()`."""
    if resource_log is None:
        return done

    def after(cell: Any, status: str) -> None:
        from failbench_ray.pool import shared_pool

        done(cell, status)
        sample = {"cell": cell.key, "status": status, **shared_pool().resources()}
        with resource_log.open("a") as f:
            f.write(json.dumps(sample) + "\n")

    return after


def _sweep(args: argparse.Namespace) -> int:
    from failbench_ray import runtime
    from failbench_ray import sweep as sw
    from failbench_ray.storage.db import Database

    sweep = sw.load_sweep(args.sweep)
    cells = sw.expand(sweep)
    if args.dry_run:
        return _print_grid(cells, args.json)
    db = Database(args.db)
    started = False
    result_out = sys.stdout
    try:
        sweep_id = sw.prepare(db, sweep, cells, retry_failed=args.retry_failed)
        if sw.pending_keys(db, sweep_id):  # else no Ray at all
            started = runtime.connect(args.ray_address)
            sys.stdout = sys.stderr  # Ray's messages go to stdout; it is for the report (see _run)
            with _SweepProgress(sweep.name, cells, db, sweep_id) as progress:
                sw.run_pending(
                    db,
                    sweep_id,
                    cells,
                    out_dir=args.out,
                    progress=progress.trial,
                    on_cell=progress.start,
                    on_done=_after_cell(progress.done, args.resource_log),
                    share_baselines=sweep.share_baselines,
                    reuse_workers=not args.fresh_workers,
                )
        else:
            sw.run_pending(db, sweep_id, cells)  # nothing to run: only the sweep's status

        report = sw.report(db, sweep_id)
        if started:  # what reusing processes did in this run (a joined cluster's is shared)
            from dataclasses import asdict

            from failbench_ray.pool import shared_pool

            report["pool"] = asdict(shared_pool().stats())
    except KeyboardInterrupt:
        err.print("interrupted: every actor stopped; the current cell is pending again")
        return EXIT_INTERRUPTED
    finally:
        if started:
            import ray

            # Ray's late messages (a pooled process ended as the cluster goes) go to stderr:
            # stdout is the report's, printed once Ray is down.
            ray.shutdown()
        sys.stdout = result_out
        db.dispose()
    return _sweep_report(report, args.json)


def _print_grid(cells: Sequence[Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps([c.as_json() for c in cells], indent=2))
        return EXIT_OK
    from rich.markup import escape

    title = f"{len(cells)} cells, {sum(not c.skipped for c in cells)} to run"
    t = Table(title=title, box=None, pad_edge=False, header_style="bold")
    t.add_column("cell", no_wrap=True)
    t.add_column("plan", no_wrap=True)
    reasons: list[str] = []
    for c in cells:
        plan = "run"
        if c.skipped:
            if c.reason not in reasons:
                reasons.append(c.reason)
            plan = escape(f"skip [{reasons.index(c.reason) + 1}]")
        t.add_row(escape(c.key), plan)
    out.print(t)
    for n, reason in enumerate(reasons, start=1):
        out.print(f"[{n}] {reason}", markup=False)
    return EXIT_OK


def _sweep_report(report: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print_sweep(report)
    mismatched = [c["key"] for c in report["cells"] if c["matches_baseline"] is False]
    if mismatched:
        err.print(
            f"[bold red]MISMATCH[/]: {', '.join(mismatched)} ended with parameters that differ "
            "from the baseline's, where an exact match is expected"
        )
    return EXIT_FAILED if report["progress"]["failed"] else EXIT_OK


def _unit(v: float | None, unit: str, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def _print_sweep(report: dict[str, Any]) -> None:
    """One row per cell; skip and failure reasons numbered under the table (fits 80 columns)."""
    from rich.markup import escape

    counts = ", ".join(f"{n} {s}" for s, n in report["progress"].items() if n)
    t = Table(
        title=f"sweep {report['name']}: {counts}",
        box=None,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
        header_style="bold",
    )
    for col in ("cell", "status", "id"):  # id: `failbench show` takes its first characters
        t.add_column(col, no_wrap=True)
    for col in ("overhead", "recovery", "match"):
        t.add_column(col, justify="right", no_wrap=True)
    reasons: list[str] = []
    for c in report["cells"]:
        status = c["status"]
        if c["reason"]:
            if c["reason"] not in reasons:
                reasons.append(c["reason"])
            status += escape(f" [{reasons.index(c['reason']) + 1}]")
        match = {True: "[green]yes[/]", False: "[bold red]NO[/]", None: "-"}[c["matches_baseline"]]
        t.add_row(
            escape(c["key"]), status, (c["experiment_id"] or "-")[:8],
            _unit(c["overhead_pct"], "%", 1), _unit(c["recovery_s"], " s", 2), match,
        )  # fmt: skip
    out.print(t)
    for n, reason in enumerate(reasons, start=1):
        out.print(f"[{n}] {reason}", markup=False)
    out.print(f"sweep {report['sweep_id']}; one cell in full: failbench show ID")


def _show(args: argparse.Namespace) -> int:
    from failbench_ray.storage import repo
    from failbench_ray.storage.db import Database

    db = Database(args.db)
    try:
        with db.session() as s:
            result = repo.load_result(s, repo.find_experiment_id(s, args.experiment_id))
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
    for tr in r["trials"]:
        for d in tr.get("silently_diverged") or []:
            out.print(
                f"[bold red]trial {tr['trial']} silently diverged[/]: {d['kind']} on rank(s) "
                f"{','.join(map(str, d['ranks']))} at step {d['step']} was never detected "
                "(its check is off, or no replica holds the same shard to compare with)"
            )
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
            f"detected by {f.get('detector') or 'death'}, "
            f"restored from step {f['restored_from_step']} ({f['lost_steps']} steps lost), "
            f"quiesce {f['quiesce']}"
            + (f" ({f['quiesce_reason']})" if f.get("quiesce_reason") else "")
            + f", replacement {f.get('replacement') or '-'}"
            + f", re-formation {spec.get('reform', 'standard')}"
            + (
                f", interrupted by #{f['interrupted_by']}"
                if f.get("interrupted_by") is not None
                else ""
            )
        )
        ft.add_row(f"#{n}", *(_fmt(f["phases"][f"{p}_s"], 1, 3) for p in _PHASE_COLUMNS))
    out.print(ft)
    _print_reform_parts(failures)


def _print_reform_parts(failures: list[tuple[int, dict[str, Any]]]) -> None:
    """Where re-formation's time went: each part's duration from the part before it (the
    first from `quiesced`, the last, building the trainers, up to `reformed`)."""
    from failbench_ray.reform_report import PART_SPANS, part_spans, startup_span
    from failbench_ray.results import FailureResult

    rt = Table(
        title="re-formation, seconds in each part (quiesced -> reformed; start-up: a new "
        "process's, inside replacement)"
    )
    rt.add_column("failure")
    for col in PART_SPANS:
        rt.add_column(col, justify="right")
    rt.add_column("start-up", justify="right")
    for n, (_, f) in enumerate(failures):
        result = FailureResult.model_validate(f)
        spans = part_spans(result)
        row = [_fmt(spans[p], 1, 3) for p in PART_SPANS]
        rt.add_row(f"#{n}", *row, _fmt(startup_span(result), 1, 3))
    out.print(rt)


_PHASE_COLUMNS = ("detected", "quiesced", "reformed", "restored", "resumed", "caught_up")


def _write_report(args: argparse.Namespace) -> int:
    from failbench_ray import report
    from failbench_ray.storage.db import Database

    db = Database(args.db)
    try:
        done = report.write(db, args.out, args.sweep)
    finally:
        db.dispose()
    out.print(
        f"wrote {args.out / 'report.md'}, report.html and {len(done['figures'])} figures: "
        f"{len(done['cells'])} cells, {len(done['skipped'])} not applicable"
    )
    for line in done["findings"]:
        out.print(f"- {line}")
    return 0


def _recommend(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from failbench_ray.recommend import Question, recommend, stored_results
    from failbench_ray.spec import _format_validation_error
    from failbench_ray.storage.db import Database

    try:
        q = Question(
            architecture=args.architecture,
            state_gb=args.state_gb,
            world=args.world,
            mtbf_hours=args.mtbf_hours,
            preset=args.preset,
            step_s=args.step_s,
            job_days=args.job_days,
            correlated=args.correlated,
            repair_hours=args.repair_hours,
        )
    except ValidationError as e:
        raise _usage(
            _format_validation_error(e).replace("invalid spec", "invalid question")
        ) from None
    db = Database(args.db)
    try:
        answer = recommend(q, stored_results(db))
    finally:
        db.dispose()
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    out.print(
        f"{q.architecture} on {q.world} workers, {answer['state_gb_per_rank']:.3g} GB of state "
        f"per rank; job MTBF {answer['job_mtbf_hours']:.3g} h "
        f"({answer['failures_expected']:.0f} failures in {q.job_days:g} days)"
    )
    if answer["preset"]:
        out.print(f"failure rate: {answer['preset']}")
    if answer["policy"]:
        out.print(_policy_line(answer["policy"]))
    for i, r in enumerate(answer["ranking"], 1):
        sim = r["simulated"]
        checked = f" (simulated {100 * sim['ettr']:.1f}%)" if sim else ""
        if sim and sim.get("cut_short"):
            checked += f" [{sim['cut_short']}/{sim['runs']} simulated runs cut short]"
        out.print(f"{i}. {r['mechanism']:<14} {r['why']}{checked}")
    for r in answer["not_applicable"]:
        out.print(f"-  {r['mechanism']:<14} not applicable: {r['reason']}")
    measured = {k: v["source"] for k, v in answer["costs"].items() if v["source"] != "default"}
    out.print(
        "costs: "
        + (
            "; ".join(f"{k} {v}" for k, v in measured.items())
            if measured
            else "defaults (no measured runs in the database; `failbench sweep` measures them)"
        )
    )
    return 0


def _policy_line(pol: dict[str, Any]) -> str:
    every, band = pol["checkpoint_interval_s"], pol["ettr_interval95"]
    return (
        f"policy: {pol['mechanism']}"
        + (f", a checkpoint every {every:.3g} s" if every else "")
        + f", {pol['spares']} spare(s), hang timeout {pol['hang_timeout_s']:.3g} s; "
        f"ETTR {100 * pol['ettr']:.1f}%"
        + (f" (one job: {100 * band[0]:.1f}-{100 * band[1]:.1f}%, 95%)" if band else "")
    )


def _list(args: argparse.Namespace) -> int:
    from failbench_ray.catalog import catalog, matrix

    if args.matrix:
        return _print_matrix(matrix(), args.json)
    data = catalog()
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    for section in ("architectures", "mechanisms", "traces", "kill_kinds", "detectors"):
        t = Table(title=section.replace("_", " "))
        t.add_column("name")
        t.add_column("what")
        t.add_column("parameters")
        kills = section == "kill_kinds"
        if kills:
            t.add_column("detected by")
        for item in data[section]:
            params = ", ".join(f"{k}={v.get('default')}" for k, v in item.get("params", {}).items())
            row = [item["name"], item["summary"], params or "-"]
            t.add_row(*row, *([item["detector"]] if kills else []))
        out.print(t)
    return EXIT_OK


def _print_matrix(rows: list[dict[str, Any]], as_json: bool) -> int:
    if as_json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    from rich.markup import escape

    archs = list(dict.fromkeys(r["architecture"] for r in rows))
    mechs = list(dict.fromkeys(r["mechanism"] for r in rows))
    cell = {(r["architecture"], r["mechanism"]): r for r in rows}
    # One number per distinct reason (an architecture often refuses several mechanisms alike).
    reasons: dict[str, list[str]] = {}
    title = "mechanisms that apply (each architecture's example, a single failure)"
    t = Table(title=title, box=None, pad_edge=False, header_style="bold")
    t.add_column("", no_wrap=True)
    for m in mechs:  # "live_recovery" on two lines: nine mechanisms fit 80 columns
        lines = m.split("_")
        t.add_column("\n".join(lines), justify="center", min_width=max(map(len, lines)))
    for a in archs:
        marks = []
        for m in mechs:
            r = cell[(a, m)]
            if r["applicable"]:
                marks.append("[green]yes[/]")
                continue
            pairs = reasons.setdefault(r["reason"], [])
            pairs.append(f"{m} on {a}")
            marks.append(escape(f"n/a\n[{list(reasons).index(r['reason']) + 1}]"))
        t.add_row(a, *marks)
    out.print(t)
    for n, (reason, pairs) in enumerate(reasons.items(), start=1):
        out.print(f"[{n}] {', '.join(pairs)}: {reason}", markup=False)
    return EXIT_OK


class _SweepProgress:
    """On stderr: cells done of the cells to run, the current cell, and its trial's steps."""

    def __init__(self, name: str, cells: Sequence[Any], db: Any, sweep_id: str) -> None:
        from failbench_ray.storage import repo

        with db.session() as s:
            counts = repo.sweep_progress(s, sweep_id)
        self.name = name
        self.total = sum(not c.skipped for c in cells)
        self.done_before = counts["completed"] + counts["failed"]

    def __enter__(self) -> _SweepProgress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._p = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=err
        )
        self._p.start()
        self._sweep = self._p.add_task(
            f"sweep {self.name}", total=self.total, completed=self.done_before
        )
        self._trials: dict[str, Any] = {}
        return self

    def start(self, cell: Any) -> None:
        for task in self._trials.values():
            self._p.remove_task(task)
        self._trials = {}
        self._p.update(self._sweep, description=f"sweep {self.name}: {cell.key}")

    def trial(self, label: str, step: int, total: int) -> None:
        if label not in self._trials:
            self._trials[label] = self._p.add_task(f"  {label}", total=total)
        self._p.update(self._trials[label], completed=step)

    def done(self, cell: Any, status: str) -> None:
        self._p.advance(self._sweep)

    def __exit__(self, *exc: object) -> None:
        self._p.update(self._sweep, description=f"sweep {self.name}")
        self._p.stop()


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
