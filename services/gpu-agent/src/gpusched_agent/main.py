"""GPU agent service: discovers GPUs, builds the executor, wires the runtime to Kafka, Redis
and telemetry; SIGTERM drains (see `AgentRuntime.drain`)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge

from gpusched_agent import handlers
from gpusched_agent.adapters import nvml
from gpusched_agent.adapters.executor import Executor
from gpusched_agent.adapters.ledger import RedisLedger
from gpusched_agent.adapters.simulated import SimulatedExecutor
from gpusched_agent.domain.inventory import GpuInfo, Inventory, build_inventory, simulated_reading
from gpusched_agent.domain.node import NodeModel
from gpusched_agent.runtime import AgentRuntime, ReadInventory
from gpusched_agent.settings import AgentSettings
from gpusched_common import topics
from gpusched_common.broker import make_broker
from gpusched_common.catalog import load_models
from gpusched_common.consumer_lag import ConsumerLag
from gpusched_common.contracts import Message
from gpusched_common.kafka_records import WallClockMs, wall_clock_ms
from gpusched_common.recent import Recent
from gpusched_common.redis_client import make_redis
from gpusched_common.tasks import cancelled
from gpusched_common.telemetry import make_tracer_provider
from gpusched_common.web import add_ops_routes, get_and_head

log = logging.getLogger(__name__)
SERVICE = "gpu-agent"


def discover_inventory(settings: AgentSettings, nvml_module: Any = None
                       ) -> tuple[Inventory, ReadInventory]:
    """The inventory (simulated when configured, else NVML's GPUs) and how to re-read it for
    heartbeats; a clear error when neither gives any GPU. With the openai executor, memory
    in use on NVML's GPUs at start is its inference server's (vLLM pre-allocates
    `gpu_memory_utilization` of each GPU), the memory gpusched schedules, so none is held
    back as another process's; the other executors run in the agent, and memory in use
    when it starts is someone else's."""
    if settings.simulate:
        spec, node_id = settings.simulate, settings.node_id
        inventory = build_inventory(simulated_reading(spec, node_id))

        async def read_simulated() -> Sequence[GpuInfo]:
            return inventory.gpus

        return inventory, read_simulated
    reserve = settings.executor != "openai"
    module = nvml_module if nvml_module is not None else nvml.load_pynvml()
    reading = nvml.discover(module) if module is not None else None
    if reading is None:
        raise ValueError("no GPU found through NVML; set GPUSCHED_SIMULATE (e.g. 8xH100-80GB) "
                         "to run with a simulated inventory")

    async def read_nvml() -> Sequence[GpuInfo]:
        again = await asyncio.to_thread(nvml.discover, module)
        return build_inventory(again, reserve).gpus if again is not None else ()

    return build_inventory(reading, reserve), read_nvml


def make_executor(settings: AgentSettings, inventory: Inventory | None = None) -> Executor:
    """The executor the settings select; torch is imported only when it is selected. On
    NVML's `inventory` (not a simulated one), torch on CUDA must see the same GPUs in the
    same order, and GPUSCHED_TORCH_DEVICE=auto must find CUDA, or the agent does not
    start."""
    if settings.executor == "torch":
        try:
            from gpusched_agent.adapters.torch_executor import TorchExecutor
            from gpusched_agent.adapters.torch_model import TinyConfig
        except ImportError as exc:
            raise ValueError("GPUSCHED_EXECUTOR=torch needs PyTorch: pip install "
                             "'gpusched-agent[torch]'") from exc
        executor = TorchExecutor(settings.torch_device, settings.seed,
                                 TinyConfig(dim=settings.torch_dim, layers=settings.torch_layers),
                                 threads=settings.torch_threads)
        nvml_gpus = inventory.gpus if inventory is not None and not settings.simulate else None
        if nvml_gpus and executor.device_kind == "cpu" and settings.torch_device == "auto":
            raise ValueError(
                f"NVML found {len(nvml_gpus)} GPU(s) but this torch sees no CUDA device (a "
                "CPU-only build?): the work would run on the CPU and be billed as GPU time. "
                "Install a CUDA build of torch, or set GPUSCHED_TORCH_DEVICE=cpu to run on "
                "the CPU on purpose")
        problem = executor.devices_problem(nvml_gpus) if nvml_gpus is not None else None
        if problem is not None:
            raise ValueError(problem)
        return executor
    if settings.executor == "openai":
        from gpusched_agent.adapters.openai_executor import OpenAIExecutor

        assert settings.openai_base_url is not None  # validated by the settings
        return OpenAIExecutor(settings.openai_base_url, settings.openai_model,
                              settings.openai_api_key, settings.openai_timeout_s,
                              stream_usage=settings.openai_stream_usage)
    return SimulatedExecutor(settings.time_scale, settings.seed)


class DroppedRecords:
    """Records published without waiting (token chunks) that Kafka did not take. The first
    of a request is a warning naming it (asyncio would log each as a never-retrieved error);
    every one counts in `gpusched_agent_records_dropped_total`. The router streams what a
    request's chunks missed from its result."""

    def __init__(self, dropped: Counter, remember: int = 1024) -> None:
        self._dropped = dropped
        self._warned = Recent(remember)  # keys warned about

    def __call__(self, message: Message, key: str, sent: asyncio.Future) -> None:
        if sent.cancelled() or sent.exception() is None:
            return
        self._dropped.labels(type(message).__name__).inc()
        if key in self._warned:
            return
        self._warned[key] = None
        log.warning("%s for %s dropped by Kafka (%r); the router streams its text from the "
                    "result. Later drops for %s are counted, not logged", type(message).__name__,
                    key, sent.exception(), key)


def create_app(settings: AgentSettings, clock: WallClockMs = wall_clock_ms) -> FastAPI:
    inventory, read_inventory = discover_inventory(settings)
    executor = make_executor(settings, inventory)
    registry = CollectorRegistry()
    provider = make_tracer_provider(SERVICE, settings.telemetry, instance_id=settings.node_id)
    broker = make_broker(settings.kafka, SERVICE, provider, registry)
    redis = make_redis(settings.redis)
    dropped_total = Counter(
        "gpusched_agent_records_dropped_total", "Records published without waiting (token "
        "chunks) that Kafka did not take, by message type.", ["message"], registry=registry)
    dropped_total.labels("TokenChunk")  # at 0: a series first seen at 1 is no increase()
    dropped = DroppedRecords(dropped_total)

    async def publish(message: Message, topic: str, key: str, wait: bool = True) -> None:
        sent = await broker.publish(message.to_bytes(), topic, key=key.encode(),
                                    headers={"content-type": "application/json"},
                                    no_confirm=not wait)
        if not wait:  # nobody awaits Kafka's answer: say here if it dropped the record
            sent.add_done_callback(functools.partial(dropped, message, key))

    refusals = Counter(
        "gpusched_agent_engine_refusals_total", "Requests the inference engine refused as "
        "invalid (answered to the client with the engine's 4xx), by model and status: a "
        "steady rate on one node says its engine's limits are below config/models.yaml's.",
        ["model", "status"], registry=registry)
    load_failures = Counter(
        "gpusched_agent_load_failures_total", "Cooldowns started on this node by a model load "
        "that failed with its engine up (a corrupt file, memory another process holds, a "
        "driver fault), by model: the node takes no work of that model for "
        "GPUSCHED_LOAD_FAILURE_COOLDOWN_S (loads on several GPUs failing at once count once).",
        ["model"], registry=registry)
    node = NodeModel.from_inventory(inventory.gpus, inventory.driver_version,
                                    inventory.cuda_version)
    catalog = load_models(settings.config_dir)
    served = settings.served_models(catalog)
    for model_name in served or catalog.names:  # at 0, for the alerts' increase()
        load_failures.labels(model_name)
        for status in sorted(executor.refuses):  # every status its executor refuses with
            refusals.labels(model_name, str(status))
    runtime = AgentRuntime(
        settings.node_id, node, catalog, executor, publish,
        RedisLedger(redis), clock, chunk_tokens=settings.chunk_tokens,
        heartbeat_s=settings.heartbeat_s, usage_interval_s=settings.usage_interval_s,
        read_inventory=read_inventory, models=served,
        refused=lambda model, status: refusals.labels(model, str(status)).inc(),
        load_failure_cooldown_s=settings.load_failure_cooldown_s,
        load_failed=lambda model: load_failures.labels(model).inc(),
        tracer=provider.get_tracer(SERVICE))
    commands = Counter("gpusched_agent_commands_total", "Placement, preempt and cancel "
                       "commands by outcome (stale = rejected, from a deposed scheduler).",
                       ["command", "outcome"], registry=registry)
    for command, outcome in (("unknown", "invalid"), ("placement", "reused"),
                             ("placement", "stale"), ("preempt", "stale")):
        commands.labels(command, outcome)  # at 0, for the dead-letter alerts' increase()
    lag = ConsumerLag(SERVICE, registry)
    placements = handlers.register(broker, runtime, commands, lag)
    Gauge("gpusched_agent_requests_in_flight", "Placements running.", registry=registry
          ).set_function(lambda: runtime.in_flight)
    started = False

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal started
        await topics.ensure_topics(settings.kafka.bootstrap,
                                   replication_factor=settings.kafka.replication_factor)
        await broker.start()
        await handlers.hold_command_position(placements)  # before the node is first seen
        await runtime.recover()
        runtime.start_reporting()
        measuring = asyncio.create_task(lag.run(), name="consumer-lag")
        started = True
        try:
            yield
        finally:
            started = False
            await runtime.drain(timeout_s=settings.drain_timeout_s)  # ends the reporting
            await cancelled(measuring)  # after the drain, which still reads commands
            await broker.stop()
            await executor.close()
            await redis.aclose()
            provider.shutdown()

    app = FastAPI(title="gpusched gpu-agent", version="0.1.0", lifespan=lifespan)
    add_ops_routes(app, registry, lambda: started)

    @get_and_head(app, "/v1/node")
    async def node_state() -> dict:
        return runtime.node_state().model_dump()

    app.state.runtime = runtime
    return app
