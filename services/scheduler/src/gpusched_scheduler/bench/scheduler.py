"""`gpusched bench scheduler`: sustained placements/s and publish-to-placement latency of the
scheduler service through real Kafka, with one and with two instances (hot standby), a
10-minute memory soak and a full-fleet phase that shows backpressure bounds pending work.

The bench plays the fleet itself: it publishes node states of a synthetic fleet, produces
requests open loop at fixed rates, consumes placements and answers each with a final usage
record after a short hold (as an agent would), so the fleet never fills unless asked to.
It starts its own Kafka and Redis (own ports and run folder) unless given a running stack.
`python -m gpusched_scheduler.bench.scheduler` with GPUSCHED_BENCH_PROFILE=<path> runs the
scheduler service itself under cProfile (the bench's `--profile`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import secrets
import shutil
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import httpx
import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import ConsumerRecord
from pydantic import Field

from gpusched_common import topics
from gpusched_common.bench_options import (
    Count,
    Duration,
    PositiveDuration,
    comma_list,
    option,
    port_base,
)
from gpusched_common.catalog import GPU_TYPES, ModelSpec, load_models
from gpusched_common.contracts import GpuState, NodeState, count_prompt_tokens
from gpusched_common.settings import REPO_CONFIG_DIR
from gpusched_scheduler.adapters.requests import CONSUMER_GROUP
from gpusched_scheduler.settings import SchedulerSettings

KUBE_SCHEDULER_PODS_PER_S = 700
"""Published reference: the kube-scheduler's CI performance floor (scheduler_perf), pods/s."""
MODEL = "llama-3.1-8b"
GPU_TYPE = "H100-80GB"
TENANTS = ("acme", "globex", "initech", "stark", "wayne")
"""Tenants of config/tenants.yaml without quotas or guarantees (nothing is refused or
preempted for policy reasons, so the bench measures placement alone)."""
PROMPT = "Benchmark request: say hello."
MAX_TOKENS = 64
P99_LIMIT_MS = 100.0
ACHIEVED_MIN_RATIO = 0.95
NODE_STATE_PERIOD_S = 2.0
TARGET_RATE_REQ_S = 500
TARGET_P99_MS = 25.0
TARGET_SUSTAINED_PER_S = 2000
TARGET_RSS_GROWTH = 0.10
BROKER_WARM_RATE = 1000
SCHEDULERS = ("scheduler-bench-a", "scheduler-bench-b")


# --- pure helpers -------------------------------------------------------------------------
def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of an ascending list; NaN when empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass(frozen=True)
class Step:
    """One rate of a ramp: what was offered, what came out, how long it took (ms)."""

    offered_req_s: int
    sent_req_s: float
    placements_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    scheduler_p99_ms: float
    """p99 from the request's created_at_ms to the placement record's Kafka timestamp: the
    part of the latency before the bench's own consumer (1 ms resolution)."""
    measured: int
    missing: int
    scheduler_cpu_pct: float
    bench_cpu_pct: float
    kafka_cpu_pct: float
    scheduler_cpu_us_per_placement: float
    scheduler_cpu_wait_pct: float
    """Share of the step the leader's event loop was runnable but waited for a CPU."""
    steal_pct: float
    """Share of this VM's CPU time the hypervisor ran something else instead (/proc/stat
    steal): how loaded the host under this machine was during the step."""
    cycles_per_s: float
    cycle_mean_ms: float
    solver_mean_ms: float
    leader_changes: int
    """Times the leader stepped down during the step (its lease lapsed): the step is void."""

    @property
    def ok(self) -> bool:
        """Sustained: every request placed, p99 under the limit, output keeps up with input."""
        return (self.missing == 0 and self.leader_changes == 0 and self.p99_ms <= P99_LIMIT_MS
                and self.placements_per_s >= ACHIEVED_MIN_RATIO * self.offered_req_s)


def sustained(steps: list[Step]) -> Step | None:
    """The highest offered rate that was sustained ("before latency climbs"), or None."""
    good = [s for s in steps if s.ok]
    return max(good, key=lambda s: s.offered_req_s) if good else None


def metric_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of every sample of each metric in `names` (all labels) in Prometheus text."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


CYCLE_METRICS = ("gpusched_scheduler_cycle_seconds_count", "gpusched_scheduler_cycle_seconds_sum",
                 "gpusched_scheduler_solver_seconds_sum")


def request_bytes(request_id: str, tenant: str, priority_class: str, created_at_ms: int) -> bytes:
    """An `InferenceRequest` as JSON, written directly (cheaper than pydantic per record)."""
    return (f'{{"type":"inference_request","version":1,"request_id":"{request_id}",'
            f'"tenant":"{tenant}","priority_class":"{priority_class}","model":"{MODEL}",'
            f'"prompt":"{PROMPT}","max_tokens":{MAX_TOKENS},'
            f'"created_at_ms":{created_at_ms}}}').encode()


def usage_bytes(placement: dict, now_ms: int) -> bytes:
    """The final `UsageRecord` an agent would publish for `placement` (a parsed JSON dict)."""
    request = placement["request"]
    pid = placement["placement_id"]
    return json.dumps({
        "type": "usage", "version": 1, "event_id": f"{pid}:final",
        "request_id": request["request_id"], "placement_id": pid, "tenant": request["tenant"],
        "model": request["model"], "priority_class": request["priority_class"],
        "node_id": placement["node_id"], "gpu_type": GPU_TYPE,
        "prompt_tokens": count_prompt_tokens(PROMPT), "completion_tokens": MAX_TOKENS,
        "gpu_seconds": 0.05, "final": True, "started_at_ms": placement["placed_at_ms"],
        "ended_at_ms": now_ms}, separators=(",", ":")).encode()


@functools.cache
def model_spec() -> ModelSpec:
    """The bench model's catalog entry (read once: node states are built every 2 s)."""
    spec = load_models(REPO_CONFIG_DIR).get(MODEL)
    assert spec is not None, f"{MODEL} is not in config/models.yaml"
    return spec


def request_kv_mib() -> int:
    return model_spec().kv_cache_mib(count_prompt_tokens(PROMPT) + MAX_TOKENS)


