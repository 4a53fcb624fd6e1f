"""Pending work, strict priority between classes and FIFO inside one; pure data."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gpusched_common.contracts import PRIORITY_CLASSES, InferenceRequest, PriorityClass


@dataclass
class Pending:
    request: InferenceRequest
    trace_carrier: dict[str, str]
    enqueued_ms: int
    token: Any = None
    """Opaque to the domain: the adapter's handle to acknowledge once placed."""


@dataclass
class PendingQueue:
    by_class: dict[PriorityClass, deque[Pending]] = field(
        default_factory=lambda: {c: deque() for c in PRIORITY_CLASSES})
    keys: set[tuple[str, int]] = field(default_factory=set)

    def push(self, item: Pending) -> bool:
        """Queue at the back of its class, or at the front when it was preempted or lost
        with its node; False when the same (request id, attempt) is already waiting."""
        key = (item.request.request_id, item.request.attempt)
        if key in self.keys:
            return False
        self.keys.add(key)
        queue = self.by_class[item.request.priority_class]
        if item.request.requeued in ("preempted", "node_lost"):
            queue.appendleft(item)  # it waited its turn once already
        else:
            queue.append(item)
        return True

    def in_order(self) -> Iterator[Pending]:
        for cls in PRIORITY_CLASSES:
            yield from list(self.by_class[cls])

    def remove(self, item: Pending) -> None:
        """Take `item` out; a no-op when it is gone already (the queue was cleared)."""
        key = (item.request.request_id, item.request.attempt)
        if key in self.keys:
            self.by_class[item.request.priority_class].remove(item)
            self.keys.discard(key)

    def depth(self) -> dict[PriorityClass, int]:
        return {c: len(q) for c, q in self.by_class.items()}

    def __len__(self) -> int:
        return sum(len(q) for q in self.by_class.values())
