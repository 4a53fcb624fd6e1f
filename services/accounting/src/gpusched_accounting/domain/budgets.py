"""Per-tenant budgets: which period a moment falls in, what was spent, and whether the
budget is exhausted. Pure; the store reads the spending and sets the router's flag."""

from __future__ import annotations

import calendar
import math
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpusched_accounting.domain.usage import Totals
from gpusched_common.catalog import ConfigFloat, read_config_as

Period = Literal["day", "month"]
Unit = Literal["tokens", "usd"]


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tenant: str
    period: Period = Field(description="Calendar day or month, UTC.")
    limit: ConfigFloat = Field(gt=0, allow_inf_nan=False,
                               description="Tokens (prompt + completion) or USD per period.")
    unit: Unit


class BudgetTable(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    budgets: tuple[Budget, ...] = ()

    @model_validator(mode="after")
    def _one_per_period_and_unit(self) -> BudgetTable:
        seen: set[tuple[str, str, str]] = set()
        for b in self.budgets:
            if (b.tenant, b.period, b.unit) in seen:
                raise ValueError(f"tenant '{b.tenant}' has two {b.period} budgets in {b.unit}: "
                                 "keep one")
            seen.add((b.tenant, b.period, b.unit))
        return self

    def of(self, tenant: str) -> tuple[Budget, ...]:
        return tuple(b for b in self.budgets if b.tenant == tenant)


def load_budgets(config_dir: Path, tenants: Collection[str]) -> BudgetTable:
    """Read `budgets.yaml`, whose budgets must be of `tenants` (tenants.yaml's: no other
    tenant's request is taken in, so a misspelt name would be a budget never enforced); a
    missing file means no budgets."""
    path = config_dir / "budgets.yaml"
    if not path.is_file():
        return BudgetTable()
    table = read_config_as(BudgetTable, path, empty_ok=True)
    unknown = sorted({b.tenant for b in table.budgets} - set(tenants))
    if unknown:
        raise ValueError(f"{path} is invalid: tenant(s) {', '.join(unknown)} not in "
                         f"tenants.yaml ({', '.join(sorted(tenants))})")
    return table


@dataclass(frozen=True)
class PeriodWindow:
    label: str
    """'day:2026-11-30' or 'month:2026-11'."""
    start_ms: int
    end_ms: int
    day_starts_s: tuple[int, ...]
    """Start of every day bucket in the period (what the spending is summed over)."""


def period_of(at_ms: int, period: Period) -> PeriodWindow:
    moment = datetime.fromtimestamp(at_ms / 1000, UTC)
    if period == "day":
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        start_s = int(start.timestamp())
        return PeriodWindow(f"day:{start:%Y-%m-%d}", start_s * 1000, (start_s + 86_400) * 1000,
                            (start_s,))
    start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    days = calendar.monthrange(start.year, start.month)[1]
    start_s = int(start.timestamp())
    return PeriodWindow(f"month:{start:%Y-%m}", start_s * 1000,
                        (start_s + days * 86_400) * 1000,
                        tuple(start_s + d * 86_400 for d in range(days)))


def spent(totals: Totals, unit: Unit) -> float:
    return float(totals.tokens) if unit == "tokens" else totals.cost_usd


def is_exhausted(budget: Budget, spending: Totals) -> bool:
    return spent(spending, budget.unit) >= budget.limit


def reason(budget: Budget, window: PeriodWindow, spending: Totals) -> str:
    """What a client is told with its 429."""
    # cents, or as many places as a limit under a dollar needs ($0.00 of $0.00 said nothing)
    places = max(2, 2 - math.floor(math.log10(budget.limit)))
    amount = (f"{spent(spending, 'tokens'):.0f} of {budget.limit:.0f} tokens"
              if budget.unit == "tokens" else
              f"${spent(spending, 'usd'):.{places}f} of ${budget.limit:.{places}f}")
    ends = datetime.fromtimestamp(window.end_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (f"tenant '{budget.tenant}' has spent its {budget.period} budget ({amount} in "
            f"{window.label}); new requests are accepted again from {ends}, or raise the "
            "budget in budgets.yaml and restart accounting")
