"""What one usage record adds to which counters; pure, so the same rule serves the live
apply and any recomputation. GPU time is counted in integer microseconds so totals are
exact sums whatever the order of application."""

from __future__ import annotations

from dataclasses import dataclass

from gpusched_common.contracts import UsageRecord

COUNTERS = ("prompt_tokens", "completion_tokens", "requests", "gpu_us")


@dataclass(frozen=True)
class Increment:
    dedup_key: str
    tenant: str
    hashes: tuple[str, ...]
    """Redis hash keys that each receive every field of `fields`."""
    fields: tuple[tuple[str, int], ...]


def tenant_key(tenant: str) -> str:
    return f"gpusched:usage:tenant:{tenant}"


def tenant_model_key(tenant: str, model: str) -> str:
    return f"gpusched:usage:tenant:{tenant}:model:{model}"


TENANTS_KEY = "gpusched:usage:tenants"
MODELS_KEY = "gpusched:usage:models:{}"


def increment_for(usage: UsageRecord) -> Increment:
    return Increment(
        dedup_key=f"gpusched:usage:applied:{usage.event_id}",
        tenant=usage.tenant,
        hashes=(tenant_key(usage.tenant), tenant_model_key(usage.tenant, usage.model)),
        fields=(("prompt_tokens", usage.prompt_tokens),
                ("completion_tokens", usage.completion_tokens),
                ("requests", 1 if usage.final and usage.gpu_type != "none" else 0),
                ("gpu_us", round(usage.gpu_seconds * 1_000_000))),
    )


def totals_from_hash(raw: dict[bytes, bytes]) -> dict[str, float | int]:
    values = {k.decode(): int(v) for k, v in raw.items()}
    out: dict[str, float | int] = {c: values.get(c, 0) for c in COUNTERS if c != "gpu_us"}
    out["gpu_seconds"] = values.get("gpu_us", 0) / 1_000_000
    return out
