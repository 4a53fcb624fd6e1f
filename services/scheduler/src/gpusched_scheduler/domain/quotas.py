"""Hard per-tenant limits checked when a request is first admitted: tokens per minute and
requests in flight. Over a limit is a value (the reason), answered as a 429 rejection."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpusched_common.catalog import TenantQuota

WINDOW_MS = 60_000


@dataclass
class QuotaBook:
    _admitted: dict[str, deque[tuple[int, int]]] = field(default_factory=dict)
    """Tenant -> (admitted at ms, tokens) within the last minute."""

    def tokens_last_minute(self, tenant: str, now_ms: int) -> int:
        window = self._admitted.get(tenant)
        if not window:
            return 0
        while window and window[0][0] <= now_ms - WINDOW_MS:
            window.popleft()
        return sum(t for _, t in window)

    def check(self, tenant: str, quota: TenantQuota, tokens: int, inflight: int,
              now_ms: int) -> str | None:
        """None when the request may be admitted, else why not (with what to do)."""
        if quota.max_inflight_requests is not None and inflight >= quota.max_inflight_requests:
            return (f"tenant '{tenant}' has {inflight} requests in flight, its limit is "
                    f"{quota.max_inflight_requests}; retry when some have finished")
        if quota.tokens_per_minute is not None:
            used = self.tokens_last_minute(tenant, now_ms)
            if used + tokens > quota.tokens_per_minute:
                window = self._admitted.get(tenant)
                retry_s = 1 + (window[0][0] + WINDOW_MS - now_ms) // 1000 if window else 60
                return (f"tenant '{tenant}' is over its limit of {quota.tokens_per_minute} "
                        f"tokens per minute ({used} used, this request needs {tokens}); "
                        f"retry in {retry_s} s")
        return None

    def admit(self, tenant: str, tokens: int, now_ms: int) -> None:
        """Record an admission; entries older than the window are dropped as it goes, so
        memory stays bounded by one minute of admissions."""
        window = self._admitted.setdefault(tenant, deque())
        while window and window[0][0] <= now_ms - WINDOW_MS:
            window.popleft()
        window.append((now_ms, tokens))
