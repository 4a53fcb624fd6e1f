"""Scheduler state in Redis: the leader lease with its fencing token, the placements in
flight (so a new leader knows what runs where, and in which trace) and the request records
answered 429; and what it reads of others' state (agents' claims, accounting's budget
flags)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import TypeAdapter
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from gpusched_common import outbox
from gpusched_common.contracts import PLACEMENT, Placement
from gpusched_common.redis_keys import (
    BUDGET_EXHAUSTED_KEY,
    CANCELLED_KEY,
    CANCELLED_TTL_S,
    CLAIM_TTL_S,
    FENCED_CLAIM,
    NODE_ALIVE_KEY,
    NODE_CLAIMS_KEY,
    PLACEMENT_CLAIM_KEY,
    SCHEDULER_EPOCH_KEY,
    SCHEDULER_RUNNING_KEY,
    budget_reason,
)
from gpusched_scheduler.domain.running import ClaimState, RunningPlacement

log = logging.getLogger(__name__)

LEADER_KEY = "gpusched:scheduler:leader"
OVER_QUOTA_KEY = "gpusched:scheduler:over-quota:{}"
"""Sorted set per request topic partition ('<topic>:<partition>'): '<offset>:<timestamp>'
of each record answered 429 (over quota, or a spent budget), scored by its offset; the
timestamp tells the record from another at its position (a topic deleted and made again).
A leader that reads one again, the same one or the next, keeps it refused. A note is kept
until its partition's committed offset has passed it (`forget_over_quota`): no leader reads
a record below that again."""
OVER_QUOTA_PARTITIONS_KEY = "gpusched:scheduler:over-quota:partitions"
"""Set: the '<topic>:<partition>' of every OVER_QUOTA_KEY, for a new leader to find them
without a scan."""
OVER_QUOTA_BEFORE_KEY = "gpusched:scheduler:over-quota"
"""Where the release before kept its notes (a sorted set of '<topic>:<partition>:<offset>'
scored by timestamp, its latest 20,000): read as well, so its 429s stay refused across an
upgrade; written no more."""

TRACES_KEY = "gpusched:scheduler:traces"
"""Hash: placement id -> the W3C trace context (JSON) of each placement in flight that has
one, written and removed with it: what a next leader sends for it (its retry, its end)
goes on in its request's trace. Beside the running hash, not in it: a scheduler one release
behind reads that hash and forbids fields it does not know."""

_CARRIER = TypeAdapter(dict[str, str])

Position = tuple[str, int, int]
"""A Kafka record's (topic, partition, offset)."""

# KEYS: leader, epoch. ARGV: instance id, ttl ms, '1' to take a free lease. Returns the
# epoch held, or -1.
_ACQUIRE_OR_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == false and ARGV[3] == '1' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return redis.call('INCR', KEYS[2])
elseif holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
return -1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# KEYS: epoch, running hash, traces hash. ARGV: the token the placements went out with,
# how many arguments of the running hash follow, then its field, value, ..., then the
# traces hash's. Writes only while that token is still the current one; returns 1 if it
# wrote.
_SAVE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local last = 2 + tonumber(ARGV[2])
for first = 3, last, 1000 do
  redis.call('HSET', KEYS[2], unpack(ARGV, first, math.min(first + 999, last)))
