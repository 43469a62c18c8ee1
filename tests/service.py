"""The service-process helpers live in `bench/serving.py` (the bench's soak starts `failbench
serve` the same way); the tests keep importing them from here."""

from bench.serving import Process, Server, free_port, wait_status

__all__ = ["Process", "Server", "free_port", "wait_status"]
