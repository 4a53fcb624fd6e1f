"""Continuous batching: one loop per (device, model) decodes one token for every running
sequence per step; sequences join after their prefill and leave when done or cancelled.

Executors supply `prefill(seq) -> first token` and `step(seqs) -> one token each`; the
batcher never waits for a batch to fill, and a cancelled consumer leaves at the next step.
A failed prefill or decode step fails only the sequences it belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gpusched_agent.adapters.executor import ExecutorError


@dataclass(eq=False)
class Sequence:
    key: str
    max_tokens: int
    kv_tokens: int
    """Tokens in its KV cache now (prompt + generated)."""
    state: Any = None
    """Executor-specific: a KV cache, a random generator."""
    produced: int = 0
    out: asyncio.Queue[str | BaseException | None] = field(default_factory=asyncio.Queue)
    left: bool = False


Prefill = Callable[[Sequence], Awaitable[str]]
Step = Callable[[list[Sequence]], Awaitable[list[str]]]


class ContinuousBatcher:
    def __init__(self, prefill: Prefill, step: Step, max_batch: int = 256) -> None:
        self._prefill = prefill
        self._step = step
        self._max_batch = max_batch
        self._joining: list[Sequence] = []
        self.active: list[Sequence] = []
        self._loop: asyncio.Task[None] | None = None
        self._prefilling: Sequence | None = None
        """Taken from the joining list, not yet active: a close() meanwhile must end it."""
        self._wake = asyncio.Event()

    @property
    def kv_tokens(self) -> int:
        return sum(s.kv_tokens for s in self.active)

    @property
    def size(self) -> int:
        return len(self.active) + len(self._joining)

    async def run(self, seq: Sequence) -> AsyncGenerator[str, None]:
        """The tokens of `seq` as the batch produces them."""
        self._joining.append(seq)
        self._wake.set()
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._forever(), name=f"batch-{seq.key}")
        try:
            while True:
                item = await seq.out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            seq.left = True
            with contextlib.suppress(ValueError):
                self._joining.remove(seq)
            with contextlib.suppress(ValueError):
                self.active.remove(seq)

    async def close(self) -> None:
        """Stop the loop; every sequence still in the batch ends with an ExecutorError (the
        model was unloaded under it) instead of waiting for a token forever."""
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        gone = ExecutorError("the model was unloaded while the request ran on it")
        prefilling = [] if self._prefilling is None else [self._prefilling]
        for seq in [*prefilling, *self.active, *self._joining]:
            seq.out.put_nowait(gone)
            seq.left = True
        self._prefilling = None
        self.active.clear()
        self._joining.clear()

    def _emit(self, seq: Sequence, token: str) -> None:
        seq.out.put_nowait(token)
        seq.produced += 1
        seq.kv_tokens += 1
        if seq.produced >= seq.max_tokens:
            seq.out.put_nowait(None)
            seq.left = True
            with contextlib.suppress(ValueError):
                self.active.remove(seq)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        seq.out.put_nowait(exc)
        seq.left = True
        with contextlib.suppress(ValueError):
            self.active.remove(seq)

    async def _step_apart(self, batch: list[Sequence]) -> None:
        """One decode step for `batch`. A step that fails is tried again as two halves, and
        so on down to one sequence: the error ends only the sequences whose step fails
        alone, and a batch too big for the device's memory goes on in smaller steps.
        A step must be safe to run again when it raised (it writes a sequence's state only
        once all of the batch has its token)."""
        batch = [s for s in batch if not s.left]  # a half's consumers may have gone
        if not batch:
            return
        try:
            tokens = await self._step(batch)
        except Exception as exc:  # noqa: BLE001 - told apart below
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return
            half = len(batch) // 2
            await self._step_apart(batch[:half])
            await self._step_apart(batch[half:])
            return
        if len(tokens) != len(batch):  # a fault of the executor's, after it wrote its state:
            wrong = ExecutorError(f"a decode step gave {len(tokens)} tokens for "
                                  f"{len(batch)} sequences")  # not to be run again
            for seq in batch:
                self._fail(seq, wrong)
            return
        for seq, token in zip(batch, tokens, strict=True):
            if not seq.left:
                self._emit(seq, token)

    async def _forever(self) -> None:
        while self._joining or self.active:
            try:
                while self._joining and len(self.active) < self._max_batch:
                    seq = self._joining.pop(0)
                    if seq.left:
                        continue
                    self._prefilling = seq  # kept when cancelled: close() ends it
                    try:
                        first = await self._prefill(seq)
                    except Exception as exc:  # noqa: BLE001 - its own (a prompt out of memory)
                        self._prefilling = None
                        seq.out.put_nowait(exc)  # popped: the handler below would miss it
                        continue
                    self._prefilling = None
                    if not seq.left:
                        self.active.append(seq)
                        self._emit(seq, first)
                batch = [s for s in self.active if not s.left]
                if batch:
                    await self._step_apart(batch)
            except Exception as exc:  # noqa: BLE001 - a fault of the loop's own: every consumer
                for seq in [*self.active, *self._joining]:
                    seq.out.put_nowait(exc)
                self.active.clear()
                self._joining.clear()
