"""Agent settings (GPUSCHED_* environment variables), validated at start-up."""

import socket
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gpusched_common.catalog import ModelCatalog
from gpusched_common.settings import ServiceSettings, server_root


class AgentSettings(ServiceSettings):
    http_port: int = Field(default=8090, ge=0, le=65535)
    node_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=128,
                         pattern=r"^[A-Za-z0-9._:/@-]+$", description="This node's id.")
    simulate: str | None = Field(
        default=None, description="Simulated inventory such as '8xH100-80GB', "
        "'2xA100-40GB,4xL4-24GB', or a YAML file (.yaml); without it the agent reads its GPUs "
        "through NVML.")
    executor: Literal["simulated", "torch", "openai"] = Field(
        default="simulated", description="What runs requests: the performance model, a real "
        "small transformer in PyTorch (extra 'torch'), or an OpenAI-compatible server.")
    openai_base_url: str | None = Field(
        default=None, pattern=r"^https?://", description="Inference server on this node, e.g. "
        "http://127.0.0.1:8000 (executor=openai); a trailing /v1, as OpenAI clients write it, "
        "is dropped.")
    openai_model: str | None = Field(
        default=None, description="Model name sent to the server instead of the catalog's.")
    models: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9._:/@-]+(,[A-Za-z0-9._:/@-]+)*$",
        description="The catalog models this node runs, comma-separated (its inference "
        "server serves only those); unset: every catalog model, or with executor=openai "
        "and no GPUSCHED_OPENAI_MODEL, those the server lists on /v1/models.")
    openai_api_key: str | None = Field(default=None, description="Bearer key of the server.")
    openai_timeout_s: float = Field(
        default=600.0, gt=0, le=86400, description="A server that sends no event for this "
        "long is wedged (keep-alive comments do not count): the request goes on elsewhere, "
        "and the node takes no work until the server generates a token again; one that "
        "sends events but no token for this long fails that request.")
    openai_stream_usage: bool = Field(
        default=True, description="Ask the server for its token counts as it streams (vLLM, "
        "SGLang) and bill those; off for a server that refuses `stream_options`: each "
        "streamed text delta then counts as one token.")
    torch_device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                              description="Where the torch executor runs.")
    torch_threads: int = Field(default=0, ge=0, le=256,
                               description="CPU threads of torch (0: torch's default).")
    torch_dim: int = Field(default=256, ge=16, le=8192, description="Width of the torch model.")
    torch_layers: int = Field(default=4, ge=1, le=128, description="Layers of the torch model.")
    heartbeat_s: float = Field(default=2.0, gt=0, le=60, description="Node state period.")
    usage_interval_s: float = Field(
        default=5.0, gt=0, le=3600, description="Partial usage records of a running request "
        "at most this far apart (a crash loses at most one interval of billing).")
    load_failure_cooldown_s: float = Field(
        default=60.0, ge=0, le=86400, description="A model whose load failed on this node "
        "(its engine up) is not placed here again for this long, unless a load of it here "
        "succeeds first; its work goes to other nodes, or waits (0: placed again at once).")
    drain_timeout_s: float = Field(
        default=20.0, ge=0, le=3600, description="On SIGTERM, running requests get this long "
        "to finish before they are handed back to the scheduler.")
    time_scale: float = Field(
        default=1.0, gt=0, le=100, description="Simulated durations are multiplied by this "
        "(0.1 runs ten times faster); billed GPU-seconds stay in model time.")
    chunk_tokens: int = Field(default=8, ge=1, le=1024, description="Tokens per stream chunk.")
    seed: int = Field(default=0, description="Seed of the executor's text and weights.")

    def served_models(self, catalog: ModelCatalog) -> tuple[str, ...] | None:
        """GPUSCHED_MODELS as catalog names (None: unset); a name the catalog lacks is an
        error at start, not a node that silently never gets that model's work."""
        if self.models is None:
            return None
        names = tuple(dict.fromkeys(self.models.split(",")))
        unknown = [m for m in names if catalog.get(m) is None]
        if unknown:
            raise ValueError(f"GPUSCHED_MODELS names {', '.join(unknown)}, not in the catalog "
                             f"({', '.join(catalog.names)}): use the names of models.yaml")
        return names

    @field_validator("openai_base_url")
    @classmethod
    def _server_root(cls, url: str | None) -> str | None:
        """The server's root, without a trailing /v1 (as OpenAI clients and vLLM's docs
        write it): the executor asks for /v1/..., and .../v1/v1/models was a 404 that kept
        the node down for good."""
        return None if url is None else server_root(url)

    @model_validator(mode="after")
    def _executor_needs(self) -> "AgentSettings":
        if self.executor == "openai" and not self.openai_base_url:
            raise ValueError("GPUSCHED_EXECUTOR=openai needs GPUSCHED_OPENAI_BASE_URL (the "
                             "inference server on this node, e.g. http://127.0.0.1:8000)")
        if self.torch_dim % 4:
            raise ValueError(f"GPUSCHED_TORCH_DIM={self.torch_dim} must be a multiple of 4 "
                             "(the model has 4 attention heads)")
        return self
