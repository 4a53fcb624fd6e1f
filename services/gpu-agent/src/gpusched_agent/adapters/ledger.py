"""Where the agent checks placement claims and the scheduler's fencing token (Redis), plus
an in-memory twin for tests and benchmarks.

A claim also files the placement under its node (with the agent run that claimed it) until
the run ends it, so a run that starts after a crash finds the work its predecessor left.
Before a run publishes the records that end a placement it files them there in the
placement's stead (an outbox): a run that starts after a crash in between publishes them
again rather than running the request a second time. Either is filed with the placement's
W3C trace context, so that what a later run publishes for it stays in its request's trace."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol
from urllib.parse import parse_qsl, urlencode

from redis.asyncio import Redis

from gpusched_common.redis_keys import (
    CANCELLED_KEY,
    CLAIM_TTL_S,
    NODE_ALIVE_KEY,
    NODE_ALIVE_TTL_S,
    NODE_CLAIMS_KEY,
    PLACEMENT_CLAIM_KEY,
    SCHEDULER_EPOCH_KEY,
    SCHEDULER_RUNNING_KEY,
)

_CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
  redis.call('SET', KEYS[4], ARGV[5], 'EX', ARGV[2])
elseif redis.call('HGET', KEYS[2], ARGV[3]) ~= ARGV[4] then
  return {0, redis.call('GET', KEYS[4]) or ''}
end
return {1, redis.call('GET', KEYS[3]) or ''}
"""
"""Claim and file in one step, keeping the digest of what the request asks for (KEYS[4]),
and read the router's cancel of the request (KEYS[3]) in the same round trip: {1, the
cancel's reason ('' for none)}, or {0, the claimant's digest ('' where none was kept: a
fenced claim, or one from before digests were)} when another holds the claim. The `elseif`
answers a retried call (the client retries on a lost connection) whose first attempt was
applied: still this run's own claim."""
CLAIM_ASKS_KEY = "gpusched:agent:placement:{}:asks"
"""The `asks_digest` of the request a claimed placement ran (as long as the claim): a later
placement under the same id that asks for something else is another request reusing the id,
not a redelivery."""


@dataclass(frozen=True)
class Claim:
    """A placement this agent run holds."""

    cancelled: str | None
    """The reason the router cancelled its request with, kept in Redis (None: not
    cancelled); the agent may have been down when that cancel went out on Kafka."""


@dataclass(frozen=True)
class Taken:
    """A placement another claim holds: an agent (this run, or another) took it already, or
    the scheduler fenced it."""

    asks: str | None
    """The `asks_digest` of the request the claimant took it for; None where unknown."""

class LeftOver(NamedTuple):
    """A placement a crashed run of the node claimed and never released."""

    placement_id: str
    payload: bytes
    """The placement's JSON, or the outbox of its final records."""
    carrier: dict[str, str]
    """The W3C trace headers of its placement's trace ({} for a claim filed without)."""

REPORT_CLAIM_KEY = "gpusched:agent:report:{}"
"""Which agent dead-letters a record that every agent reads and none can (SET NX, first wins),
so that it is reported once, not once per node."""


class PlacementLedger(Protocol):
    async def claim(self, placement_id: str, node_id: str, run_id: int, placement: bytes,
                    request_id: str, asks: str, carrier: Mapping[str, str] = {}
                    ) -> Claim | Taken:
        """A `Claim` for the first claim of `placement_id` ever (across redeliveries and
        agent restarts), made for a request whose `asks_digest` is `asks`; `Taken` for
        every later one. The first also files it under the node, with `carrier` (the W3C
        trace headers of the placement's trace)."""

    async def finishing(self, placement_id: str, node_id: str, run_id: int, outbox: bytes,
                        carrier: Mapping[str, str] = {}) -> None:
        """File `outbox` (the records that end the placement, about to be published) under
        the node in the placement's stead, for run `run_id`, with `carrier` as `claim`."""

    async def release(self, placement_id: str, node_id: str) -> None:
        """The run ended the placement (its final usage is sent): no longer the node's."""

    async def left_over(self, node_id: str, run_id: int) -> list[LeftOver]:
        """What runs of this node other than `run_id` claimed and never released: what a
        crashed run left behind."""

    async def still_placed(self, placement_ids: list[str]) -> list[bool]:
        """For each, whether the scheduler still counts it as running (not yet retried)."""

    async def leader_epoch(self) -> int | None:
        """The current scheduler leader's fencing token, None when none is recorded."""

    async def alive(self, node_id: str) -> None:
        """Say the node's agent is alive, for NODE_ALIVE_TTL_S."""

    async def first_to_report(self, record_ref: str, node_id: str) -> bool:
        """True for the first agent to ask about `record_ref` (a record every agent reads):
        that one reports it, the others do not."""


