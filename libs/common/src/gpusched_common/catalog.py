"""The model catalog, tenant directory and GPU type table, loaded from the config folder.

Pure data: services load them once at start-up and pass them where they are needed.
"""

from __future__ import annotations

from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Annotated, TypeVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from gpusched_common.contracts import Name, PriorityClass, invalid_fields


def _not_bool(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError("a number is wanted, not true/false")
    return value


NOT_BOOL = BeforeValidator(_not_bool)
"""A number of a config file is no `true`, which pydantic reads as 1 (a limit of 1 token,
1 MiB of weights). Otherwise as pydantic reads numbers: 16384.0 is a whole number, and
"1e6" (which YAML 1.1 reads as text) is a number; "32k" is none."""
ConfigInt = Annotated[int, NOT_BOOL]
ConfigFloat = Annotated[float, NOT_BOOL]


def listed_twice(names: list[str]) -> list[str]:
    """The names `names` holds more than once, sorted."""
    return sorted(n for n, count in Counter(names).items() if count > 1)


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Name
    parameters_b: ConfigFloat = Field(gt=0, allow_inf_nan=False,
                                      description="Parameters, in billions.")
    # bounded far above any model, below what sums of them in the solver's 64-bit arrays
    # overflow (1e19 MiB stopped every scheduling cycle)
    weight_memory_mib: ConfigInt = Field(gt=0, le=2**32, description="4 PiB at most.")
    kv_cache_bytes_per_token: ConfigInt = Field(gt=0, le=2**30,
                                                description="1 GiB per token at most.")
    context_limit_tokens: ConfigInt = Field(gt=0, le=2**27,
                                            description="134,217,728 tokens at most.")
    num_gpus: ConfigInt = Field(default=1, ge=1, le=8,
                                description="GPUs of one node a request of it runs on unless "
                                "the request says (tensor parallel, as vLLM's "
                                "--tensor-parallel-size): a model too big for one GPU needs "
                                "more.")

    def kv_cache_mib(self, tokens: int) -> int:
        """GPU memory of the KV cache for `tokens` tokens, rounded up to whole MiB."""
        return -(-tokens * self.kv_cache_bytes_per_token // (1024 * 1024))


SHARD_MARK = "#tp"
"""Joins a model's name and its gang size in `weights_name`; '#' is in no model name."""


def weights_name(model: str, num_gpus: int) -> str:
    """What a model's weights go by on each GPU that holds them: the model's name when one
    GPU holds them whole, `<model>#tp<n>` on each GPU of an n-GPU gang (tensor parallel:
    each holds a 1/n shard). Work of another gang size cannot use a shard, so it is loaded,
    reported and matched under this name."""
    return model if num_gpus == 1 else f"{model}{SHARD_MARK}{num_gpus}"


def model_of(weights: str) -> str:
    """The model whose weights go by `weights` (see `weights_name`)."""
    return weights.partition(SHARD_MARK)[0]


class ModelCatalog(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    models: tuple[ModelSpec, ...]

    @model_validator(mode="after")
    def _one_entry_per_model(self) -> ModelCatalog:
        """A model listed twice was served by its last entry while `/v1/models` listed both:
        refused at start, naming it."""
        if twice := listed_twice(self.names):
            raise ValueError(f"model(s) listed twice: {', '.join(twice)}")
        return self

    def get(self, name: str) -> ModelSpec | None:
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, ModelSpec]:
        return {m.name: m for m in self.models}

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]


class TenantQuota(BaseModel):
    """Per-tenant limits. Hard limits (tokens per minute, requests in flight) reject with 429;
    the GPU memory guarantee is what the tenant keeps under contention: beyond it the tenant
    only borrows idle memory, which is reclaimed (preempted) when another tenant needs its own
    guarantee."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # a limit left empty is no "unlimited" (leave it out for that)
    tokens_per_minute: ConfigInt | None = Field(
        default=None, gt=0, description="Prompt + max tokens admitted per minute.")
    max_inflight_requests: ConfigInt | None = Field(default=None, gt=0)
    guaranteed_gpu_memory_mib: ConfigInt | None = Field(
        default=None, ge=0, description="None: no guarantee and nothing borrowed (unlimited).")

    @model_validator(mode="before")
    @classmethod
    def _no_empty_limit(cls, data: object) -> object:
        if isinstance(data, dict) and (empty := sorted(k for k, v in data.items() if v is None)):
            raise ValueError(f"{', '.join(empty)} has no value: give a number, or leave the "
                             "line out for no limit")
        return data


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Name
    api_keys: tuple[str, ...]
    default_priority_class: PriorityClass = "standard"
    weight: ConfigFloat = Field(default=1.0, gt=0, allow_inf_nan=False,
                                description="Fair-share weight inside a class.")
    quota: TenantQuota = Field(default_factory=TenantQuota)

    def never_admitted(self, tokens: int) -> str | None:
        """Why a request of `tokens` (prompt plus max_tokens) can never be admitted for this
        tenant, whatever it waits: more than its tokens per minute; else None."""
        limit = self.quota.tokens_per_minute
        if limit is None or tokens <= limit:
            return None
        return (f"prompt plus max_tokens ({tokens} tokens) exceeds tenant '{self.name}''s "
                f"limit of {limit} tokens per minute, so it is never admitted: lower max_tokens "
                "or shorten the prompt")


class TenantDirectory(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tenants: tuple[Tenant, ...]
    admin_api_keys: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _one_owner_per_key(self) -> TenantDirectory:
        """A key listed twice went silently to the tenant listed last (one tenant's requests
        billed to another, its usage read by another), and a tenant's key that is also an
        admin key read every tenant's usage: refused at start, naming it."""
        if twice := listed_twice([t.name for t in self.tenants]):
            raise ValueError(f"tenant name(s) listed twice: {', '.join(twice)}")
        owners: dict[str, str] = {}
        for owner, keys in [*((t.name, t.api_keys) for t in self.tenants),
                            ("the admin keys", self.admin_api_keys)]:
            for key in keys:
                if not key or key != key.strip():
                    raise ValueError(f"an API key of {owner} is empty or has spaces around it")
                if key in owners:
                    raise ValueError(f"API key {key[:6]}... is listed for {owners[key]} and "
                                     f"again for {owner}: give each key one owner")
                owners[key] = owner
        return self

    def by_api_key(self, key: str) -> Tenant | None:
        return self._by_key.get(key)

    def get(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, Tenant]:
        return {t.name: t for t in self.tenants}

    @cached_property
    def _by_key(self) -> dict[str, Tenant]:
        return {k: t for t in self.tenants for k in t.api_keys}


class GpuType(BaseModel):
    """Datasheet figures of a GPU model (dense BF16 tensor TFLOPS, HBM bandwidth)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    memory_mib: int
    bf16_tflops: float
    memory_bandwidth_gb_s: float


# NVIDIA datasheets (dense BF16, no sparsity): H100 SXM 989 TFLOPS / 3.35 TB/s; H200 SXM
# 989 / 4.8 TB/s; A100 SXM 312 / 1.555 (40 GB) and 2.039 TB/s (80 GB); L4 121 / 0.3 TB/s.
GPU_TYPES: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType(name="H100-80GB", memory_mib=81559, bf16_tflops=989, memory_bandwidth_gb_s=3350),
        GpuType(name="H200-141GB", memory_mib=143771, bf16_tflops=989, memory_bandwidth_gb_s=4800),
        GpuType(name="A100-80GB", memory_mib=81920, bf16_tflops=312, memory_bandwidth_gb_s=2039),
        GpuType(name="A100-40GB", memory_mib=40960, bf16_tflops=312, memory_bandwidth_gb_s=1555),
        GpuType(name="L4-24GB", memory_mib=23034, bf16_tflops=121, memory_bandwidth_gb_s=300),
    )
}


def load_models(config_dir: Path) -> ModelCatalog:
    """Read `models.yaml`; raises ValueError naming the file when it is invalid."""
    return read_config_as(ModelCatalog, config_dir / "models.yaml")


def load_tenants(config_dir: Path) -> TenantDirectory:
    """Read `tenants.yaml`; raises ValueError naming the file when it is invalid."""
    return read_config_as(TenantDirectory, config_dir / "tenants.yaml")


Config = TypeVar("Config", bound=BaseModel)


def read_config_as(kind: type[Config], path: Path, empty_ok: bool = False) -> Config:
    """The file `path` of the config folder (`read_config`) as a `kind`; raises ValueError
    naming the file and, on one line, every entry that is wrong (what a service that
    refuses to start says)."""
    data = read_config(path, empty_ok)
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{path} is invalid: {invalid_fields(exc)}") from exc


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: the last one silently
    won, so a second `quota:` block under a tenant dropped the first one's limits."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: what it brings
                continue  # in may be overridden here, as YAML means it
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            try:
                hash(key)
            except TypeError:  # `{{ .Values.key }}` left by a template: a mapping as a key
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    "found a key that is a list or mapping (a template placeholder such as "
                    "{{ ... }} not filled in?)", key_node.start_mark) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found the key {key!r} twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_config(path: Path, empty_ok: bool = False) -> dict:
    """The YAML mapping a file of the config folder holds ({} for a file holding nothing,
    where `empty_ok`); raises ValueError naming the file when it is missing (saying how to
    name the folder), cannot be read (a folder named where the file should be, say), is not
    YAML, gives a key twice in one mapping, or holds no mapping; on one line."""
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except FileNotFoundError as exc:
        raise ValueError(
            f"{path} is missing: set GPUSCHED_CONFIG_DIR to the config folder") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from exc
    except yaml.YAMLError as exc:  # its marks run over lines
        raise ValueError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from exc
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a YAML mapping")
    return data
