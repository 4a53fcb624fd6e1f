"""The executor interface the runtime drives: load and unload models, generate tokens.

Three implementations: `simulated` (performance model), `torch` (a real transformer on CPU
or CUDA) and `openai` (forwards to an inference server on the node).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal, Protocol

from gpusched_common.catalog import GpuType, ModelSpec
from gpusched_common.contracts import InferenceRequest


@dataclass(frozen=True)
class Job:
    """One request to generate on one device (the first GPU of its gang)."""

    request: InferenceRequest
    prompt_tokens: int
    model: ModelSpec
    gpu_type: GpuType
    gpu_index: int
    key: str
    """The placement id: unique per attempt."""
    prefix: str = ""
    """Text earlier attempts generated (a resumed request): the engine continues after it.
    `request` then already has it appended to its prompt, and max_tokens is what is left of
    its reply (`InferenceRequest.reply_limit`, less that text's tokens)."""


@dataclass(frozen=True)
class PromptTokens:
    """The prompt's length as the engine counted it (its tokenizer and chat template; the
    prefix of a resumed request included): billed instead of gpusched's estimate."""

    count: int


@dataclass(frozen=True)
class EngineFinished:
    """Why the engine said it ended the reply, which the result's finish reason then is:
    `stop` (the model ended its text, or a stop string ended it, on the last token
    `max_tokens` allows too) or `length` (a limit: before `max_tokens`, the model's context
    ran out). Without it the runtime tells them apart by the reply's length alone. The
    reply is whole once it came: whatever ends the run after it (the connection dropped
    before the stream's end, a preempt, a drain, a cancel) completes the request with it,
    rather than hand it back to go on past its end."""

    reason: Literal["stop", "length"]


class Executor(Protocol):
    name: str
    time_scale: float
    """Wall seconds per model second: GPU-seconds are billed as measured / time_scale."""
    refuses: frozenset[int]
    """The statuses of the `ExecutorRefused` it may raise: the agent serves each model's
    refusal count of each at 0 from its start, so that a first refusal is a rise to alert
    on (none for an executor that never refuses)."""

    async def load(self, model: ModelSpec, gpu_index: int) -> None:
        """Make `model` ready on the device (idempotent)."""

    async def unload(self, model_name: str, gpu_index: int) -> None:
        """Free the model's memory on the device (idempotent)."""

    def generate(self, job: Job) -> AsyncGenerator[str | PromptTokens | EngineFinished, None]:
        """Yield the text of each generated token, one token per item, up to max_tokens
        (fewer when the model ends its text). Closing the generator (the runtime does at a
        stop string) or cancelling its consumer stops the request promptly. The runtime
        applies `request.stop`; an executor may also pass it on to its engine. One whose
        engine counts the prompt with the model's tokenizer yields that count once, as
        `PromptTokens`, as soon as it knows it; one whose engine says why it ended the
        reply yields that as `EngineFinished` before it ends."""

    async def health(self) -> str | None:
        """Why the executor cannot run work now (its engine is down or loading), or None.
        Asked every heartbeat, and answered within a few seconds."""

    def served_models(self) -> frozenset[str] | None:
        """The model names its engine serves, as it last said (`health` asks), or None: any
        model it is given (it runs the catalog's itself, or has not said yet)."""

    async def close(self) -> None:
        """Release clients, threads and device memory."""


class ExecutorError(RuntimeError):
    """A request failed inside the executor (the agent survives; the request ends failed)."""


class ExecutorTurnedAway(ExecutorError):
    """The engine answered an error status instead of taking the request: it processed none
    of it, so the request ends failed without its prompt billed (the GPU time its placement
    held is billed)."""


class ExecutorRefused(ExecutorTurnedAway):
    """The engine refused the request itself as invalid (its prompt longer than the model's
    context by the engine's own tokenizer and chat template, turns its chat template does not
    take): any engine would refuse it the same, so the request ends failed at once, with no
    hand-back, and its client is answered with `status_code` (a 4xx it can act on) and the
    engine's message. The torch executor refuses so a request beyond its model's 8,192
    positions, a limit of its own below most catalog models' context, which an engine on
    another node might run: it is not handed on all the same (README and ARCHITECTURE say
    so, and the alert on refusals)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class ExecutorLacksModel(ExecutorError):
    """The engine does not serve the model under the name it was sent (vLLM's 404 "The
    model ... does not exist": GPUSCHED_OPENAI_MODEL or GPUSCHED_MODELS names one its server
    does not, or it serves the model under another name): this node cannot run it, others
    may. The runtime hands the request back, and keeps the model off this node for the
    cooldown of a failed load, so its work goes elsewhere or waits instead of failing."""


class ExecutorUnavailable(ExecutorError):
    """The executor's engine could not take or finish the request: it is down, restarting
    or overloaded, not at fault with this request. The runtime hands the request back to be
    placed elsewhere (going on after the tokens it already has) and the node takes no more
    work until `health` says the engine is back."""
