"""Which offsets of the request topics may be committed: a partition advances only past
records whose requests are decided and published (at-least-once), however the cycles
finish them, so the request handlers need not wait for decisions before fetching more."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping

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
        self.committed: dict[TopicPartition, int] = {}
        """The offset Kafka took last for each partition (the next record to read): a next
        leader reads from there."""
        self._restarts: dict[TopicPartition, int] = {}
        """How often each partition was read below what was committed (`track`): a commit
        under way since then is of the old topic's offsets."""

    def track(self, record: ConsumerRecord, item: Pending | None, commit: Commit | None) -> None:
        """Remember `record`; `commit` commits its consumer's offsets (None: nothing to commit,
        as with the in-memory test broker)."""
        if commit is None:
            return
        tp = TopicPartition(record.topic, record.partition)
        if record.offset < max(self.committed.get(tp, 0), self._due.get(tp, 0)):
            # read below what was committed or due: the topic was made again (or the group's
            # offsets reset), and those offsets are the old topic's: committed to the new
            # one, a next leader skipped its records; as a floor, they forgot the 429s of
            # the new topic's records below them
            self.committed.pop(tp, None)
            self._due.pop(tp, None)
            self._restarts[tp] = self._restarts.get(tp, 0) + 1
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
        # a partition that starts over (`track`) while a commit is under way has only old
        # offsets here: none is sent after that, and one sent as it happened is taken back
        restarts = {tp: self._restarts.get(tp, 0) for tp in self._due}
        for commit, offsets in by_consumer.items():
            offsets = {tp: o for tp, o in offsets.items()
                       if self._restarts.get(tp, 0) == restarts[tp]}
            if not offsets:
                continue
            try:
                await commit(offsets)
            except Exception:  # retried with the next decisions; at worst redelivered
                log.warning("committing request offsets %s failed", offsets, exc_info=True)
                ok = False
                continue
            for tp, offset in offsets.items():
                if self._restarts.get(tp, 0) != restarts[tp]:
                    # it started over while this went out: Kafka holds the old topic's
                    # offset; the new topic's first record read is due instead (read again
                    # at worst, never skipped)
                    if entries := self._records.get(tp):
                        self._due[tp] = entries[0][0]
                    continue
                self.committed[tp] = offset
                if self._due.get(tp) == offset:
                    del self._due[tp]
        return ok

    def clear(self) -> None:
        """Forget what was to commit (stepping down: the next leader reads from the last
        commit), not what was committed."""
        self._records.clear()
        self._commits.clear()
        self._due.clear()


class AnsweredRecords:
    """The request records answered 429 (over quota, or a spent budget) that may be read
    again, per partition: offset -> the record's timestamp (which tells it from another
    record at its position, a topic deleted and made again). Read again, one must be
    refused again, not judged anew (a minute later it could run, for a client that had its
    429). So a note is kept until no reader can come back to its record (`forget_below`),
    however many 429s come after it: trimmed to the latest 20,000, a flood of them let a
    next leader run a request its client was told was refused."""

    def __init__(self) -> None:
        self._by_partition: dict[TopicPartition, dict[int, int]] = {}

    def add(self, tp: TopicPartition, offset: int, timestamp_ms: int) -> None:
        self._by_partition.setdefault(tp, {})[offset] = timestamp_ms

    def answered(self, record: ConsumerRecord) -> bool:
        """Whether `record` itself (not another at its position) was answered 429."""
        notes = self._by_partition.get(TopicPartition(record.topic, record.partition))
        return notes is not None and notes.get(record.offset) == record.timestamp

    def forget_below(self, floors: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Forget the notes below each partition's floor (records no reader comes back to);
        returns the partitions that had some, with their floor. Notes come in offset order
        (records are read in order), so a partition whose first note is at or above its
        floor is passed over at once: a commit that passes none costs nothing."""
        forgot: dict[TopicPartition, int] = {}
        for tp, floor in floors.items():
            notes = self._by_partition.get(tp)
            if notes and next(iter(notes)) < floor:
                kept = {offset: at for offset, at in notes.items() if offset >= floor}
                if kept:
                    self._by_partition[tp] = kept
                else:
                    del self._by_partition[tp]
                forgot[tp] = floor
        return forgot

    def __len__(self) -> int:
        return sum(len(notes) for notes in self._by_partition.values())
