"""Idempotency keys (the `Idempotency-Key` header, as Stripe's API has it): a client that
sends one may send the request again, after a lost connection or a router's crash, and gets
the first one's outcome instead of a second run. Pure: what a key and a request look like."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from gpusched_router.domain.openai_api import ApiError

MAX_KEY_CHARS = 255
TAKE_OVER_GRACE_S = 10.0
"""Beyond the publish time-out: a first use still running answers (its request taken in, or
refused and its key freed) within the time-out plus one Redis time-out (5 s) and this."""


@dataclass(frozen=True)
class FirstUse:
    """Who holds a key: the request id its first use took, the digest of its request, and
    when the holder claimed it (ms since the epoch). Stored as one string."""

    request_id: str
    digest: str
    claimed_at_ms: int

    def __str__(self) -> str:
        return f"{self.request_id} {self.digest} {self.claimed_at_ms}"

    @classmethod
    def parse(cls, stored: str) -> FirstUse:
        request_id, digest, claimed_at = (stored.split(" ") + ["0"])[:3]  # 0: an older router
        return cls(request_id, digest, int(claimed_at))

    def abandoned(self, now_ms: int, publish_timeout_s: float) -> bool:
        """True once the holder has had the time to take its request in: if its status is
        still missing, its router died (or lost Redis) on the way, and a retry takes over."""
        return now_ms - self.claimed_at_ms > (publish_timeout_s + TAKE_OVER_GRACE_S) * 1000


def passes_later(outcome: dict[str, Any]) -> bool:
    """Whether a key's stored outcome is a refusal a retry with the key goes past and runs:
    its request ran nothing and may be admitted later (over quota, 429; not placed within
    its queue limit, 503). Replayed, the key's retries got that refusal for a day."""
    return outcome.get("type") == "rejection" and (
        outcome.get("status_code") == 429 or outcome.get("code") == "queue_time_exceeded")


def check_key(key: str) -> ApiError | None:
    """A 400 for a key that is empty, too long or not printable ASCII; None when it is
    fine."""
    if not 1 <= len(key) <= MAX_KEY_CHARS or not all(" " <= c <= "~" for c in key):
        return ApiError(400, f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} printable ASCII "
                        "characters (a UUID will do)", param="Idempotency-Key")
    return None


DELIVERY_FIELDS = frozenset({"stream", "stream_options"})
"""Body fields that choose how the reply is delivered, not what is asked: a retry may change
them, and gets the first use's reply in the form it asks for."""


def request_digest(path: str, body: Any) -> str:
    """What a key stands for: the endpoint and the decoded body but its DELIVERY_FIELDS,
    independent of key order and whitespace, so a retry of the same request matches and any
    other does not."""
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in DELIVERY_FIELDS}
    canonical = json.dumps([path, body], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def reused(key: str) -> ApiError:
    return ApiError(400, f"Idempotency-Key '{key}' was used for a different request; use a new "
                    "key for each request", code="idempotency_key_reused",
                    param="Idempotency-Key")
