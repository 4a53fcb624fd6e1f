"""`gpusched bench agent`: the agent's executors measured through the real runtime (in-memory
publish and ledger, no Kafka): torch tokens/s and GPU-seconds per request on CPU (and CUDA
when present), the simulated executor's overhead per token, and the agent process's memory
with 64 requests in flight on a simulated 8-GPU node (in a fresh process, without torch)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from gpusched_agent.adapters.executor import Executor
from gpusched_agent.adapters.ledger import MemoryLedger
from gpusched_agent.adapters.simulated import SimulatedExecutor
from gpusched_agent.domain.inventory import parse_simulated
from gpusched_agent.domain.node import NodeModel
from gpusched_agent.runtime import AgentRuntime
from gpusched_common.catalog import load_models
from gpusched_common.contracts import InferenceRequest, Message, Placement, UsageRecord
from gpusched_common.settings import REPO_CONFIG_DIR

MEMORY_TARGET_MIB = 150.0
MODEL = "qwen2.5-1.5b"


class _Sink:
    def __init__(self) -> None:
        self.usage: list[UsageRecord] = []
        self.count = 0

    async def __call__(self, message: Message, topic: str, key: str, wait: bool = True) -> None:
        self.count += 1
        if isinstance(message, UsageRecord):
            self.usage.append(message)


def _runtime(executor: Executor, spec: str, sink: _Sink) -> AgentRuntime:
    return AgentRuntime("bench", NodeModel.from_inventory(parse_simulated(spec, "bench")),
                        load_models(REPO_CONFIG_DIR), executor, sink, MemoryLedger(),
                        lambda: int(time.time() * 1000), chunk_tokens=8, heartbeat_s=60)


def _placement(i: int, gpu: int, max_tokens: int, prompt: str = "benchmark prompt " * 8
               ) -> Placement:
    req = InferenceRequest(request_id=f"b{i}", tenant="bench", model=MODEL, prompt=prompt,
                           max_tokens=max_tokens, seed=i, created_at_ms=0)
    return Placement(placement_id=f"b{i}#0", node_id="bench", gpu_indices=(gpu,),
                     kv_cache_mib=16, scheduler_epoch=0, placed_at_ms=0, request=req)


async def _run(runtime: AgentRuntime, placements: list[Placement]) -> float:
    """Wall seconds to run `placements` to the end, all submitted at once."""
    t0 = time.perf_counter()
    for p in placements:
        await runtime.command(p)
    while runtime.in_flight:
        await asyncio.sleep(0.001)
    return time.perf_counter() - t0


async def bench_torch(device: str, concurrent: int, max_tokens: int) -> dict:
    from gpusched_agent.adapters.torch_executor import TorchExecutor

    executor = TorchExecutor(device)
    sink = _Sink()
    runtime = _runtime(executor, "1xH100-80GB", sink)
    await _run(runtime, [_placement(0, 0, 4)])  # load the model, warm up
    single_s = await _run(runtime, [_placement(1, 0, max_tokens)])
    sink.usage.clear()
    peak: dict[str, int] = {}

    async def sample() -> None:
        while True:
            for key, value in executor.memory_bytes().items():
                peak[key] = max(peak.get(key, 0), value)
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    batch_s = await _run(runtime, [_placement(10 + i, 0, max_tokens) for i in range(concurrent)])
    sampler.cancel()
    await executor.close()
    per_request: dict[str, float] = {}
    for u in sink.usage:  # partial records are deltas: a request's GPU time is their sum
        per_request[u.request_id] = per_request.get(u.request_id, 0.0) + u.gpu_seconds
    return {"device": executor.device_kind, "tokens_per_s_single": max_tokens / single_s,
            "tokens_per_s": concurrent * max_tokens / batch_s, "concurrent": concurrent,
            "gpu_seconds_per_request": sum(per_request.values()) / len(per_request),
            "batch_wall_s": batch_s, "peak_memory_bytes": peak}


async def bench_sim_overhead(requests: int, max_tokens: int) -> float:
    """Microseconds of agent work per token when the performance model takes no time."""

    async def no_wait(_s: float) -> None:
        await asyncio.sleep(0)

    sink = _Sink()
    runtime = _runtime(SimulatedExecutor(1.0, 0, sleep=no_wait), "8xH100-80GB", sink)
    await _run(runtime, [_placement(0, 0, 4)])
    wall_s = await _run(runtime, [_placement(1 + i, i % 8, max_tokens) for i in range(requests)])
    return wall_s / (requests * max_tokens) * 1e6


async def memory_probe(in_flight: int) -> dict:
    """RSS of a process holding the whole agent (service modules imported, runtime, simulated
    executor) with `in_flight` long requests running on a simulated 8-GPU node."""
    import psutil

    import gpusched_agent.main  # noqa: F401 - the service's imports count too

    sink = _Sink()
    runtime = _runtime(SimulatedExecutor(1.0, 0), "8xH100-80GB", sink)
    for i in range(in_flight):
        await runtime.command(_placement(i, i % 8, 30_000, prompt="memory probe " * 200))
    await asyncio.sleep(1.0)
    rss_mib = psutil.Process().memory_info().rss / 2**20
    return {"in_flight": runtime.in_flight, "rss_mib": rss_mib,
            "torch_imported": "torch" in sys.modules}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpusched bench agent", description=__doc__)
    parser.add_argument("--json", type=Path, help="Also write the numbers to this file.")
    parser.add_argument("--quick", action="store_true", help="Fewer and shorter requests.")
    parser.add_argument("--memory-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_probe:
        print(json.dumps(asyncio.run(memory_probe(64))))
        return 0
    tokens = 32 if args.quick else 128
    probe = subprocess.run([sys.executable, "-m", "gpusched_agent.bench", "--memory-probe"],
                           capture_output=True, text=True, check=True)
    memory = json.loads(probe.stdout.strip().splitlines()[-1])
    sim_us = asyncio.run(bench_sim_overhead(64, tokens))
    out: dict = {"sim_overhead_us_per_token": sim_us, "agent_rss_mib_64_in_flight":
                 memory["rss_mib"], "agent_memory_target_mib": MEMORY_TARGET_MIB}
    print(f"agent process, 64 requests in flight on 8 simulated GPUs: "
          f"{memory['rss_mib']:.1f} MiB RSS (target < {MEMORY_TARGET_MIB:.0f} MiB; "
          f"torch imported: {memory['torch_imported']})")
    print(f"simulated executor overhead: {sim_us:.1f} us per token (64 requests x {tokens} "
          "tokens, performance model waits removed)")
    try:
        import torch
    except ImportError:
        print("torch executor: skipped (pip install 'gpusched-agent[torch]')")
        torch = None
    devices = [] if torch is None else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        r = asyncio.run(bench_torch(device, concurrent=4 if args.quick else 8, max_tokens=tokens))
        prefix = "torch" if device == "cpu" else "torch_cuda"
        out.update({f"{prefix}_tokens_per_s": r["tokens_per_s"],
                    f"{prefix}_tokens_per_s_single": r["tokens_per_s_single"],
                    f"{prefix}_gpu_seconds_per_request": r["gpu_seconds_per_request"],
                    f"{prefix}_peak_memory_bytes": r["peak_memory_bytes"]})
        print(f"torch executor on {device}: {r['tokens_per_s']:.0f} tokens/s with "
              f"{r['concurrent']} requests batched, {r['tokens_per_s_single']:.0f} tokens/s "
              f"alone; {r['gpu_seconds_per_request']:.3f} GPU-s per {tokens}-token request; "
              f"peak memory {r['peak_memory_bytes']}")
    out.setdefault("torch_tokens_per_s", None)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if memory["rss_mib"] < MEMORY_TARGET_MIB and not memory["torch_imported"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
