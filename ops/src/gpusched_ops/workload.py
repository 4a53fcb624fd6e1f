"""A short mixed workload (several tenants, priority classes and models, over HTTP and
straight to Kafka) and the report `gpusched demo` prints from it.

Request sizes come from the Azure LLM code trace in ../shared/data/llm when it is there
(clipped so the demo stays short), else from a seeded synthetic mix.
"""

from __future__ import annotations

import asyncio
import csv
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from aiokafka import AIOKafkaProducer

from gpusched_common import topics
from gpusched_common.contracts import InferenceRequest

# (tenant, API key, default class) from config/tenants.yaml; models from config/models.yaml.
TENANTS = (("acme", "sk-acme-demo"), ("globex", "sk-globex-demo"),
           ("initech", "sk-initech-demo"))
MODELS = ("qwen2.5-1.5b", "llama-3.1-8b", "mistral-7b")
CLASSES = ("interactive", "standard", "batch")
AZURE_TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "llm" / \
    "AzureLLMInferenceTrace_code.csv"


@dataclass
class Outcome:
    request_id: str
    tenant: str
    priority_class: str
    via: str
    status: str
    latency_ms: float
    completion_tokens: int = 0
    trace_id: str | None = None
    error: str | None = None


@dataclass
class Plan:
    tenant: str
    key: str
    priority_class: str
    model: str
    prompt_tokens: int
    max_tokens: int
    via: str = "http"
    extra: dict = field(default_factory=dict)


def make_plan(n: int, seed: int, kafka_share: float = 0.15,
              trace: Path | None = AZURE_TRACE) -> list[Plan]:
    rng = random.Random(seed)
    sizes = _trace_sizes(trace) if trace and trace.exists() else []
    plans = []
    for i in range(n):
        tenant, key = TENANTS[i % len(TENANTS)]
        prompt, out = rng.choice(sizes) if sizes else (rng.randint(50, 1500), rng.randint(8, 96))
        plans.append(Plan(tenant=tenant, key=key, priority_class=rng.choice(CLASSES),
                          model=rng.choice(MODELS), prompt_tokens=min(prompt, 2048),
                          max_tokens=max(1, min(out, 128)),
                          via="kafka" if rng.random() < kafka_share else "http"))
    return plans


def _trace_sizes(path: Path) -> list[tuple[int, int]]:
    with path.open() as f:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]


def _prompt(tokens: int) -> str:
    # count_prompt_tokens bills ceil(bytes / 4): "tok " is 4 bytes, one token each.
    return "tok " * tokens


async def run_workload(plans: list[Plan], router_url: str, kafka_bootstrap: str,
                       concurrency: int = 16, timeout_s: float = 120) -> list[Outcome]:
    sem = asyncio.Semaphore(concurrency)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        async with httpx.AsyncClient(base_url=router_url, timeout=timeout_s) as client:
            async def one(plan: Plan) -> Outcome:
                async with sem:
                    if plan.via == "kafka":
                        return await _via_kafka(plan, client, producer, timeout_s)
                    return await _via_http(plan, client)
            return await asyncio.gather(*(one(p) for p in plans))
    finally:
        await producer.stop()


async def _via_http(plan: Plan, client: httpx.AsyncClient) -> Outcome:
    started = time.perf_counter()
    resp = await client.post(
        "/v1/completions",
        json={"model": plan.model, "prompt": _prompt(plan.prompt_tokens),
              "max_tokens": plan.max_tokens},
        headers={"Authorization": f"Bearer {plan.key}", "X-Priority-Class": plan.priority_class})
    latency = (time.perf_counter() - started) * 1000
    rid = resp.headers.get("x-request-id", "?")
    if resp.status_code != 200:
        return Outcome(rid, plan.tenant, plan.priority_class, "http", "error", latency,
                       error=f"{resp.status_code} {resp.text[:200]}")
    body = resp.json()
    return Outcome(rid, plan.tenant, plan.priority_class, "http",
                   "completed" if body["choices"][0]["finish_reason"] != "error" else "failed",
                   latency, body["usage"]["completion_tokens"], resp.headers.get("x-trace-id"))


async def _via_kafka(plan: Plan, client: httpx.AsyncClient, producer: AIOKafkaProducer,
                     timeout_s: float) -> Outcome:
    """Produce the documented JSON shape straight to the class's topic, then poll the
    router's GET /v1/requests/{id} until the request is terminal."""
    rid = f"demo-{uuid.uuid4().hex[:12]}"
    request = InferenceRequest(request_id=rid, tenant=plan.tenant,
                               priority_class=plan.priority_class,  # type: ignore[arg-type]
                               model=plan.model, prompt=_prompt(plan.prompt_tokens),
                               max_tokens=plan.max_tokens, created_at_ms=int(time.time() * 1000))
    started = time.perf_counter()
    await producer.send_and_wait(topics.REQUESTS[request.priority_class].name,
                                 request.to_bytes(), key=rid.encode())
    deadline = started + timeout_s
    while time.perf_counter() < deadline:
        resp = await client.get(f"/v1/requests/{rid}",
                                headers={"Authorization": f"Bearer {plan.key}"})
        body = resp.json() if resp.status_code == 200 else {}
        if "result" in body:  # ended: queued and running have none
            result = body["result"]
            return Outcome(rid, plan.tenant, plan.priority_class, "kafka", body["status"],
                           (time.perf_counter() - started) * 1000,
                           result.get("completion_tokens", 0))
        await asyncio.sleep(0.05)
    return Outcome(rid, plan.tenant, plan.priority_class, "kafka", "timeout",
                   timeout_s * 1000, error="no terminal result")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]