class RedisLedger:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._claim = redis.register_script(_CLAIM)

    async def claim(self, placement_id: str, node_id: str, run_id: int, placement: bytes,
                    request_id: str, asks: str, carrier: Mapping[str, str] = {}
                    ) -> Claim | Taken:
        claimed, said = await self._claim(
            keys=[PLACEMENT_CLAIM_KEY.format(placement_id), NODE_CLAIMS_KEY.format(node_id),
                  CANCELLED_KEY.format(request_id), CLAIM_ASKS_KEY.format(placement_id)],
            args=[node_id, CLAIM_TTL_S, placement_id, _entry(run_id, carrier, placement), asks])
        said = said.decode(errors="replace") or None
        return Claim(said) if claimed else Taken(said)

    async def finishing(self, placement_id: str, node_id: str, run_id: int, outbox: bytes,
                        carrier: Mapping[str, str] = {}) -> None:
        await self._redis.hset(NODE_CLAIMS_KEY.format(node_id), placement_id,
                               _entry(run_id, carrier, outbox))

    async def release(self, placement_id: str, node_id: str) -> None:
        await self._redis.hdel(NODE_CLAIMS_KEY.format(node_id), placement_id)

    async def left_over(self, node_id: str, run_id: int) -> list[LeftOver]:
        held = await self._redis.hgetall(NODE_CLAIMS_KEY.format(node_id))
        return _others({pid.decode(): entry for pid, entry in held.items()}, run_id)

    async def still_placed(self, placement_ids: list[str]) -> list[bool]:
        if not placement_ids:
            return []
        return [v is not None for v in await self._redis.hmget(SCHEDULER_RUNNING_KEY,
                                                               placement_ids)]

    async def leader_epoch(self) -> int | None:
        raw = await self._redis.get(SCHEDULER_EPOCH_KEY)
        return None if raw is None else int(raw)

    async def alive(self, node_id: str) -> None:
        await self._redis.set(NODE_ALIVE_KEY.format(node_id), b"1", ex=NODE_ALIVE_TTL_S)

    async def first_to_report(self, record_ref: str, node_id: str) -> bool:
        key = REPORT_CLAIM_KEY.format(record_ref)
        # a retried SET whose first try was applied still finds this node's own claim
        return bool(await self._redis.set(key, node_id, nx=True, ex=CLAIM_TTL_S)) or \
            await self._redis.get(key) == node_id.encode()


class MemoryLedger:
    def __init__(self, leader_epoch: int | None = None) -> None:
        self.claims: dict[str, str] = {}
        self.asks: dict[str, str] = {}
        self.held: dict[str, dict[str, bytes]] = {}
        self.epoch = leader_epoch
        self.retried: set[str] = set()
        """Placements the scheduler has retried elsewhere (no longer running for it)."""
        self.alive_nodes: set[str] = set()
        self.reporters: dict[str, str] = {}
        self.cancels: dict[str, str] = {}
        """Request id -> reason, as the router keeps cancels in Redis."""

    async def claim(self, placement_id: str, node_id: str, run_id: int, placement: bytes,
                    request_id: str, asks: str, carrier: Mapping[str, str] = {}
                    ) -> Claim | Taken:
        if placement_id in self.claims:
            return Taken(self.asks.get(placement_id))
        self.claims[placement_id] = node_id
        self.asks[placement_id] = asks
        self.held.setdefault(node_id, {})[placement_id] = _entry(run_id, carrier, placement)
        return Claim(self.cancels.get(request_id))

    async def finishing(self, placement_id: str, node_id: str, run_id: int, outbox: bytes,
                        carrier: Mapping[str, str] = {}) -> None:
        self.held.setdefault(node_id, {})[placement_id] = _entry(run_id, carrier, outbox)

    async def release(self, placement_id: str, node_id: str) -> None:
        self.held.get(node_id, {}).pop(placement_id, None)

    async def left_over(self, node_id: str, run_id: int) -> list[LeftOver]:
        return _others(self.held.get(node_id, {}), run_id)

    async def still_placed(self, placement_ids: list[str]) -> list[bool]:
        return [pid not in self.retried for pid in placement_ids]

    async def leader_epoch(self) -> int | None:
        return self.epoch

    async def alive(self, node_id: str) -> None:
        self.alive_nodes.add(node_id)

    async def first_to_report(self, record_ref: str, node_id: str) -> bool:
        return self.reporters.setdefault(record_ref, node_id) == node_id


def _entry(run_id: int, carrier: Mapping[str, str], payload: bytes) -> bytes:
    """A node's claims-hash entry: `<run id>[;<carrier, URL-encoded>] <payload>`. The trace
    headers go before the first space, where readers of the payload (the scheduler,
    `outbox.in_claim`) do not look, and which the release before read as a run id other
    than its own: it recovers such a claim still, without its trace."""
    head = b"%d" % run_id
    if carrier:
        head += b";" + urlencode(carrier).encode()
    return head + b" " + payload


def _others(held: dict[str, bytes], run_id: int) -> list[LeftOver]:
    out = []
    for placement_id, entry in held.items():
        head, _, payload = entry.partition(b" ")
        run, _, carrier = head.partition(b";")  # none in a claim the release before filed
        if run != b"%d" % run_id:
            out.append(LeftOver(placement_id, payload,
                                dict(parse_qsl(carrier.decode(errors="replace")))))
    return out