def node_states(nodes: int, gpus: int, seq: int, started_at_ms: int, now_ms: int,
                free_mib: int | None) -> list[NodeState]:
    """The synthetic fleet: `nodes` x `gpus` H100-80GB with the model loaded; free memory is
    what is left beside the weights, or `free_mib` per GPU (the full-fleet phase)."""
    spec = model_spec()
    total = GPU_TYPES[GPU_TYPE].memory_mib
    free = total - spec.weight_memory_mib if free_mib is None else free_mib
    return [NodeState(
        node_id=f"bench-node-{n:03d}", seq=seq, started_at_ms=started_at_ms,
        reported_at_ms=now_ms, executor="simulated",
        gpus=tuple(GpuState(index=g, uuid=f"GPU-bench-{n:03d}-{g}", gpu_type=GPU_TYPE,
                            memory_total_mib=total, memory_free_mib=free,
                            loaded_models=(MODEL,)) for g in range(gpus)))
        for n in range(nodes)]


# --- the bench's side of Kafka: fleet, request producer, agent answers --------------------
class FakeFleet:
    """Node-state heartbeats, an open-loop request producer and the agents' answers, on one
    producer and one consumer (placements and results) of the bench's event loop."""

    def __init__(self, bootstrap: str, nodes: int, gpus: int, hold_ms: float) -> None:
        self.bootstrap = bootstrap
        self.nodes, self.gpus, self.hold_s = nodes, gpus, hold_ms / 1000
        self.free_mib: int | None = None
        self.answer_usage = True
        self.sent_at: dict[str, float] = {}
        """Request id -> wall-clock second it was handed to the producer (until placed)."""
        self.done: dict[str, tuple[float, float, float]] = {}
        """Request id -> (received s, latency ms, scheduler-side latency ms)."""
        self.track = False
        self.received: list[float] = []
        self.rejections = 0
        self.preempts = 0
        self._usage: deque[tuple[float, bytes, bytes]] = deque()
        self._seq = 0
        self._started_ms = int(time.time() * 1000)
        self._rr: dict[str, int] = {}
        self._tasks: list[asyncio.Task] = []
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=2,
                                         max_batch_size=1 << 20, max_request_size=4 << 20)
        self.consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                         enable_auto_commit=False, fetch_max_wait_ms=50,
                                         max_partition_fetch_bytes=4 << 20)

    async def start(self) -> None:
        # Fresh topics have no partition leaders for a moment: aiokafka logs and retries.
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        try:
            await self._start()
        finally:
            logging.getLogger("aiokafka").setLevel(logging.NOTSET)

    async def _start(self) -> None:
        await self.producer.start()
        await self.consumer.start()
        parts = [TopicPartition(t.name, p) for t in (topics.PLACEMENTS, topics.RESULTS)
                 for p in range(t.partitions)]
        self.consumer.assign(parts)
        await self.consumer.seek_to_end(*parts)
        for p in parts:  # resolve the end offsets now, before anything is produced
            await self.consumer.position(p)
        await self.publish_node_states()
        self._tasks = [asyncio.create_task(self._heartbeat()),
                       asyncio.create_task(self._consume()),
                       asyncio.create_task(self._answer())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.consumer.stop()
        await self.producer.stop()

    async def publish_node_states(self) -> None:
        self._seq += 1
        now = int(time.time() * 1000)
        for state in node_states(self.nodes, self.gpus, self._seq, self._started_ms, now,
                                 self.free_mib):
            await self.producer.send(topics.NODE_STATE.name, state.to_bytes(),
                                     key=state.node_id.encode())
        await self.producer.flush()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(NODE_STATE_PERIOD_S)
            await self.publish_node_states()

    async def _consume(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=100, max_records=10_000)
            now = time.time()
            for records in batches.values():
                for record in records:
                    self._on_record(record, now)

    def _on_record(self, record, now: float) -> None:
        message = json.loads(record.value)
        kind = message.get("type")
        if kind == "rejection":
            self.rejections += 1
            self.sent_at.pop(message["request_id"], None)
            return
        if kind == "preempt":
            self.preempts += 1
            return
        if kind != "placement":
            return
        request = message["request"]
        sent = self.sent_at.pop(request["request_id"], None)
        if sent is not None:
            self.done[request["request_id"]] = (now, (now - sent) * 1000,
                                                float(record.timestamp - request["created_at_ms"]))
        if self.track:
            self.received.append(now)
        if self.answer_usage:
            self._usage.append((now + self.hold_s, usage_bytes(message, int(now * 1000)),
                                request["tenant"].encode()))

    async def _answer(self) -> None:
        """Publish the final usage of every placement whose hold is over, in batches."""
        while True:
            await asyncio.sleep(0.01)
            now = time.time()
            due = []
            while self._usage and self._usage[0][0] <= now:
                due.append(self._usage.popleft())
            if due:
                await self._send(topics.USAGE.name, topics.USAGE.partitions,
                                 [(key, value) for _, value, key in due])

    async def _send(self, topic: str, partitions: int, records: list[tuple[bytes, bytes]]
                    ) -> None:
        """Produce `records` in batches, on partitions in turn."""
        i = 0
        while i < len(records):
            part = self._rr.get(topic, 0)
            self._rr[topic] = (part + 1) % partitions
            i += await send_batch_now(self.producer, topic, part, records[i:])

    async def offer(self, rate_req_s: float, duration_s: float, classes: tuple[str, ...],
                    prefix: str) -> list[str]:
        """Produce `rate_req_s` requests per second for `duration_s`, open loop (a late
        tick catches up: the rate holds whatever the scheduler does); returns their ids."""
        ids: list[str] = []
        t0 = time.monotonic()
        n = 0
        while True:
            elapsed = time.monotonic() - t0
            if elapsed >= duration_s:
                break
            due = int(rate_req_s * elapsed) + 1 - n
            if due > 0:
                now = time.time()
                now_ms = int(now * 1000)
                by_class: dict[str, list[tuple[bytes, bytes]]] = {}
                for i in range(n, n + due):
                    rid = f"{prefix}-{i}"
                    cls = classes[i % len(classes)]
                    self.sent_at[rid] = now
                    ids.append(rid)
                    by_class.setdefault(cls, []).append(
                        (rid.encode(), request_bytes(rid, TENANTS[i % len(TENANTS)], cls,
                                                     now_ms)))
                n += due
                for cls, records in by_class.items():
                    spec = topics.REQUESTS[cls]
                    await self._send(spec.name, spec.partitions, records)
            await asyncio.sleep(0.002)
        return ids

    async def settle(self, ids: list[str], timeout_s: float) -> None:
        """Wait until every request of `ids` is placed (or refused), up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(r in self.sent_at for r in ids[-200:]):
            await asyncio.sleep(0.05)
        while time.monotonic() < deadline and any(r in self.sent_at for r in ids):
            await asyncio.sleep(0.1)

    async def backlog(self) -> int:
        """Requests not yet committed by the schedulers' consumer groups (all classes)."""
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            total = 0
            for cls, spec in topics.REQUESTS.items():
                parts = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
                ends = await self.consumer.end_offsets(parts)
                done = await admin.list_consumer_group_offsets(CONSUMER_GROUP.format(cls),
                                                               partitions=parts)
                total += sum(ends[p] - (done[p].offset if p in done and done[p].offset >= 0
                                        else 0) for p in parts)
            return total
        finally:
            await admin.close()

    async def quiesce(self, timeout_s: float = 180.0) -> int:
        """Wait until the schedulers have committed every request produced so far (a
        backlog is drained) or `timeout_s` passed; returns what is left."""
        deadline = time.monotonic() + timeout_s
        left = await self.backlog()
        while left and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            left = await self.backlog()
        self.sent_at.clear()
        self.done.clear()
        return left


async def send_batch_now(producer: AIOKafkaProducer, topic: str, partition: int,
                         records: list[tuple[bytes, bytes]]) -> int:
    """Produce as many of `records` (key, value) as fit one batch to `partition`; returns
    how many. No per-record futures: the cheapest way aiokafka offers to produce many small
    records. The batch is closed before it is handed over: aiokafka sends a closed batch at
    once, an open one only after the producer's linger, which the requests' latency would
    count although no scheduler is involved yet."""
    batch = producer.create_batch()
    n = 0
    while n < len(records) and batch.append(key=records[n][0], value=records[n][1],
                                            timestamp=None,
                                            headers=routed_headers()) is not None:
        n += 1
    if n == 0 and records:
        raise ValueError(f"a record of {len(records[0][1])} bytes exceeds the batch size")
    batch.close()
    await producer.send_batch(batch, topic, partition=partition)
    return n


# --- processes ----------------------------------------------------------------------------
def machine_steal() -> tuple[int, int]:
    """(steal, all) CPU ticks of this machine so far (/proc/stat); (0, 0) where unknown."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return (ticks[7], sum(ticks)) if len(ticks) == 8 else (0, 0)


def steal_pct(since: tuple[int, int]) -> float:
    """Share (%) of the machine's CPU time the hypervisor gave to others since `since`."""
    (steal0, total0), (steal1, total1) = since, machine_steal()
    return round(100 * (steal1 - steal0) / (total1 - total0), 1) if total1 > total0 else math.nan


class CpuMeter:
    """CPU seconds (user and system) of a set of processes between two reads."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.procs = {k: psutil.Process(p) for k, p in pids.items() if p}
        self.t0 = time.monotonic()
        self.cpu0 = self._read()
        self.wait0 = self._run_queue_total_s()
        self.steal0 = machine_steal()

    def _read(self) -> dict[str, float]:
        out = {}
        for name, proc in self.procs.items():
            try:
                times = proc.cpu_times()
                out[name] = times.user + times.system
            except psutil.Error:
                out[name] = math.nan
        return out

    def seconds(self) -> tuple[float, dict[str, float]]:
        now = self._read()
        return time.monotonic() - self.t0, {k: now[k] - self.cpu0.get(k, 0.0) for k in now}

    def steal_pct(self) -> float:
        """Share (%) of the machine's CPU time its host gave to others since this meter
        started."""
        return steal_pct(self.steal0)

    def run_queue_s(self) -> dict[str, float]:
        """Seconds each process's main thread waited for a CPU while runnable since this
        meter started (/proc schedstat): time a busy, shared machine took from it."""
        now = self._run_queue_total_s()
        return {k: v - self.wait0[k] for k, v in now.items() if k in self.wait0}

    def _run_queue_total_s(self) -> dict[str, float]:
        out = {}
        for name, proc in self.procs.items():
            try:
                stat = Path(f"/proc/{proc.pid}/task/{proc.pid}/schedstat").read_text()
                waited = int(stat.split()[1]) / 1e9
            except (OSError, ValueError, IndexError):
                continue
            out[name] = waited
        return out


class Bench:
    """The stack, the scheduler instances and the fake fleet of one benchmark run."""

    def __init__(self, args: argparse.Namespace) -> None:
        from gpusched_ops.stack import LocalStack, StackPorts, default_cache_dir

        self.args = args
        b = args.port_base
        self.own = args.kafka is None
        self.run_dir = default_cache_dir() / "bench-scheduler"
        if self.own:
            shutil.rmtree(self.run_dir, ignore_errors=True)  # fresh topics and Redis
        self.stack = LocalStack(self.run_dir, StackPorts(
            kafka=b, kafka_controller=b + 1, redis=b + 2, jaeger_otlp_grpc=b + 3,
            jaeger_otlp_http=b + 4, jaeger_query=b + 5))
        self.http_ports = (b + 10, b + 11)
        self.bootstrap = args.kafka or self.stack.endpoints().kafka_bootstrap
        self.redis_url = args.redis or self.stack.endpoints().redis_url
        self.otlp = self.stack.endpoints().otlp_http_endpoint if args.tracing else ""
        self.fleet: FakeFleet | None = None
        self.started: list[str] = []

    # processes
    def start_infra(self) -> None:
        if not self.own:
            return
        print("starting Kafka and Redis for the benchmark ...", flush=True)
        self.stack.install()
        self.stack.start_component("kafka")
        self.stack.start_component("redis")
        if self.args.tracing:
            self.stack.start_component("jaeger")

    def start_scheduler(self, i: int, extra_env: dict[str, str] | None = None) -> None:
        from gpusched_ops.stack import ServiceSpec

        port = self.http_ports[i]
        env = {"GPUSCHED_KAFKA_BOOTSTRAP": self.bootstrap, "GPUSCHED_REDIS_URL": self.redis_url,
               "GPUSCHED_OTLP_ENDPOINT": self.otlp, "GPUSCHED_HTTP_PORT": str(port),
               "GPUSCHED_LOG_LEVEL": "WARNING", "GPUSCHED_INSTANCE_ID": SCHEDULERS[i],
               "GPUSCHED_FETCH_MAX_RECORDS": str(self.args.fetch_max_records),
               # the fake fleet never lists placements as active (it answers with usage),
               # so a long full-fleet phase must not read as placements never taken
               "GPUSCHED_UNTAKEN_TIMEOUT_S": "3600",
               **({"GPUSCHED_CYCLE_WINDOW_MS": str(self.args.window_ms)}
                  if self.args.window_ms is not None else {}),
               **(extra_env or {})}
        module = "gpusched_scheduler.bench.scheduler" if "GPUSCHED_BENCH_PROFILE" in env \
            else "gpusched_scheduler"
        self.stack.start_service(ServiceSpec(
            name=SCHEDULERS[i], module=module, env=env,
            health_url=f"http://127.0.0.1:{port}/healthz"), timeout_s=300)
        self.started.append(SCHEDULERS[i])

    def stop_scheduler(self, i: int) -> None:
        self.stack.stop_service(SCHEDULERS[i], timeout_s=30)
        if SCHEDULERS[i] in self.started:
            self.started.remove(SCHEDULERS[i])

    def stop_all(self) -> None:
        for name in list(self.started):
            self.stack.stop_service(name, timeout_s=30)
        self.started.clear()
        if self.own:
            self.stack.stop()

    def pids(self) -> dict[str, int | None]:
        status = {s.name: s.pid for s in self.stack.status()}
        out = {"bench": os.getpid(), "kafka": status.get("kafka") if self.own else None}
        for name in SCHEDULERS:
            if name in self.started:
                out[name] = status.get(name)
        return out

    def rss_mib(self, i: int = 0) -> float:
        status = {s.name: s.rss_mib for s in self.stack.status()}
        return status.get(SCHEDULERS[i]) or math.nan

    async def cluster(self, i: int = 0) -> dict:
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(f"http://127.0.0.1:{self.http_ports[i]}/v1/cluster")
            return response.json()

    async def cycle_metrics(self, i: int = 0) -> dict[str, float]:
        async with httpx.AsyncClient(timeout=5.0) as client:
            text = (await client.get(f"http://127.0.0.1:{self.http_ports[i]}/metrics")).text
        return metric_sums(text, CYCLE_METRICS)

    def leader_changes(self) -> int:
        """How often the first instance stepped down so far (from its log)."""
        try:
            log = self.stack.log_path(SCHEDULERS[0]).read_text(errors="replace")
        except FileNotFoundError:
            return 0
        return log.count("stepping down as leader")

    async def prime(self, timeout_s: float = 180) -> None:
        """Send a trickle until each class has been placed (the leader has joined its
        consumer groups and compiled what its first cycles need), then settle."""
        fleet = self.fleet
        assert fleet is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ids = await fleet.offer(30, 1.0, topics_classes(), f"prime-{time.time_ns()}")
            await fleet.settle(ids, 3.0)
            if all(r in fleet.done for r in ids):
                break
        else:
            raise RuntimeError(f"the scheduler placed nothing in {timeout_s} s; see "
                               f"{self.stack.log_path(SCHEDULERS[0])}")
        ids = await fleet.offer(200, 2.0, topics_classes(), f"prime-{time.time_ns()}")
        await fleet.settle(ids, 10.0)
        fleet.sent_at.clear()
        fleet.done.clear()

    async def wait_ready(self, i: int, leader: bool, timeout_s: float = 120) -> None:
        """Until instance `i` sees the whole fleet live (and leads, when `leader`)."""
        deadline = time.monotonic() + timeout_s
        view: dict = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                view = await self.cluster(i)
                live = sum(1 for n in view["nodes"] if n["live"]
                           and n["node_id"].startswith("bench-node-"))
                if live >= self.args.nodes and view["leader"] == leader:
                    return
            await asyncio.sleep(0.25)
        raise RuntimeError(f"{SCHEDULERS[i]} did not become ready (leader={leader}, all "
                           f"{self.args.nodes} bench nodes live) in {timeout_s} s; last view: "
                           f"leader={view.get('leader')}, nodes={len(view.get('nodes', []))}; "
                           f"see {self.stack.log_path(SCHEDULERS[i])}")

    # phases
    async def step(self, rate: int, duration_s: float, prefix: str) -> Step:
        fleet = self.fleet
        assert fleet is not None
        warm = await fleet.offer(rate, self.args.warmup_s, topics_classes(), f"{prefix}-w")
        fleet.track, fleet.received = True, []
        meter = CpuMeter(self.pids())
        metrics0, changes0 = await self.cycle_metrics(), self.leader_changes()
        t0 = time.time()
        ids = await fleet.offer(rate, duration_s, topics_classes(), prefix)
        t1 = time.time()
        wall_s, cpu = meter.seconds()
        waited = meter.run_queue_s()
        steal = meter.steal_pct()
        fleet.track = False
        metrics = await self.cycle_metrics()
        cycles = metrics[CYCLE_METRICS[0]] - metrics0[CYCLE_METRICS[0]]
        cycle_s = metrics[CYCLE_METRICS[1]] - metrics0[CYCLE_METRICS[1]]
        solver_s = metrics[CYCLE_METRICS[2]] - metrics0[CYCLE_METRICS[2]]
        await fleet.settle(ids, timeout_s=max(5.0, duration_s))
        window = [t for t in fleet.received if t0 <= t < t1]
        lat = sorted(fleet.done[r][1] for r in ids if r in fleet.done)
        sched = sorted(fleet.done[r][2] for r in ids if r in fleet.done)
        missing = sum(1 for r in ids if r not in fleet.done)
        for r in (*warm, *ids):
            fleet.done.pop(r, None)
        sched_cpu = sum(v for k, v in cpu.items() if k.startswith("scheduler"))
        step = Step(
            offered_req_s=rate, sent_req_s=round(len(ids) / (t1 - t0), 1),
            placements_per_s=round(len(window) / (t1 - t0), 1),
            p50_ms=round(percentile(lat, 0.5), 2), p99_ms=round(percentile(lat, 0.99), 2),
            max_ms=round(lat[-1], 2) if lat else math.nan,
            scheduler_p99_ms=round(percentile(sched, 0.99), 1), measured=len(ids),
            missing=missing, scheduler_cpu_pct=round(100 * sched_cpu / wall_s, 1),
            bench_cpu_pct=round(100 * cpu.get("bench", math.nan) / wall_s, 1),
            kafka_cpu_pct=round(100 * cpu.get("kafka", math.nan) / wall_s, 1),
            scheduler_cpu_us_per_placement=round(1e6 * sched_cpu / max(len(window), 1)),
            scheduler_cpu_wait_pct=round(100 * waited.get(SCHEDULERS[0], math.nan) / wall_s, 1),
            steal_pct=steal,
            cycles_per_s=round(cycles / wall_s, 1),
            cycle_mean_ms=round(1000 * cycle_s / max(cycles, 1), 2),
            solver_mean_ms=round(1000 * solver_s / max(cycles, 1), 2),
            leader_changes=self.leader_changes() - changes0)
        if missing:
            left = await fleet.quiesce()
            if left:
                print(f"  {left} requests still waiting after 180 s; later steps start with "
                      "that backlog", flush=True)
        return step

    async def ramp(self, label: str) -> list[Step]:
        steps: list[Step] = []
        print(f"\n{label}: rate ramp ({self.args.step_s:g} s per step after "
              f"{self.args.warmup_s:g} s warm-up)")
        print(f"{'offered/s':>10}{'sent/s':>9}{'placed/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
              f"{'max ms':>9}{'sched p99':>10}{'missing':>8}{'sched cpu':>10}{'bench cpu':>10}"
              f"{'kafka cpu':>10}{'us/place':>9}{'cpu wait':>9}{'cycles/s':>9}{'cycle ms':>9}"
              f"{'solve ms':>9}{'steal':>7}")
        for rate in self.args.rates:
            s = await self.step(rate, self.args.step_s, f"{label[:1]}{rate}-{time.time_ns()}")
            steps.append(s)
            print(f"{s.offered_req_s:>10}{s.sent_req_s:>9.0f}{s.placements_per_s:>10.0f}"
                  f"{s.p50_ms:>9.1f}{s.p99_ms:>9.1f}{s.max_ms:>9.1f}{s.scheduler_p99_ms:>10.0f}"
                  f"{s.missing:>8}{s.scheduler_cpu_pct:>9.0f}%{s.bench_cpu_pct:>9.0f}%"
                  f"{s.kafka_cpu_pct:>9.0f}%{s.scheduler_cpu_us_per_placement:>9.0f}"
                  f"{s.scheduler_cpu_wait_pct:>8.0f}%{s.cycles_per_s:>9.0f}{s.cycle_mean_ms:>9.2f}{s.solver_mean_ms:>9.2f}"
                  f"{s.steal_pct:>6.0f}%"
                  f"{'' if s.ok else '  <- not sustained'}"
                  f"{'' if not s.leader_changes else '  (leader lease lapsed)'}", flush=True)
            if not s.ok and rate > TARGET_RATE_REQ_S:
                break
        return steps

    async def soak(self, seconds: float) -> dict:
        """500 requests/s for `seconds` on the freshly started leader; RSS every 10 s."""
        fleet = self.fleet
        assert fleet is not None
        print(f"\nsoak: {TARGET_RATE_REQ_S} requests/s for {seconds:g} s on the fresh leader",
              flush=True)
        await fleet.offer(TARGET_RATE_REQ_S, 10.0, topics_classes(), f"soakw-{time.time_ns()}")
        start = self.rss_mib()
        series = [start]
        p99_series: list[float] = []
        lat: list[float] = []
        prefix = f"soak-{time.time_ns()}"
        done = 0.0
        outstanding: list[str] = []  # sent, not placed yet: counted whenever they are

        def placed_since() -> list[float]:
            nonlocal outstanding
            got = [fleet.done.pop(r)[1] for r in outstanding if r in fleet.done]
            outstanding = [r for r in outstanding if r in fleet.sent_at]  # not answered yet
            return sorted(got)

        while done < seconds:
            chunk = min(10.0, seconds - done)
            ids = await fleet.offer(TARGET_RATE_REQ_S, chunk, topics_classes(),
                                    f"{prefix}-{int(done)}")
            outstanding += ids
            done += chunk
            await fleet.settle(ids[-50:], 5.0)
            chunk_lat = placed_since()
            lat += chunk_lat
            series.append(self.rss_mib())
            p99_series.append(round(percentile(chunk_lat, 0.99), 1))
            print(f"  {done:6.0f} s  rss {series[-1]:7.1f} MiB  placed {len(lat)}  "
                  f"p99 {p99_series[-1]:g} ms", flush=True)
        await fleet.settle(outstanding, 30.0)
        lat += placed_since()
        missing = len(outstanding)
        lat.sort()
        fleet.done.clear()
        end = series[-1]
        return {"seconds": seconds, "rate_req_s": TARGET_RATE_REQ_S, "rss_mib_start": start,
                "rss_mib_end": end, "rss_growth": round(end / start - 1, 4),
                "rss_mib_series_10s": series, "p99_ms_series_10s": p99_series,
                "placed": len(lat), "missing": missing,
                "p50_ms": round(percentile(lat, 0.5), 2),
                "p99_ms": round(percentile(lat, 0.99), 2)}

    async def full_fleet(self, seconds: float) -> dict:
        """Shrink every GPU to room for two requests, stop answering usage, keep producing:
        the scheduler's pending work must stay within its fetch bound per class."""
        fleet = self.fleet
        assert fleet is not None
        print(f"\nfull fleet: {self.args.full_rate} requests/s for {seconds:g} s, no usage "
              f"answers, {2 * self.args.nodes * self.args.gpus} placements fill the fleet",
              flush=True)
        fleet.answer_usage = False
        fleet.free_mib = 2 * request_kv_mib()
        await fleet.publish_node_states()
        await asyncio.sleep(0.5)
        rss_start = self.rss_mib()
        placed_before = len(fleet.done)
        samples: list[dict] = []

        async def sample() -> None:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    view = await self.cluster()
                    samples.append({"pending": view["pending"], "running": view["running"],
                                    "reservations": view["reservations"]})
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample())
        try:
            ids = await fleet.offer(self.args.full_rate, seconds, ("standard", "batch"),
                                    f"full-{time.time_ns()}")
            await asyncio.sleep(1.0)
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        max_pending = {c: max((s["pending"].get(c, 0) for s in samples), default=0)
                       for c in ("interactive", "standard", "batch")}
        placed = sum(1 for r in ids if r in fleet.done)
        bound = self.args.fetch_max_records
        return {"seconds": seconds, "rate_req_s": self.args.full_rate, "sent": len(ids),
                "placed": placed, "placed_before": placed_before,
                "waiting_in_kafka_or_memory": len(ids) - placed,
                "max_pending_per_class": max_pending,
                "final": samples[-1] if samples else None, "bound_per_class": bound,
                "bounded": all(v <= bound for v in max_pending.values()),
                "rss_mib_start": rss_start, "rss_mib_end": self.rss_mib()}


