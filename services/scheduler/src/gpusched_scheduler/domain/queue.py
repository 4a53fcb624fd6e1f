"""Pending work, strict priority between classes and FIFO inside one; pure data.

Each class is an insertion-ordered dict keyed by (request id, attempt), so a redelivery is
recognised and any item leaves in O(1), whatever order the cycle finishes them in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpusched_common.contracts import PRIORITY_CLASSES, InferenceRequest, PriorityClass

Key = tuple[str, int]


@dataclass(eq=False)
class Pending:
    request: InferenceRequest
    trace_carrier: dict[str, str]
    enqueued_ms: int
    decided: bool = False
    """Placed or rejected, and that decision published: its records may be committed."""
    charged: bool = False
    """Its admission took from its tenant's tokens per minute (new work, not a retry nor a
    request placed before): given back if it ends unrun (expired, cancelled)."""
    refunded: bool = False
    """Its quota charge was given back (a cycle undone puts it in the queue again)."""
    placed_once: bool = False
    """A placement of it went out in a cycle then undone (Kafka's answer failed once the
    term that sent it no longer led, or that term was deposed before saving it): it may
    run, so it never expires; it is planned again, and run once by its agent's claim.
    (Under the term that sent it, a refused placement is sent again unchanged instead.)"""
    retry: bool = False
    """A later attempt the scheduler confirmed as a retry of work it took in (its standing
    `ran`: its previous attempt was claimed by an agent or fenced by a scheduler, or ran
    here). Only such a retry waits on from its request's creation, goes to the front of its
    class when preempted or lost, never expires, and is priced by its earlier attempts as a
    preemption victim (`RunningPlacement.retry`). A later attempt judged new work (a record
    produced straight to Kafka that only says it is a retry) is queued as a first attempt:
    its `created_at_ms` and `attempt` are the producer's word."""

    @property
    def aging_from_ms(self) -> int:
        """Since when it counts as waiting for ageing: when it was queued, or, a confirmed
        retry, its request's creation (when it was queued, where that is earlier), so its
        clock does not start again at every hand-back."""
        return min(self.enqueued_ms, self.request.created_at_ms) if self.retry \
            else self.enqueued_ms

    @property
    def key(self) -> Key:
        return (self.request.request_id, self.request.attempt)


@dataclass
class PendingQueue:
    by_class: dict[PriorityClass, dict[Key, Pending]] = field(
        default_factory=lambda: {c: {} for c in PRIORITY_CLASSES})
    by_tenant: Counter[str] = field(default_factory=Counter)
    """How many items each tenant has waiting (quotas read it on every admission)."""
    by_request: dict[str, list[Key]] = field(default_factory=dict)
    """The keys waiting per request id (one, but for a retry queued beside an attempt
    redelivered late), so a cancel finds its request without a scan."""
    limited: int = 0
    """How many items carry their own queue time limit: with none, and no class limit, a
    cycle skips looking for expired work."""

    def push(self, item: Pending) -> bool:
        """Queue at the back of its class, or at the front when it is a confirmed retry
        (`Pending.retry`) that was preempted or lost with its node; False when the same
        (request id, attempt) is already waiting."""
        queue = self.by_class[item.request.priority_class]
        if item.key in queue:
            return False
        queue[item.key] = item
        self.by_tenant[item.request.tenant] += 1
        self.by_request.setdefault(item.request.request_id, []).append(item.key)
        self.limited += item.request.max_queue_ms is not None
        if item.retry and item.request.requeued in ("preempted", "node_lost"):
            # it waited its turn once already
            self.by_class[item.request.priority_class] = {item.key: item, **{
                k: v for k, v in queue.items() if k != item.key}}
        return True

    def __contains__(self, key: Key) -> bool:
        return self.get(key) is not None

    def get(self, key: Key) -> Pending | None:
        for queue in self.by_class.values():
            item = queue.get(key)
            if item is not None:
                return item
        return None

    def of_request(self, request_id: str) -> list[Pending]:
        """Every attempt of `request_id` waiting here."""
        return [item for key in self.by_request.get(request_id, ())
                if (item := self.get(key)) is not None]

    def in_order(self) -> Iterator[Pending]:
        for cls in PRIORITY_CLASSES:
            yield from list(self.by_class[cls].values())

    def remove(self, item: Pending) -> None:
        """Take `item` out; a no-op when it is gone already (the queue was cleared, or a
        redelivery of it replaced it)."""
        queue = self.by_class[item.request.priority_class]
        if queue.get(item.key) is item:
            del queue[item.key]
            self.by_tenant[item.request.tenant] -= 1
            if not self.by_tenant[item.request.tenant]:
                del self.by_tenant[item.request.tenant]
            keys = self.by_request[item.request.request_id]
            keys.remove(item.key)
            if not keys:
                del self.by_request[item.request.request_id]
            self.limited -= item.request.max_queue_ms is not None

    def depth(self) -> dict[PriorityClass, int]:
        return {c: len(q) for c, q in self.by_class.items()}

    def depth_by_tenant(self) -> Counter[tuple[PriorityClass, str]]:
        """Items waiting per (class, tenant)."""
        return Counter((cls, item.request.tenant) for cls, queue in self.by_class.items()
                       for item in queue.values())

    def __len__(self) -> int:
        return sum(len(q) for q in self.by_class.values())
