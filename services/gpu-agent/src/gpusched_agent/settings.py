"""Agent settings (GPUSCHED_* environment variables)."""

import socket

from pydantic import Field

from gpusched_common.settings import ServiceSettings


class AgentSettings(ServiceSettings):
    http_port: int = Field(default=8090, ge=0, le=65535)
    node_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=128,
                         pattern=r"^[A-Za-z0-9._:/@-]+$", description="This node's id.")
    simulate: str | None = Field(
        default=None, description="Simulated inventory such as '8xH100-80GB' or "
        "'2xA100-40GB,4xL4-24GB'; used when set, or when NVML finds no GPU.")
    heartbeat_s: float = Field(default=2.0, gt=0, le=60, description="Node state period.")
    time_scale: float = Field(
        default=1.0, gt=0, le=100, description="Simulated durations are multiplied by this "
        "(0.1 runs ten times faster); billed GPU-seconds stay in model time.")
    chunk_tokens: int = Field(default=8, ge=1, le=1024, description="Tokens per stream chunk.")
    seed: int = Field(default=0, description="Seed of the simulated executor's text.")