def topics_classes() -> tuple[str, ...]:
    return tuple(topics.REQUESTS)


# --- baseline: the engine alone ---------------------------------------------------------
def _record(topic: str, offset: int, value: bytes, key: bytes | None = None) -> ConsumerRecord:
    return ConsumerRecord(topic, 0, offset, int(time.time() * 1000), 0, key, value, None, 0,
                          len(value), tuple(routed_headers()))


def routed_headers() -> list[tuple[str, bytes]]:
    """The trace header a router gives each request record (a sampled W3C traceparent of a
    trace of its own): a record without one has the scheduler begin its trace with an
    `admit` span, which requests that came through a router do not cost it."""
    return [("traceparent",
             f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01".encode())]


async def engine_only(nodes: int, gpus: int, batch: int, rounds: int,
                      profile: Path | None = None) -> dict:
    """Placements/s of the scheduler's engine in this process with Kafka taken away: each
    round admits `batch` records per class, runs cycles until they are placed (publish is a
    no-op, tracing on, no Redis) and releases them with final usage records."""
    from opentelemetry.sdk.trace import TracerProvider

    from gpusched_common.catalog import load_tenants
    from gpusched_scheduler.domain.planner import warm_up
    from gpusched_scheduler.engine import EngineConfig, SchedulingEngine

    # Compile (or load) the kernels first, as the service does before it reports ready: a
    # cold numba cache takes longer than a node report stays fresh, and nothing would fit.
    warm_up(EngineConfig().policy)

    async def publish(batch):
        sent.extend(out.message for out in batch)
        return asyncio.gather()  # acknowledged at once

    sent: list = []
    engine = SchedulingEngine(
        load_models(REPO_CONFIG_DIR), load_tenants(REPO_CONFIG_DIR), publish,
        lambda: int(time.time() * 1000), TracerProvider().get_tracer("bench"),
        EngineConfig(cycle_window_ms=0))
    now = int(time.time() * 1000)
    await engine.node_states([_record(topics.NODE_STATE.name, i, s.to_bytes(), s.node_id.encode())
                        for i, s in enumerate(node_states(nodes, gpus, 1, now, now, None))])
    engine.lead(1, [])
    profiler = None
    if profile is not None:
        import cProfile
        profiler = cProfile.Profile()
    placed = 0
    elapsed = 0.0
    for r in range(rounds + 1):  # round 0 warms up (kernels, caches)
        now = int(time.time() * 1000)
        records = {cls: [_record(spec.name, i, request_bytes(
            f"e{r}-{cls}-{i}", TENANTS[i % len(TENANTS)], cls, now)) for i in range(batch)]
            for cls, spec in topics.REQUESTS.items()}
        sent.clear()
        if r == 1 and profiler is not None:
            profiler.enable()
        started = time.perf_counter()
        for recs in records.values():
            await engine.admit(recs)
        while len(engine.queue):
            await engine.cycle()
        usage = [_record(topics.USAGE.name, i, usage_bytes(json.loads(m.to_bytes()), now))
                 for i, m in enumerate(sent) if m.type == "placement"]
        await engine.usage(usage)
        if r:
            elapsed += time.perf_counter() - started
            placed += len(usage)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(str(profile))
    return {"placements_per_s": round(placed / elapsed), "placements": placed,
            "batch_per_class": batch, "us_per_placement": round(1e6 * elapsed / placed, 1)}


LIVE_CYCLE_PER_CLASS = 2
"""At 500 requests/s a cycle places about 5-6 requests (~90 cycles/s): the engine-alone
baseline at that size shows what a cycle's fixed costs add to each placement."""


# --- baseline: Kafka alone ---------------------------------------------------------------
ECHO_IN = topics.TopicSpec("gpusched.bench.echo-in", key="request id", partitions=3,
                           retention_ms=3600_000)
ECHO_OUT = topics.TopicSpec("gpusched.bench.echo-out", key="node id", partitions=6,
                            retention_ms=3600_000)


async def kafka_echo(bootstrap: str, rate_req_s: int, seconds: float) -> dict:
    """The latency floor of the scheduler's path with scheduling taken away: records go
    in at `rate_req_s` (three producers' worth of topics collapsed into one), an echo task
    consumes each batch as it arrives and produces it again with the scheduler's producer
    settings, and a third consumer measures publish -> echo received, both hops. Also the
    CPU time its clients spent per record (this process does nothing else meanwhile but the
    fleet's heartbeat): what aiokafka alone costs for a record's path."""
    await topics.ensure_topics(bootstrap, (ECHO_IN, ECHO_OUT))
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0,
                                enable_idempotence=True)
    echo_out = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0,
                                enable_idempotence=True, max_batch_size=1 << 20)
    echo_in = AIOKafkaConsumer(ECHO_IN.name, bootstrap_servers=bootstrap, group_id=None,
                               auto_offset_reset="latest", enable_auto_commit=False)
    sink = AIOKafkaConsumer(ECHO_OUT.name, bootstrap_servers=bootstrap, group_id=None,
                            auto_offset_reset="latest", enable_auto_commit=False)
    clients = (producer, echo_out, echo_in, sink)
    for client in clients:
        await client.start()
    latencies: list[float] = []
    measuring = False

    async def echo() -> None:
        while True:
            batches = await echo_in.getmany(timeout_ms=1000)
            for records in batches.values():
                for r in records:
                    await echo_out.send(ECHO_OUT.name, r.value, key=r.key)

    async def receive() -> None:
        while True:
            batches = await sink.getmany(timeout_ms=1000)
            now = time.time()
            if measuring:
                latencies.extend((now - float(r.value)) * 1000
                                 for records in batches.values() for r in records)

    tasks = [asyncio.create_task(echo()), asyncio.create_task(receive())]
    cpu0 = None
    try:
        await asyncio.sleep(1.0)  # both consumers positioned at the end
        t0 = time.monotonic()
        n = 0
        while (elapsed := time.monotonic() - t0) < seconds + 1.0:
            measuring = elapsed >= 1.0  # the first second warms up
            if measuring and cpu0 is None:
                cpu0 = time.process_time()
            for _ in range(int(rate_req_s * elapsed) + 1 - n):
                await producer.send(ECHO_IN.name, repr(time.time()).encode(),
                                    key=str(n).encode())
                n += 1
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.5)
        cpu_s = time.process_time() - (cpu0 or 0.0)
    finally:
        for task in tasks:
            task.cancel()
        for client in clients:
            await client.stop()
    latencies.sort()
    return {"rate_req_s": rate_req_s, "records": len(latencies),
            "p50_ms": round(percentile(latencies, 0.50), 1),
            "p99_ms": round(percentile(latencies, 0.99), 1),
            "cpu_us_per_record": round(1e6 * cpu_s / max(len(latencies), 1))}