end
for first = last + 1, #ARGV, 1000 do
  redis.call('HSET', KEYS[3], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
return 1
"""


class LeaderLease:
    """One leader among scheduler instances: whoever holds the key leads until it stops
    renewing; each new leadership increments the fencing token."""

    def __init__(self, redis: Redis, instance_id: str, ttl_ms: int) -> None:
        self._redis = redis
        self.instance_id = instance_id
        self._ttl_ms = ttl_ms
        self._acquire = redis.register_script(_ACQUIRE_OR_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def acquire_or_renew(self) -> int | None:
        """The fencing token while this instance leads, None when another one does."""
        return await self._hold(take=True)

    async def renew(self) -> int | None:
        """The fencing token while this instance still holds the lease (renewed), else None:
        a free lease is left free, its token unchanged (one shutting down takes none)."""
        return await self._hold(take=False)

    async def _hold(self, take: bool) -> int | None:
        epoch = int(await self._acquire(keys=[LEADER_KEY, SCHEDULER_EPOCH_KEY],
                                        args=[self.instance_id, self._ttl_ms, int(take)]))
        return epoch if epoch >= 0 else None

    async def release(self) -> None:
        await self._release(keys=[LEADER_KEY], args=[self.instance_id])


@dataclass(frozen=True)
class Filed:
    """Final records an agent filed for a placement (its outbox) and never released."""

    node_id: str
    placement_id: str
    records: list[outbox.Final]


@dataclass(frozen=True)
class SpentBudget:
    """Accounting's flag on a tenant whose budget is spent."""

    reason: str
    left_ms: int | None
    """Until the flag expires (the period's end); None for a flag set without an expiry."""


class RunningStore:
    """Placements in flight, one hash field each (and their trace contexts, `TRACES_KEY`);
    written once per cycle (one script)."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._save: AsyncScript | None = None  # registered at the first save

    async def save(self, placements: list[RunningPlacement], epoch: int) -> bool:
        """Save placements sent under fencing token `epoch`, if it is still the current one;
        False if a newer leader has taken over (it may have read this hash already: written
        now, they would be known to no leader, and their requests, committed, lost)."""
        if not placements:
            return True
        fields: list[str] = []
        traces: list[str] = []
        for p in placements:
            # readable by a scheduler one release behind: unset optional fields left out, as
            # in Message.to_bytes, and `aged`, `retry` and `trace_carrier` (it forbids fields
            # it does not know; the trace context goes to TRACES_KEY), and the `borrowed`
            # mark it requires, false (this release reads no mark: it judges what is borrowed
            # afresh each cycle; that one reclaims none of the work it inherits)
            saved = p.model_dump_json(exclude_none=True,
                                      exclude={"aged", "retry", "trace_carrier"})
            fields += (p.placement_id, saved[:-1] + ',"borrowed":false}')
            if p.trace_carrier:
                traces += (p.placement_id, json.dumps(p.trace_carrier))
        if self._save is None:
            self._save = self._redis.register_script(_SAVE)
        return bool(await self._save(
            keys=[SCHEDULER_EPOCH_KEY, SCHEDULER_RUNNING_KEY, TRACES_KEY],
            args=[str(epoch), str(len(fields)), *fields, *traces]))

    async def remove(self, placement_ids: list[str]) -> None:
        if placement_ids:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hdel(SCHEDULER_RUNNING_KEY, *placement_ids)
                pipe.hdel(TRACES_KEY, *placement_ids)
                await pipe.execute()

    async def fence(self, placement_ids: list[str]) -> list[bool]:
        """Claim placements in the agents' ledger under the scheduler's name; True for each
        one no agent had claimed (it can now never run), False where an agent has it."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for pid in placement_ids:
                pipe.set(PLACEMENT_CLAIM_KEY.format(pid), FENCED_CLAIM, nx=True,
                         ex=CLAIM_TTL_S)
            return [bool(ok) for ok in await pipe.execute()]

    async def keep_cancels(self, reasons: dict[str, str]) -> None:
        """Keep cancels read on the control topic (request id -> reason) where an agent
        looks when it claims a placement, so one that was down when a cancel went out still
        ends the request unrun. The router keeps its own before it sends them; this keeps
        those produced straight to Kafka. A cancel kept already is left as it is."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id, reason in reasons.items():
                pipe.set(CANCELLED_KEY.format(request_id), reason, nx=True, ex=CANCELLED_TTL_S)
            await pipe.execute()

    async def note_over_quota(self, position: Position, timestamp_ms: int) -> None:
        """Remember that the record at `position`, of that timestamp, was answered 429 (Kafka
        took the answer), in place of any note at its position."""
        topic, partition, offset = position
        where = f"{topic}:{partition}"
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(OVER_QUOTA_KEY.format(where), offset, offset)
            pipe.zadd(OVER_QUOTA_KEY.format(where), {f"{offset}:{timestamp_ms}": offset})
            pipe.sadd(OVER_QUOTA_PARTITIONS_KEY, where)
            await pipe.execute()

    async def forget_over_quota(self, floors: Mapping[tuple[str, int], int]) -> None:
        """Forget the notes below each (topic, partition)'s floor, whose records no leader
        reads again (the partition's committed offset has passed them); one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for (topic, partition), floor in floors.items():
                pipe.zremrangebyscore(OVER_QUOTA_KEY.format(f"{topic}:{partition}"), "-inf",
                                      f"({floor}")
            await pipe.execute()

    async def over_quota(self) -> list[tuple[Position, int]]:
        """The request records answered 429 that `note_over_quota` keeps (and the release
        before kept), each with its timestamp; one this release cannot read is left out with
        a warning (raising would keep every instance from leading)."""
        partitions = sorted(await self._redis.smembers(OVER_QUOTA_PARTITIONS_KEY))
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zrange(OVER_QUOTA_BEFORE_KEY, 0, -1, withscores=True)
            for where in partitions:
                pipe.zrange(OVER_QUOTA_KEY.format(where.decode()), 0, -1)
            before, *noted = await pipe.execute()
        out = []
        for member, score in before:
            try:
                topic, partition, offset = member.decode().rsplit(":", 2)
                out.append(((topic, int(partition), int(offset)), int(score)))
            except ValueError:
                log.warning("ignoring the unreadable note of a 429 %r", member)
        for where, members in zip(partitions, noted, strict=True):
            for member in members:
                try:
                    topic, partition = where.decode().rsplit(":", 1)
                    offset, timestamp_ms = member.decode().split(":")
                    out.append(((topic, int(partition), int(offset)), int(timestamp_ms)))
                except ValueError:
                    log.warning("ignoring the unreadable note of a 429 %r in %r", member, where)
        return out

    async def spent_budgets(self, tenants: list[str]) -> dict[str, SpentBudget]:
        """The tenants among `tenants` whose budget accounting has flagged as spent, each
        with its flag; one round trip."""
        keys = [BUDGET_EXHAUSTED_KEY.format(t) for t in tenants]
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.mget(keys)
            for key in keys:
                pipe.pttl(key)
            flags, *left_ms = await pipe.execute()
        return {t: SpentBudget(budget_reason(flag), ms if ms >= 0 else None)
                for t, flag, ms in zip(tenants, flags, left_ms, strict=True)
                if flag is not None and ms != -2}  # -2: expired since the MGET

    async def alive(self, node_ids: list[str]) -> list[bool]:
        """For each node, whether its agent said lately (in Redis) that it is alive."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for node_id in node_ids:
                pipe.exists(NODE_ALIVE_KEY.format(node_id))
            return [bool(n) for n in await pipe.execute()]

    async def claims(self, placements: list[RunningPlacement]) -> dict[str, ClaimState]:
        """Where each placement stands in the agents' ledger (placement id -> state). A claim
        is looked up under the node that made it, which need not be the one this scheduler
        last placed it on (a placement sent twice: the first send failed after all)."""
        return await self.claim_states([p.placement_id for p in placements])

    async def claim_states(self, placement_ids: list[str]) -> dict[str, ClaimState]:
        """`claims` by placement id: one round trip where no agent claimed any, else two."""
        owners = await self._owners(placement_ids)
        by_agents = [(pid, owner.decode()) for pid, owner in zip(placement_ids, owners,
                                                                  strict=True)
                     if owner is not None and owner.decode() != FENCED_CLAIM]
        held: set[str] = set()
        if by_agents:
            async with self._redis.pipeline(transaction=False) as pipe:
                for pid, node_id in by_agents:
                    pipe.hexists(NODE_CLAIMS_KEY.format(node_id), pid)
                held = {pid for (pid, _), h in zip(by_agents, await pipe.execute(),
                                                   strict=True) if h}
        return {pid: claim_state(owner, pid in held)
                for pid, owner in zip(placement_ids, owners, strict=True)}

    async def held_as(self, placements: list[RunningPlacement]) -> dict[str, Placement]:
        """Placement id -> the placement as the agent that holds it claimed it (its node,
        GPUs and KV cache, from the claims of the node that made the claim), for each of
        `placements` an agent holds; which may differ from what this scheduler booked (its
        request placed again by a leader that did not know the placement). Left out: those
        no agent holds, and those whose holder filed the records that end it in its stead."""
        ids = [p.placement_id for p in placements]
        held = [(pid, owner.decode()) for pid, owner in zip(ids, await self._owners(ids),
                                                            strict=True)
                if owner is not None and owner.decode() != FENCED_CLAIM]
        async with self._redis.pipeline(transaction=False) as pipe:
            for pid, node_id in held:
                pipe.hget(NODE_CLAIMS_KEY.format(node_id), pid)
            entries = await pipe.execute()
        out: dict[str, Placement] = {}
        for (pid, _), entry in zip(held, entries, strict=True):
            try:
                if entry is not None and outbox.in_claim(entry) is None:
                    out[pid] = PLACEMENT.validate_json(entry.partition(b" ")[2])
            except ValueError as exc:  # pydantic's ValidationError is one
                log.warning("ignoring the unreadable claim of %s: %s", pid, exc)
        return out

    async def _owners(self, placement_ids: list[str]) -> list[bytes | None]:
        """Who claimed each placement (an agent's node id, FENCED_CLAIM), None if nobody."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for pid in placement_ids:
                pipe.get(PLACEMENT_CLAIM_KEY.format(pid))
            return await pipe.execute()

    async def filed_finals(self, node_ids: list[str]) -> list[Filed]:
        """The final records the agents of these nodes filed and never released (the run
        died while publishing them)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for node_id in node_ids:
                pipe.hgetall(NODE_CLAIMS_KEY.format(node_id))
            held = await pipe.execute()
        out: list[Filed] = []
        for node_id, entries in zip(node_ids, held, strict=True):
            for pid, entry in entries.items():
                try:
                    records = outbox.in_claim(entry)
                except ValueError as exc:
                    log.warning("ignoring the unreadable claim of %s: %s", pid.decode(), exc)
                    continue
                if records is not None:
                    out.append(Filed(node_id, pid.decode(), records))
        return out

    async def release_claims(self, filed: list[Filed]) -> None:
        """Take placements off their nodes' claims (ended on their agents' behalf)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for f in filed:
                pipe.hdel(NODE_CLAIMS_KEY.format(f.node_id), f.placement_id)
            await pipe.execute()

    async def load(self) -> list[RunningPlacement]:
        """The placements in flight, each with its trace context where one was saved; one
        this release cannot read is left out with a warning (raising would keep every
        instance from leading). Trace contexts of placements no longer in flight (removed
        by a release that does not save them) are removed."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(SCHEDULER_RUNNING_KEY)
            pipe.hgetall(TRACES_KEY)
            raw, traces = await pipe.execute()
        out = []
        for pid, value in raw.items():
            try:
                saved = json.loads(value)
                if isinstance(saved, dict):
                    saved.pop("borrowed", None)  # for (or by) an earlier release: unread here
                    saved["trace_carrier"] = _carrier(traces.get(pid))
                out.append(RunningPlacement.model_validate(saved))
            except ValueError as exc:
                log.warning("ignoring the unreadable placement in flight %s: %s",
                            pid.decode(errors="replace"), exc)
        if stale := traces.keys() - raw.keys():
            await self._redis.hdel(TRACES_KEY, *stale)
        return out


def _carrier(saved: bytes | None) -> dict[str, str]:
    """A saved trace context; empty where there is none or it cannot be read (what is sent
    for the placement then begins a new trace; the placement itself is kept)."""
    try:
        return {} if saved is None else _CARRIER.validate_json(saved)
    except ValueError:
        return {}


def claim_state(owner: bytes | None, held: bool) -> ClaimState:
    """A placement's state from its claim's owner and whether its node still holds it."""
    if owner is None:
        return "untaken"
    if owner.decode() == FENCED_CLAIM:
        return "fenced"
    return "held" if held else "ended"
