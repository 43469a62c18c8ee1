"""The service's settings: from the environment (FAILBENCH_*) and `failbench serve` flags."""

from __future__ import annotations

import ipaddress

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FAILBENCH_", extra="ignore", frozen=True)

    api_token: SecretStr | None = Field(
        None, description="Bearer token for mutating requests (and reads off loopback)."
    )
    host: str = Field("127.0.0.1", description="Address the server binds.")
    max_body_bytes: int = Field(1_000_000, ge=1, description="Largest request body accepted.")
    max_world_size: int = Field(64, ge=2, description="Largest world_size of a submitted spec.")
    max_steps: int = Field(100_000, ge=1, description="Largest steps of a submitted spec.")
    max_trials: int = Field(20, ge=1, description="Largest trials of a submitted spec.")
    max_state_mb: float = Field(
        4096.0, gt=0, description="Largest model + Adam state per replica of a spec, in MB."
    )
    max_batch_size: int = Field(65_536, ge=1, description="Largest batch_size of a spec.")
    max_threads_per_worker: int = Field(
        16, ge=1, description="Largest threads_per_worker of a submitted spec."
    )
    max_sweep_cells: int = Field(1000, ge=1, description="Largest grid of a submitted sweep.")
    request_timeout_s: float = Field(
        20.0,
        gt=0,
        le=3600,
        description="Server-side deadline of a request: past it the client gets 503 (a "
        "recommend's worker is killed; other work, bounded by the caps, finishes unseen).",
    )
    compute_workers: int = Field(
        2,
        ge=1,
        le=64,
        description="Processes that run recommend's simulations, at most one request each: "
        "the CPU such requests may take from the service, whatever their number.",
    )
    threads: int = Field(
        8,
        ge=1,
        le=256,
        description="Threads that run requests' database work (and database connections kept "
        "open for them). More only adds lock and GIL contention on a few cores.",
    )

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