# --- entry points -------------------------------------------------------------------------
async def run(bench: Bench) -> dict:
    args = bench.args
    await topics.ensure_topics(bench.bootstrap)
    bench.fleet = FakeFleet(bench.bootstrap, args.nodes, args.gpus, args.hold_ms)
    await bench.fleet.start()
    result: dict = {"fleet": {"nodes": args.nodes, "gpus_per_node": args.gpus,
                              "gpu_type": GPU_TYPE, "model": MODEL},
                    "hold_ms": args.hold_ms, "tracing_export": args.tracing,
                    "window_ms": args.window_ms, "instances": {},
                    "cpu_count": os.cpu_count(),
                    "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}
    if args.warm_broker_s:
        print(f"warming the broker: {args.warm_broker_s:g} s of Kafka echo traffic at "
              f"{BROKER_WARM_RATE:,} records/s (unmeasured)", flush=True)
        await kafka_echo(bench.bootstrap, BROKER_WARM_RATE, args.warm_broker_s)
    result["broker_warm_s"] = args.warm_broker_s
    base = await engine_only(args.nodes, args.gpus, args.fetch_max_records,
                             3 if args.quick else 10)
    result["engine_only"] = base
    print(f"baseline: the engine alone in this process (no Kafka, no Redis): "
          f"{base['placements_per_s']:,} placements/s, {base['us_per_placement']} us each, "
          f"{args.fetch_max_records} pending per class per round", flush=True)
    small = await engine_only(args.nodes, args.gpus, LIVE_CYCLE_PER_CLASS,
                              100 if args.quick else 1000)
    result["engine_only_live_cycle"] = small
    print(f"baseline: the engine alone with {LIVE_CYCLE_PER_CLASS} per class per round (about "
          f"a cycle's work at {TARGET_RATE_REQ_S}/s): {small['placements_per_s']:,} "
          f"placements/s, {small['us_per_placement']} us each (the ramps' us/place adds "
          f"Kafka, Redis and telemetry clients to this)", flush=True)
    since = machine_steal()
    echo = await kafka_echo(bench.bootstrap, TARGET_RATE_REQ_S, args.step_s)
    echo["steal_pct"] = steal_pct(since)
    result["kafka_echo"] = echo
    print(f"baseline: Kafka alone, publish -> echo -> consume (two hops, no scheduling) at "
          f"{echo['rate_req_s']}/s: p50 {echo['p50_ms']} ms, p99 {echo['p99_ms']} ms "
          f"({echo['steal_pct']:g}% of the machine's CPU time stolen by its host meanwhile); "
          f"its aiokafka clients (publish, consume, publish again, consume; one process) used "
          f"{echo['cpu_us_per_record']:,} us of CPU per record",
          flush=True)
    try:
        profile_env = {"GPUSCHED_BENCH_PROFILE": str(args.profile)} if args.profile else {}
        bench.start_scheduler(0, profile_env)
        await bench.wait_ready(0, leader=True)
        await bench.prime()
        if args.soak:
            result["soak"] = await bench.soak(args.soak)
            await bench.fleet.quiesce()
        for count in args.instances:
            if count == 2:
                bench.start_scheduler(1)
                await bench.wait_ready(1, leader=False)
            steps = await bench.ramp(f"{count} instance{'s' if count > 1 else ''}")
            best = sustained(steps)
            at_target = next((s for s in steps if s.offered_req_s == TARGET_RATE_REQ_S), None)
            result["instances"][str(count)] = {
                "steps": [asdict(s) | {"ok": s.ok} for s in steps],
                "sustained_placements_per_s": best.placements_per_s if best else 0.0,
                "sustained_offered_req_s": best.offered_req_s if best else 0,
                "at_target_rate": asdict(at_target) if at_target else None}
            if count == 2:
                bench.stop_scheduler(1)
        if args.profile:
            bench.stop_scheduler(0)
            print_profile(args.profile)
            bench.start_scheduler(0)
            await bench.wait_ready(0, leader=True)
            await bench.prime()
        if args.full_s:
            await bench.fleet.quiesce()
            result["full_fleet"] = await bench.full_fleet(args.full_s)
    finally:
        result["rejections"] = bench.fleet.rejections
        result["preempts"] = bench.fleet.preempts
        await bench.fleet.stop()
    return result


def print_profile(path: Path, top: int = 30) -> None:
    import pstats

    if not path.exists():
        print(f"no profile at {path} (the scheduler did not exit cleanly)")
        return
    print(f"\nscheduler profile ({path}), top {top} by own time:")
    pstats.Stats(str(path)).sort_stats("tottime").print_stats(top)
    pstats.Stats(str(path)).sort_stats("cumulative").print_stats(top)


def report(result: dict) -> None:
    one = result["instances"].get("1")
    two = result["instances"].get("2")
    print(f"\n{'':46}{'placements/s':>13}{'p50 ms':>9}{'p99 ms':>9}   at {TARGET_RATE_REQ_S}/s")
    for label, r in (("1 scheduler instance", one), ("2 instances (leader + hot standby)", two)):
        if r is None:
            continue
        t = r["at_target_rate"] or {}
        print(f"{label:46}{r['sustained_placements_per_s']:>13,.0f}"
              f"{t.get('p50_ms', math.nan):>9.1f}{t.get('p99_ms', math.nan):>9.1f}")
    if base := result.get("engine_only"):
        print(f"{'baseline: engine alone, no Kafka/Redis':46}{base['placements_per_s']:>13,}")
    if echo := result.get("kafka_echo"):
        print(f"{'baseline: Kafka echo, two hops, no scheduler':46}{'':>13}"
              f"{echo['p50_ms']:>9.1f}{echo['p99_ms']:>9.1f}")
    print(f"{'reference: kube-scheduler CI floor (published)':46}{KUBE_SCHEDULER_PODS_PER_S:>13,}")
    print(f"targets: p99 <= {TARGET_P99_MS:g} ms at {TARGET_RATE_REQ_S}/s -> "
          f"{'met' if result['targets']['p99_at_500'] else 'MISSED'}; sustained >= "
          f"{TARGET_SUSTAINED_PER_S:,}/s -> "
          f"{'met' if result['targets']['sustained_2000'] else 'MISSED'} (sustained: p99 <= "
          f"{P99_LIMIT_MS:g} ms and placed/s >= {ACHIEVED_MIN_RATIO:.0%} of offered)")
    if soak := result.get("soak"):
        print(f"soak {soak['seconds']:g} s at {soak['rate_req_s']}/s: RSS {soak['rss_mib_start']}"
              f" -> {soak['rss_mib_end']} MiB ({soak['rss_growth']:+.1%}, target < +10%), "
              f"p99 {soak['p99_ms']} ms, {soak['missing']} never placed")
    if full := result.get("full_fleet"):
        print(f"full fleet: sent {full['sent']:,}, placed {full['placed']:,}, max pending per "
              f"class {full['max_pending_per_class']} (bound {full['bound_per_class']}: "
              f"{'bounded' if full['bounded'] else 'NOT BOUNDED'}), RSS "
              f"{full['rss_mib_start']} -> {full['rss_mib_end']} MiB")


# the schedulers' settings the bench passes on, read with the service's own bounds (NaN
# named as such, not as a number above the window's bound)
FETCH_MAX_RECORDS = Annotated[int, SchedulerSettings.model_fields["fetch_max_records"]]
CYCLE_WINDOW_MS = Annotated[float, SchedulerSettings.model_fields["cycle_window_ms"],
                            Field(allow_inf_nan=False)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpusched bench scheduler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="Write the results here.")
    parser.add_argument("--quick", action="store_true",
                        help="Under a minute: 500 and 1000/s, one instance, short full phase.")
    parser.add_argument("--soak", type=option(Duration), default=0.0, metavar="SECONDS",
                        help="Also run 500 requests/s this long on a fresh leader and report "
                        "its RSS at start and end (600 for the 10-minute target).")
    parser.add_argument("--rates", type=option(comma_list(Count)),
                        default="250,500,1000,1500,2000,2500,3000,4000,5000",
                        help="Offered requests/s of the ramp; it stops after the first rate "
                        "above 500/s that is not sustained.")
    parser.add_argument("--step-s", type=option(PositiveDuration), default=8.0,
                        help="Measured seconds per rate.")
    parser.add_argument("--warmup-s", type=option(Duration), default=2.0,
                        help="Unmeasured seconds at each rate before measuring.")
    parser.add_argument("--instances", type=option(comma_list(Annotated[int, Field(ge=1, le=2)])),
                        default="1,2", help="Runs with 1 and/or 2 schedulers.")
    parser.add_argument("--warm-broker-s", type=option(Duration), default=60.0,
                        help="Unmeasured seconds of Kafka traffic (the echo baseline's clients "
                        f"at {BROKER_WARM_RATE:,}/s) before anything is measured, so that the "
                        "broker's JIT compiler has compiled its hot code, as in a broker that "
                        "has been running a while.")
    parser.add_argument("--nodes", type=option(Count), default=64)
    parser.add_argument("--gpus", type=option(Count), default=8, help="GPUs per node (H100-80GB).")
    parser.add_argument("--hold-ms", type=option(Duration), default=200.0,
                        help="How long a placement runs before its final usage is published.")
    parser.add_argument("--full-s", type=option(Duration), default=20.0,
                        help="Seconds of the full-fleet phase (0 skips it).")
    parser.add_argument("--full-rate", type=option(Count), default=TARGET_RATE_REQ_S)
    parser.add_argument("--fetch-max-records", type=option(FETCH_MAX_RECORDS), default=256,
                        help="GPUSCHED_FETCH_MAX_RECORDS of the schedulers (the pending bound).")
    parser.add_argument("--window-ms", type=option(CYCLE_WINDOW_MS), default=None,
                        help="GPUSCHED_CYCLE_WINDOW_MS of the schedulers (service default 2).")
    parser.add_argument("--tracing", action="store_true", help="Start Jaeger and export the "
                        "schedulers' spans to it (default: spans are made, not exported).")
    parser.add_argument("--profile", type=Path, default=None, help="Run the leader under "
                        "cProfile during the ramps; print the profile and write it here.")
    parser.add_argument("--kafka", default=None, help="Use this running Kafka (and --redis); "
                        "the stack must run no scheduler of its own.")
    parser.add_argument("--redis", default=None, help="Redis URL of that running stack.")
    parser.add_argument("--port-base", type=option(port_base(12)),
                        default=31192, help="Kafka of the bench's own "
                        "stack listens here; the controller, Redis, Jaeger and the schedulers "
                        "use the next 12 ports (all below Linux's ephemeral range, 32768 up, "
                        "which client sockets draw from).")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.step_s, args.warmup_s, args.instances = [500, 1000], 3.0, 1.0, [1]
        args.warm_broker_s = 0.0
        args.full_s = min(args.full_s, 5.0)
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.unlink(missing_ok=True)
    bench = Bench(args)
    started = time.monotonic()
    _interrupt_on_signals()
    try:
        bench.start_infra()
        result = asyncio.run(run(bench))
    except KeyboardInterrupt:
        print("interrupted; stopping what the benchmark started", flush=True)
        return 130
    finally:
        bench.stop_all()
    one = result["instances"].get("1", {})
    at = one.get("at_target_rate") or {}
    result |= {
        "placements_per_s": one.get("sustained_placements_per_s", 0.0),
        "rate_req_s": TARGET_RATE_REQ_S, "p50_ms": at.get("p50_ms"), "p99_ms": at.get("p99_ms"),
        "kube_scheduler_reference_pods_per_s": KUBE_SCHEDULER_PODS_PER_S,
        "wall_s": round(time.monotonic() - started, 1)}
    soak = result.get("soak")
    result["targets"] = {
        "p99_at_500": at.get("p99_ms") is not None and at["p99_ms"] <= TARGET_P99_MS,
        "sustained_2000": one.get("sustained_offered_req_s", 0) >= TARGET_SUSTAINED_PER_S,
        "rss_growth_under_10pct": None if soak is None else soak["rss_growth"] < TARGET_RSS_GROWTH,
        "soak_all_placed": None if soak is None else soak["missing"] == 0,
        "pending_bounded": result.get("full_fleet", {}).get("bounded")}
    if soak:
        result["rss_mib_start"], result["rss_mib_end"] = soak["rss_mib_start"], soak["rss_mib_end"]
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _interrupt_on_signals() -> None:
    """SIGTERM and SIGINT (even when started in the background, where SIGINT is ignored)
    raise KeyboardInterrupt, so the finally clauses stop what the benchmark started."""
    import signal

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


def _serve_profiled() -> None:
    """The scheduler service under cProfile; the profile is written when it stops."""
    import cProfile
    import signal
    import sys

    from gpusched_common.web import serve
    from gpusched_scheduler.main import create_app
    from gpusched_scheduler.settings import SchedulerSettings

    settings = SchedulerSettings()
    app = create_app(settings)
    # uvicorn re-raises the SIGTERM it caught once it has shut down: exit through Python
    # then, so the profile below is written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        serve(app, settings)
    finally:
        profiler.disable()
        profiler.dump_stats(os.environ["GPUSCHED_BENCH_PROFILE"])


if __name__ == "__main__":
    _serve_profiled()
