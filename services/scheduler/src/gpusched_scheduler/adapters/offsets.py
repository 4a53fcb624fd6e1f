"""Which offsets of the request topics may be committed: a partition advances only past
records whose requests are decided and published (at-least-once), however the cycles
finish them, so the request handlers need not wait for decisions before fetching more."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

from aiokafka.structs import ConsumerRecord, TopicPartition

from gpusched_scheduler.domain.queue import Pending

log = logging.getLogger(__name__)

Commit = Callable[[dict[TopicPartition, int]], Awaitable[None]]
"""Commits offsets (the next record to read, per partition) of one consumer group."""


COMPACT_ABOVE = 1024
"""Entries per partition above which runs of decided records behind an undecided one are
folded into their last record (a request waiting long for room must not let the records
decided after it pile up; the undecided ones are bounded by the pending bound)."""


def _decided(item: Pending | None) -> bool:
    return item is None or item.decided


def _compacted(entries: deque[tuple[int, Pending | None]]) -> deque[tuple[int, Pending | None]]:
    """The same commit points from fewer entries: each run of decided records becomes its
    last record."""
    out: deque[tuple[int, Pending | None]] = deque()
    for offset, item in entries:
        if _decided(item):
            if out and _decided(out[-1][1]):
                out.pop()
            out.append((offset, None))
        else:
            out.append((offset, item))
    return out


class OffsetBook:
    """Records handed to the engine, per partition in offset order, each with the pending
    item that decides it (None: decided on arrival, e.g. dead-lettered or a redelivery of
    something already placed)."""

    def __init__(self) -> None:
        self._records: dict[TopicPartition, deque[tuple[int, Pending | None]]] = {}
        self._commits: dict[TopicPartition, Commit] = {}
        self._due: dict[TopicPartition, int] = {}
        """Committable offsets not yet committed (kept across a failed commit)."""

    def track(self, record: ConsumerRecord, item: Pending | None, commit: Commit | None) -> None:
        """Remember `record`; `commit` commits its consumer's offsets (None: nothing to commit,
        as with the in-memory test broker)."""
        if commit is None:
            return
        tp = TopicPartition(record.topic, record.partition)
        entries = self._records.setdefault(tp, deque())
        if entries and record.offset <= entries[-1][0]:
            # read again from an earlier offset (the group rebalanced): everything after it
            # comes again too, so the older entries are superseded
            entries.clear()
        entries.append((record.offset, item))
        self._commits[tp] = commit

    def advance(self) -> None:
        """Move each partition's commit point past its leading decided records."""
        for tp, entries in self._records.items():
            last = None
            while entries and _decided(entries[0][1]):
                last = entries.popleft()[0]
            if last is not None:
                self._due[tp] = last + 1
            if len(entries) > COMPACT_ABOVE:
                self._records[tp] = _compacted(entries)

    @property
    def due(self) -> bool:
        return bool(self._due)

    async def commit(self) -> bool:
        """Commit what `advance` found, one call per consumer; False when Kafka refused some
        (kept for the next call: a later commit covers an earlier one)."""
        ok = True
        by_consumer: dict[Commit, dict[TopicPartition, int]] = {}
        for tp, offset in self._due.items():
            by_consumer.setdefault(self._commits[tp], {})[tp] = offset
        for commit, offsets in by_consumer.items():
            try:
                await commit(offsets)
            except Exception:  # retried with the next decisions; at worst redelivered
                log.warning("committing request offsets %s failed", offsets, exc_info=True)
                ok = False
                continue
            for tp, offset in offsets.items():
                if self._due.get(tp) == offset:
                    del self._due[tp]
        return ok

    def clear(self) -> None:
        """Forget everything (stepping down: the next leader reads from the last commit)."""
        self._records.clear()
        self._commits.clear()
        self._due.clear()
