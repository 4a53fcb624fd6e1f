"""A bounded memory of recently seen keys, for skipping redeliveries and copies."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class Recent(OrderedDict[Any, Any]):
    """The last `limit` keys added, in order of first addition; adding one more forgets the
    oldest."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if len(self) > self.limit:
            self.popitem(last=False)
