"""The simulated executor's performance model (documented in docs/ARCHITECTURE.md).

Prefill is compute-bound: prompt_tokens x 2 x parameters FLOPs at `PREFILL_MFU` of the GPU's
dense BF16 peak. Decode is memory-bandwidth-bound: each step reads the weights once plus the
KV cache of every running request, at `DECODE_BW_EFFICIENCY` of peak bandwidth; one step
yields one token for each request in the batch (continuous batching).
"""

from __future__ import annotations

from gpusched_common.catalog import GpuType, ModelSpec

PREFILL_MFU = 0.5
DECODE_BW_EFFICIENCY = 0.7
LOAD_GB_S = 20.0
"""Weights loaded from host memory at PCIe-4 x16-class speed."""


def prefill_s(prompt_tokens: int, model: ModelSpec, gpu: GpuType) -> float:
    flops = 2.0 * model.parameters_b * 1e9 * prompt_tokens
    return flops / (gpu.bf16_tflops * 1e12 * PREFILL_MFU)


def decode_step_s(model: ModelSpec, gpu: GpuType, kv_tokens_in_batch: int) -> float:
    """Seconds for one decode step of a batch holding `kv_tokens_in_batch` cached tokens."""
    bytes_read = model.weight_memory_mib * 1024 * 1024 + kv_tokens_in_batch * \
        model.kv_cache_bytes_per_token
    return bytes_read / (gpu.memory_bandwidth_gb_s * 1e9 * DECODE_BW_EFFICIENCY)


def load_s(model: ModelSpec) -> float:
    return model.weight_memory_mib * 1024 * 1024 / (LOAD_GB_S * 1e9)
