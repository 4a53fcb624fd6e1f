"""GPU-seconds as each request's share of a GPU integrated over time (pure, time passed in).

While n requests run on a GPU, each accrues dt/n: the shares of one GPU always add up to
the time it was busy, so a node never bills more GPU-seconds than it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ShareMeter:
    last_s: float = 0.0
    accrued_s: dict[str, float] = field(default_factory=dict)
    """Per active request: GPU-seconds not yet taken by `take`."""

    def _advance(self, now_s: float) -> None:
        if self.accrued_s:
            if now_s <= self.last_s:  # a clock stepped back: up to last_s is accrued already,
                return  # and accrues again from there only, not from now_s
            share = (now_s - self.last_s) / len(self.accrued_s)
            for key in self.accrued_s:
                self.accrued_s[key] += share
        self.last_s = now_s

    def start(self, key: str, now_s: float) -> None:
        self._advance(now_s)
        self.accrued_s[key] = 0.0

    def take(self, key: str, now_s: float) -> float:
        """GPU-seconds accrued by `key` since it started or was last taken (a delta)."""
        self._advance(now_s)
        value = self.accrued_s.get(key, 0.0)
        if key in self.accrued_s:
            self.accrued_s[key] = 0.0
        return value

    def stop(self, key: str, now_s: float) -> float:
        """Remove `key`, returning what it accrued since the last `take`."""
        value = self.take(key, now_s)
        self.accrued_s.pop(key, None)
        return value
