"""Prometheus metrics of the service: request latency (measured per request) and the queue,
experiments and dispatchers (read from the database at each scrape, so every replica of the
service reports the same numbers)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from failbench_ray.storage import queue
from failbench_ray.storage.db import Database
from failbench_ray.storage.status import ExperimentStatus


class _QueueCollector(Collector):
    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.db.session() as s:
            depth = queue.depth(s)
            by_status = queue.counts_by_status(s)
            dispatchers = queue.dispatchers(s)
        yield GaugeMetricFamily(
            "failbench_queue_depth", "Experiments queued and not yet claimed", value=depth
        )
        g = GaugeMetricFamily(
            "failbench_experiments", "Experiments in the database, by status", labels=["status"]
        )
        for status in ExperimentStatus:
            g.add_metric([status.value], by_status.get(status, 0))
        yield g
        beat = GaugeMetricFamily(
            "failbench_dispatcher_heartbeat_age_seconds",
            "Seconds since each dispatcher's last heartbeat",
            labels=["dispatcher"],
        )
        busy = GaugeMetricFamily(
            "failbench_dispatcher_busy",
            "1 while a dispatcher runs an experiment",
            labels=["dispatcher"],
        )
        for d in dispatchers:
            beat.add_metric([d.id], queue.seconds_since(d.heartbeat_at))
            busy.add_metric([d.id], 1.0 if d.experiment_id else 0.0)
        yield beat
        yield busy


class Metrics:
    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "failbench_http_request_duration_seconds",
            "Time to answer an HTTP request",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.registry.register(_QueueCollector(db))


def exported_names() -> set[str]:
    """Every series name the service's metrics appear under in Prometheus (a histogram as its
    _bucket, _count and _sum series). `tests/test_deploy.py` checks the dashboards' queries
    against it, and it against what `Metrics` exposes."""
    latency = "failbench_http_request_duration_seconds"
    return {
        f"{latency}_bucket",
        f"{latency}_count",
        f"{latency}_sum",
        "failbench_queue_depth",
        "failbench_experiments",
        "failbench_dispatcher_heartbeat_age_seconds",
        "failbench_dispatcher_busy",
    }
