"""Hard per-tenant limits checked when a request is first admitted: tokens per minute and
requests in flight. Over a limit is a value (the reason, and when a retry may fit), answered
as a 429 rejection."""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from dataclasses import dataclass, field

from gpusched_common.catalog import TenantQuota

WINDOW_MS = 60_000


@dataclass(frozen=True)
class OverQuota:
    reason: str
    retry_after_s: int | None = None
    """When the request fits the limit again as far as the admissions so far tell (later
    ones may take the room first); None when that depends on requests finishing."""


@dataclass
class QuotaBook:
    _admitted: dict[str, deque[tuple[int, int]]] = field(default_factory=dict)
    """Tenant -> (admitted at ms, tokens) within the last minute."""

    def tokens_last_minute(self, tenant: str, now_ms: int) -> int:
        return sum(t for _, t in self._window(tenant, now_ms))

    def _window(self, tenant: str, now_ms: int) -> deque[tuple[int, int]]:
        """`tenant`'s admissions in the minute up to `now_ms`, oldest first. Those older
        leave it, and so do those stamped after `now_ms`: the clock was stepped back, and
        kept they counted for the whole step, and a 429 said to retry that far ahead (past
        an hour, none could be sent, and the request topic stalled on it). The minute before
        such a step is forgotten instead: its tokens may be admitted again once. So `now_ms`
        is the clock as it reads now, never an older reading (another batch may have
        admitted since: dropped as if stamped after a step, the tenant went past its
        limit)."""
        window = self._admitted.setdefault(tenant, deque())
        while window and window[0][0] <= now_ms - WINDOW_MS:
            window.popleft()
        while window and window[-1][0] > now_ms:  # kept in time order: newest last
            window.pop()
        return window

    def check(self, tenant: str, quota: TenantQuota, tokens: int, inflight: int,
              now_ms: int) -> OverQuota | None:
        """None when the request may be admitted, else why not (with what to do). A request
        of more tokens than the limit itself is refused before this (`never_admitted`)."""
        if quota.max_inflight_requests is not None and inflight >= quota.max_inflight_requests:
            return OverQuota(f"tenant '{tenant}' has {inflight} requests in flight, its limit "
                             f"is {quota.max_inflight_requests}; retry when some have finished")
        if quota.tokens_per_minute is not None:
            used = self.tokens_last_minute(tenant, now_ms)
            if used + tokens > quota.tokens_per_minute:
                retry_s = self._seconds_until_room(tenant, used + tokens - quota.tokens_per_minute,
                                                   now_ms)
                return OverQuota(f"tenant '{tenant}' is over its limit of "
                                 f"{quota.tokens_per_minute} tokens per minute ({used} used, "
                                 f"this request needs {tokens}); retry in {retry_s} s", retry_s)
        return None

    def _seconds_until_room(self, tenant: str, excess: int, now_ms: int) -> int:
        """Whole seconds until admissions of at least `excess` tokens have left the window
        (the oldest leave first); a minute when the window holds fewer."""
        freed = 0
        for at_ms, tokens in self._window(tenant, now_ms):  # so each within the minute
            freed += tokens
            if freed >= excess:
                return max(1, -(-(at_ms + WINDOW_MS - now_ms) // 1000))
        return WINDOW_MS // 1000

    def refund(self, tenant: str, tokens: int, admitted_ms: int) -> None:
        """Take back an admission of `tokens` at `admitted_ms` that never ran (nothing, once
        it has left the window)."""
        with contextlib.suppress(KeyError, ValueError):
            self._admitted[tenant].remove((admitted_ms, tokens))

    def restore(self, tenant: str, tokens: int, admitted_ms: int) -> None:
        """Put back an admission `refund` took (its work waits again), in time order."""
        window = self._admitted.setdefault(tenant, deque())
        window.insert(bisect.bisect(window, (admitted_ms, tokens)), (admitted_ms, tokens))

    def admit(self, tenant: str, tokens: int, now_ms: int) -> None:
        """Record an admission; entries outside the window are dropped as it goes, so
        memory stays bounded by one minute of admissions."""
        self._window(tenant, now_ms).append((now_ms, tokens))
