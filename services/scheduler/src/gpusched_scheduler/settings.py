"""Scheduler settings (GPUSCHED_* environment variables)."""

import os
import socket

from pydantic import Field

from gpusched_common.contracts import MAX_QUEUE_MS
from gpusched_common.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    http_port: int = Field(default=8081, ge=0, le=65535)
    instance_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Identifies this instance in the leader lease.")
    placement_policy: str = Field(
        default="gpusched", description="Solver policy: first-fit, best-fit, dot-product, "
        "gpu-packing, fgd or gpusched.")
    cycle_window_ms: float = Field(
        default=2.0, ge=0, le=1000, description="Micro-batch window: pending work is collected "
        "this long after a wake-up, then solved as one batch.")
    node_timeout_s: float = Field(
        default=10.0, gt=0, le=600, description="A node silent this long is lost: it gets no "
        "new work and its running work is retried elsewhere.")
    stopped_node_grace_s: float = Field(
        default=600.0, ge=0, le=86_400, description="A node whose agent reported `stopped` (a "
        "graceful restart) still counts this long in the fleet that decides whether work "
        "that fits nowhere now waits or is rejected (422): work only it could hold waits for "
        "it to come back. Counted from when this instance read the report (a scheduler "
        "started later counts a node stopped for good this long after its start).")
    untaken_timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="A placement its node has not taken (not "
        "listed as active, not finished) this long after it was sent, while the node kept "
        "reporting, is fenced in the agents' claim ledger and retried elsewhere.")
    lease_ttl_ms: int = Field(
        default=3000, ge=500, le=60_000, description="Leader lease; a standby takes over at "
        "most this long (plus one renewal period) after the leader stops renewing.")
    settle_on_shutdown_s: float = Field(
        default=5.0, ge=0, le=60, description="How long a leader shutting down waits for the "
        "cycle under way to go out and for Kafka to answer the cycles it sent, so that their "
        "placements are saved under its token (renewed meanwhile) before a standby takes a "
        "newer one. Kafka up answers in milliseconds; away, the producer waits up to its "
        "request time-out (40 s): keep it within the time the container is given to stop "
        "(Docker 10 s, Kubernetes 30 s). A cycle answered after it is not saved: a next "
        "leader that places its request again finds the placement by the agents' claims.")
    interactive_target_ms: float = Field(default=1_000, gt=0,
                                         description="Placement latency target, interactive.")
    standard_target_ms: float = Field(default=10_000, gt=0)
    batch_target_ms: float = Field(default=60_000, gt=0)
    interactive_max_queue_s: float | None = Field(
        default=None, gt=0, le=MAX_QUEUE_MS / 1000, description="A request of the class not "
        "placed this long after it was created ends unrun with a 503 rejection (a request's "
        "own max_queue_ms may ask for less); unset: it waits as long as it takes.")
    standard_max_queue_s: float | None = Field(default=None, gt=0, le=MAX_QUEUE_MS / 1000)
    batch_max_queue_s: float | None = Field(default=None, gt=0, le=MAX_QUEUE_MS / 1000)
    aging_factor: float = Field(
        default=5.0, ge=1, le=10, description="Work waiting longer than this many times its "
        "class's target is served before all classes, so none waits past 10x its target.")
    fair_half_life_s: float = Field(default=60.0, gt=0,
                                    description="Fair share follows consumption this recent.")
    fetch_max_records: int = Field(
        default=256, ge=1, le=10_000, description="Records per fetch and class; also the bound "
        "on pending requests per class held in memory (backpressure).")

    def class_max_queue_ms(self) -> tuple[tuple[str, float], ...]:
        """(class, ms) for each class with a queue time limit."""
        return tuple((cls, limit_s * 1000) for cls, limit_s in (
            ("interactive", self.interactive_max_queue_s),
            ("standard", self.standard_max_queue_s),
            ("batch", self.batch_max_queue_s)) if limit_s is not None)
