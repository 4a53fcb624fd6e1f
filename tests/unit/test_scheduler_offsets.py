"""Request offsets commit only past decided records, per partition, whatever order the
cycles decide them in; a refused commit is retried, a rewind supersedes older records. The
notes of records answered 429 last until no reader can come back to them."""

from dataclasses import replace

from aiokafka.structs import ConsumerRecord, TopicPartition

from gpusched_common.contracts import InferenceRequest
from gpusched_scheduler.adapters.offsets import AnsweredRecords, OffsetBook
from gpusched_scheduler.domain.queue import Pending

TOPIC = "gpusched.requests.standard"


def record(partition: int, offset: int) -> ConsumerRecord:
    return ConsumerRecord(TOPIC, partition, offset, 0, 0, None, b"", None, 0, 0, ())


def item(rid: str) -> Pending:
    return Pending(InferenceRequest(request_id=rid, tenant="t", priority_class="standard",
                                    model="m", prompt="x", created_at_ms=0), {}, 0)


class Kafka:
    def __init__(self, refuse: int = 0) -> None:
        self.committed: dict[TopicPartition, int] = {}
        self.refuse = refuse

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self.refuse:
            self.refuse -= 1
            raise ConnectionError("coordinator moved")
        self.committed.update(offsets)


async def test_a_partition_commits_up_to_its_first_undecided_record() -> None:
    kafka, book = Kafka(), OffsetBook()
    a, b, c = item("a"), item("b"), item("c")
    for rec, it in ((record(0, 10), a), (record(0, 11), None), (record(0, 12), b),
                    (record(1, 5), c)):
        book.track(rec, it, kafka.commit)
    book.advance()
    assert not book.due  # both partitions start with an undecided record
    b.decided = c.decided = True  # decided out of arrival order
    book.advance()
    assert await book.commit()
    assert kafka.committed == {TopicPartition(TOPIC, 1): 6}
    a.decided = True
    book.advance()
    assert await book.commit()
    assert kafka.committed[TopicPartition(TOPIC, 0)] == 13


async def test_a_refused_commit_is_retried_and_a_rewind_starts_over() -> None:
    kafka, book = Kafka(refuse=1), OffsetBook()
    book.track(record(0, 0), None, kafka.commit)
    book.advance()
    assert not await book.commit() and book.due
    assert await book.commit() and not book.due
    assert kafka.committed == {TopicPartition(TOPIC, 0): 1}
    late = item("late")
    book.track(record(0, 1), late, kafka.commit)
    book.track(record(0, 1), None, kafka.commit)  # read again after a rebalance, decided
    book.advance()
    assert await book.commit()
    assert kafka.committed == {TopicPartition(TOPIC, 0): 2}


def test_without_a_consumer_nothing_is_tracked() -> None:
    book = OffsetBook()
    book.track(record(0, 0), item("x"), None)
    book.advance()
    assert not book.due


async def test_records_decided_behind_a_waiting_one_are_folded_not_kept() -> None:
    kafka, book = Kafka(), OffsetBook()
    stuck = item("stuck")
    book.track(record(0, 0), stuck, kafka.commit)
    for offset in range(1, 5001):
        book.track(record(0, offset), None, kafka.commit)
        book.advance()
    assert len(book._records[TopicPartition(TOPIC, 0)]) <= 1025  # noqa: SLF001 - the bound
    assert not book.due
    stuck.decided = True
    book.advance()
    assert await book.commit()
    assert kafka.committed == {TopicPartition(TOPIC, 0): 5001}


async def test_notes_of_429s_are_forgotten_once_no_reader_comes_back_to_them() -> None:
    """Below its partition's floor (what was committed, or the batch read again) a record is
    never read again: its note goes, however few came after it; at or above, it stays,
    however many did. Only the partitions that lost notes are named (Redis forgets them)."""
    kafka, book, notes = Kafka(), OffsetBook(), AnsweredRecords()
    for offset in (3, 4, 7):
        notes.add(TopicPartition(TOPIC, 0), offset, 1000 + offset)
    notes.add(TopicPartition(TOPIC, 1), 9, 1009)
    book.track(record(0, 5), None, kafka.commit)
    book.advance()
    assert await book.commit() and book.committed == {TopicPartition(TOPIC, 0): 6}
    assert notes.forget_below(book.committed) == {TopicPartition(TOPIC, 0): 6}
    assert notes.forget_below(book.committed) == {}  # nothing more to forget there
    assert len(notes) == 2
    assert notes.answered(replace(record(0, 7), timestamp=1007))
    assert not notes.answered(record(0, 7))  # another record at its position
    assert not notes.answered(replace(record(0, 4), timestamp=1004))


async def test_a_topic_made_again_keeps_the_notes_of_its_records() -> None:
    """A request topic deleted and made again starts its offsets over: the old topic's
    commit (10,001) stayed the partition's floor, and the next commit forgot every 429 of
    the new topic's records below it; a next leader then ran a request its client was told
    was refused."""
    kafka, book, notes = Kafka(), OffsetBook(), AnsweredRecords()
    tp = TopicPartition(TOPIC, 0)
    book.committed[tp] = 10_001  # the old topic's
    notes.add(tp, 2, 1002)
    book.track(record(0, 1), None, kafka.commit)  # read from the new topic's start
    assert tp not in book.committed
    assert notes.forget_below(book.committed) == {} and len(notes) == 1


async def test_an_old_topics_offset_due_or_going_out_is_not_taken_for_the_new_ones() -> None:
    """Due (its commit had failed, the topic being deleted) or under way as the partition
    started over, the old topic's offset was committed, or kept as the floor, for the new
    topic: a next leader skipped the new records below it."""
    tp = TopicPartition(TOPIC, 0)
    kafka, book = Kafka(refuse=1), OffsetBook()
    book.track(record(0, 10_000), None, kafka.commit)
    book.advance()
    assert not await book.commit()  # refused: due still
    book.track(record(0, 0), item("new"), kafka.commit)  # the new topic's first, undecided
    book.advance()
    assert not book.due and await book.commit() and tp not in book.committed

    class Slow(Kafka):  # a commit that goes out as the partition starts over
        async def commit(self, offsets: dict) -> None:
            await super().commit(offsets)
            book.track(record(0, 0), item("new"), self.commit)

    book, slow = OffsetBook(), Slow()
    book.track(record(0, 10_000), None, slow.commit)
    book.advance()
    assert await book.commit() and tp not in book.committed
    assert await book.commit() and slow.committed[tp] == 0  # Kafka taken back to it

    # two consumers: the other class's partition starts over while the first commits
    other = TopicPartition("gpusched.requests.batch", 0)
    second = Kafka()

    class Restarting(Kafka):
        async def commit(self, offsets: dict) -> None:
            await super().commit(offsets)
            book.track(ConsumerRecord(other.topic, 0, 0, 0, 0, None, b"", None, 0, 0, ()),
                       item("b"), second.commit)

    book, restarting = OffsetBook(), Restarting()
    book.track(record(0, 5), None, restarting.commit)
    book.track(ConsumerRecord(other.topic, 0, 10_000, 0, 0, None, b"", None, 0, 0, ()),
               None, second.commit)
    book.advance()
    assert await book.commit()
    assert other not in second.committed and other not in book.committed
