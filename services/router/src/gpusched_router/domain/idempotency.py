"""Idempotency keys (the `Idempotency-Key` header, as Stripe's API has it): a client that
sends one may send the request again, after a lost connection or a router's crash, and gets
the first one's outcome instead of a second run. Pure: what a key and a request look like."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from gpusched_router.domain.openai_api import ApiError

IDEMPOTENCY_HEADER = "idempotency-key"
MAX_KEY_CHARS = 255


def check_key(key: str) -> ApiError | None:
    """A 400 for a key that is empty, too long or not printable ASCII; None when it is fine."""
    if not 1 <= len(key) <= MAX_KEY_CHARS or not all(" " <= c <= "~" for c in key):
        return ApiError(400, f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} printable ASCII "
                        "characters (a UUID will do)", param="Idempotency-Key")
    return None


def request_digest(path: str, body: Any) -> str:
    """What a key stands for: the endpoint and the decoded body, independent of key order
    and whitespace, so a retry of the same request matches and any other does not."""
    canonical = json.dumps([path, body], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def reused(key: str) -> ApiError:
    return ApiError(400, f"Idempotency-Key '{key}' was used for a different request; use a new "
                    "key for each request", code="idempotency_key_reused",
                    param="Idempotency-Key")
