"""The openai-compatible executor: forwards each request to an inference server on the node
(vLLM, SGLang, TGI, llama.cpp server) over its streaming /v1/completions API, or for a chat
request /v1/chat/completions, so the engine applies the model's own chat template.

The engine does the batching and owns the memory. It is asked for its own token counts
(`stream_options`: `include_usage`, and `continuous_usage_stats`, which vLLM and SGLang
honour with a running count on every event): a delta that holds several tokens
(speculative decoding, or characters that span tokens) yields one empty item per further
token and then its text (so a stop string in it ends the request with all of them
counted), and tokens the engine generated without streaming text for them (counted only in
its final usage) yield empty items at the end. So the runtime, which bills one token per
item, bills what the engine generated. The engine's count of the prompt (its tokenizer,
and the chat template) is yielded once as `PromptTokens`. An engine that sends no counts
(or with `stream_usage` off, for one that refuses the field) has each text delta counted
as one token, and the prompt is billed as estimated. Closing the stream closes the
connection: engines abort there.

A reply that is not an event stream, a stream that ends without `[DONE]` (unless after the
engine's finish reason: the reply was whole) and an event not of OpenAI's shape fail the
request instead of passing for a short answer; the engine's finish reason is the result's
(`length` before `max_tokens`: its context ran out; `stop` on the last token `max_tokens`
allows: a stop string or the end of the text came there).
An error body, a health answer and an event line are each read within a bound of time and
size, so an engine that trickles cannot hold the agent. Text is passed on in whole
characters (an emoji split into two JSON escapes across events is joined; a lone half
becomes U+FFFD), as records need.

An engine that cannot be reached, answers 429, 502, 503 or 504 (overloaded, restarting, or
a proxy without it), drops the connection mid-stream (it crashed), sends nothing (or
nothing but keep-alives) for `timeout_s` (it is wedged), or sends an error event inside its
stream or a finish reason of a reply given up on (vLLM's `abort`, `error`) is unavailable,
not at fault with the request: the runtime hands the request back. (vLLM reports whatever
fails once it has begun a stream as an error event, its engine's death included, as a 400;
one that came before any token with a refusal's status is a refusal of the request, below:
vLLM's own check of the prompt's length, unless it is vLLM's word for its engine's death or
the engine then shows itself dead, `_failed_in_stream`.) One that sends events but no token
for `timeout_s` is alive, and fails that request. One that answers 400, 413 or 422 refuses
the request itself (vLLM's 400 for a prompt longer than the model's context by its
tokenizer): the request fails with that status and the engine's message, which its client
is answered with. A 404 saying the model does not exist is this node's setup, not the
request's (the name it is sent under is not one the server serves): the runtime hands it
back (`ExecutorLacksModel`). Any other error status (another 404, a 500) fails it too;
but a 5xx in vLLM's words for its engine's death is the engine failing, as above.
Either failure bills no prompt (`ExecutorTurnedAway`): the engine processed none of it.
`health` asks its `/v1/models`, which each of these engines serves once its model is loaded
(the models it lists are the ones the node serves, `served_models`), and after a stall or
an error in a stream a one-token completion too, which a wedged or dead vLLM, whose API
still answers /v1/models, does not give.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import httpx

from gpusched_agent.adapters.executor import (
    EngineFinished,
    ExecutorError,
    ExecutorLacksModel,
    ExecutorRefused,
    ExecutorTurnedAway,
    ExecutorUnavailable,
    Job,
    PromptTokens,
)
from gpusched_common.catalog import ModelSpec
from gpusched_common.contracts import MAX_USAGE_TOKENS

FAILED_FINISH = frozenset({"abort", "error"})
"""Finish reasons of a reply the engine gave up on (vLLM's `abort`, `error`), not one that
ended: the engine failing, as an error event in its stream is."""
UNAVAILABLE = frozenset({429, 502, 503, 504})
"""Statuses of an engine that is overloaded or not there (or of a proxy in front of it)."""
REFUSED = frozenset({400, 413, 422})
"""Statuses of an engine refusing the request as sent, which every engine would refuse too
(not 408, 409 or 429: those tell of the engine's own state)."""
MODEL_MISSING = re.compile(r"\bmodel\b.*\bdoes not exist", re.IGNORECASE | re.DOTALL)
"""A 404's words for a model the server does not serve (vLLM's and OpenAI's)."""
ENGINE_DEAD = re.compile(r"EngineDeadError|EngineCore encountered an issue")
"""vLLM's words for its engine's death (`EngineDeadError`'s message), which it streams as a
400 error event like a refusal of the request."""
HEALTH_TIMEOUT_S = 2.0
"""How long a heartbeat's health check waits for the engine's whole answer."""
ERROR_BODY_CHARS, ERROR_BODY_WAIT_S = 1024, 5.0
"""How much of a refusal's body is read for its message, and for how long at most."""
MAX_EVENT_CHARS = 1_000_000
"""The longest event line taken: no reply fits one record beyond that anyway."""


class OpenAIExecutor:
    name = "openai"
    time_scale = 1.0
    refuses = REFUSED

    def __init__(self, base_url: str, model_override: str | None = None,
                 api_key: str | None = None, timeout_s: float = 600.0,
                 client: httpx.AsyncClient | None = None, stream_usage: bool = True) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._model_override = model_override
        self._timeout_s = timeout_s
        self._stream_usage = stream_usage
        self._failed_on: dict[str, tuple[str, int]] = {}
        """Each model a request found the engine failing on (it sent nothing for
        `timeout_s`, or an error in its stream): the path it was asked on and the failure's
        number, until the engine answers `health`'s request for one token of it begun after
        that failure."""
        self._failures = 0
        self._listed: frozenset[str] | None = None
        """The model ids the engine's last /v1/models answer listed (None: none came yet)."""
        # no cap on connections: the node admits requests by memory, and a 101st stream must
        # not wait for one of the first 100 to end (httpx's default)
        self._client = client or httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=100))

    async def load(self, model: ModelSpec, gpu_index: int) -> None:
        """The engine loads its own models; nothing to do."""

    async def unload(self, model_name: str, gpu_index: int) -> None:
        """The engine owns its memory; nothing to do."""

    async def generate(self, job: Job
                       ) -> AsyncGenerator[str | PromptTokens | EngineFinished, None]:
        request = job.request
        served = self._model_override or job.model.name  # the name the engine knows it by
        body: dict[str, object] = {"model": served,
                                   "max_tokens": request.max_tokens, "stream": True}
        body |= {k: v for k, v in (("seed", request.seed), ("temperature", request.temperature),
                                   ("top_p", request.top_p), ("stop", request.stop))
                 if v is not None}
        if self._stream_usage:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if request.messages is not None:  # the engine applies the model's chat template
            path = "/v1/chat/completions"
            # as the client sent them: a name where it gave one, no "name": null
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            if job.prefix:  # vLLM's way to go on with the reply it had begun
                messages.append({"role": "assistant", "content": job.prefix})
                body |= {"continue_final_message": True, "add_generation_prompt": False}
            body["messages"] = messages
        else:
            path, body["prompt"] = "/v1/completions", request.prompt
        counted = 0  # tokens as the runtime bills them: items yielded, or owed
        try:
            async with self._client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    said = (f"inference server answered {resp.status_code}: "
                            f"{_message_of(await _start_of(resp))}")
                    if resp.status_code in REFUSED:
                        raise ExecutorRefused(said, resp.status_code)
                    if resp.status_code == 404 and MODEL_MISSING.search(said):
                        raise ExecutorLacksModel(f"{said} ({self._names_served()})")
                    if resp.status_code in UNAVAILABLE:
                        raise ExecutorUnavailable(said)
                    if resp.status_code >= 500:
                        raise self._server_error(said, served, path)
                    raise ExecutorTurnedAway(said)
                kind = resp.headers.get("content-type", "").lower()
                if not kind.startswith("text/event-stream"):
                    detail = (await _start_of(resp))[:200]
                    raise ExecutorError(f"inference server answered {kind or 'no content type'}"
                                        f" instead of an event stream: {detail}")
                prompt_told, held = False, ""
                whole = False  # [DONE] came, or the engine's finish reason: a stream that
                # ends after that (a proxy dropping [DONE]) cut nothing short
                owed: str | None = None  # the text of a counted token that ended in half a
                # character: it goes (an item of its own) with the rest of that character
                progress = time.monotonic()
                async for data in _events(resp, self._timeout_s):
                    if data == "[DONE]":
                        whole = True
                        break
                    text, engine_count, prompt_count, finish = _event(data)
                    text, held = _whole_characters(held + text)
                    if prompt_count is not None and not prompt_told:
                        prompt_told = True
                        yield PromptTokens(prompt_count)
                    # the rest of a character whose token is owed is no token of its own
                    tokens = 1 if text[owed is not None:] else 0
                    if engine_count is not None:  # the engine's running count is the truth,
                        # up to what was asked: beyond, the runtime would cut the text off
                        tokens = max(tokens, min(engine_count, request.max_tokens) - counted)
                    counted += tokens
                    text, items = (owed or "") + text, tokens + (owed is not None)
                    owed = None
                    if held and items:
                        owed, text, items = text, "", items - 1
                    # the text last: a stop string the runtime finds in it ends the request
                    # with every token of the delta counted
                    for i in range(items):
                        yield text if i == items - 1 else ""
                    if tokens:
                        progress = time.monotonic()
                    elif time.monotonic() - progress > self._timeout_s:
                        # events, no tokens: the engine is alive (tool calls, or reasoning
                        # text it does not count), and this request goes nowhere on it
                        raise ExecutorError(f"inference server sent no token for "
                                            f"{self._timeout_s:g} s")
                    if finish in FAILED_FINISH:
                        raise _ErrorEvent(f"it ended the reply with finish reason {finish!r}",
                                          None)
                    if finish is not None:  # any but `length` is a normal end (TGI's eos_token)
                        whole = True
                        yield EngineFinished("length" if finish == "length" else "stop")
                if not whole:
                    raise ExecutorError("inference server ended the stream without [DONE]: the "
                                        "reply may be cut short")
                if held:  # no rest came: the half is replaced, its token billed once
                    yield (owed or "") + "\ufffd"
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                httpx.RemoteProtocolError) as exc:  # not there, or gone mid-stream
            raise ExecutorUnavailable(f"inference server at {self._client.base_url} "
                                      f"unreachable or dropped the stream: {exc!r}") from exc
        except _ErrorEvent as error:
            raise await self._failed_in_stream(error, served, path,
                                               before_token=counted == 0) from None
        except (_Stalled, httpx.TimeoutException) as exc:  # a connect's is taken above
            self._probe_later(served, path)
            if isinstance(exc, _Stalled):
                raise
            raise _Stalled(f"inference server at {self._client.base_url} sent nothing for "
                           f"{self._timeout_s:g} s") from exc
        except httpx.HTTPError as exc:
            raise ExecutorError(f"inference server at {self._client.base_url} failed the "
                                f"request: {exc!r}") from exc

    async def _failed_in_stream(self, error: _ErrorEvent, model: str, path: str,
                                before_token: bool) -> ExecutorError:
        """What an error the engine sent inside its stream says. vLLM sends whatever fails
        once it has answered 200 so, its engine's death included (EngineDeadError, as a
        400): the engine failing, unavailable until it generates again (`health`). But one
        that came before any token with a refusal's status refused the request as sent
        (vLLM's own check of the prompt's length), as that status answered instead of a
        stream would, unless there is evidence that the engine died: vLLM's words for it,
        or a request for one token that finds it dead (unreachable, a 5xx). One the engine
        does not answer in time (or answers 408, 429) is no such evidence: a busy engine
        queues it behind its running work, while a dead one answers at once."""
        if before_token and error.code in REFUSED and not ENGINE_DEAD.search(str(error)):
            answer = await self._answers(path, _one_token(model, path))
            if not isinstance(answer, _NotLive) or answer.busy:
                return ExecutorRefused(f"inference server answered {error.code}: {error}",
                                       error.code)
        self._probe_later(model, path)
        return ExecutorUnavailable(f"inference server at {self._client.base_url} failed the "
                                   f"request in its stream: {error}")

    def _server_error(self, said: str, model: str, path: str) -> ExecutorError:
        """A 5xx answered instead of a stream: the engine failing where it says in vLLM's
        words that its engine died (it answers every request so while its /v1/models still
        answers: each failed for good, and the node took more), as for an error inside a
        stream; else a fault of this request (it fails, unbilled). Not judged by a request
        for one token: a path or model that fails whatever it is asked (a chat template
        that raises) took the node down for good, every request with it."""
        if not ENGINE_DEAD.search(said):
            return ExecutorTurnedAway(said)
        self._probe_later(model, path)
        return ExecutorUnavailable(f"inference server at {self._client.base_url} failed: "
                                   f"{said}")

    def _probe_later(self, model: str, path: str) -> None:
        """The engine failed a request of `model` on `path`: `health` asks it for a token."""
        self._failures += 1
        self._failed_on[model] = (path, self._failures)

    async def health(self) -> str | None:
        """Why the engine cannot run work, or None: it must answer /v1/models and, after a
        request stalled or failed in its stream, generate a token too, since a wedged vLLM
        (its engine loop hung) or a dead one (its engine process gone) still answers
        /v1/models."""
        listed = await self._answers("/v1/models")
        if isinstance(listed, _NotLive):
            return listed.why
        self._note_listed(listed)
        for model, (path, failure) in list(self._failed_on.items()):
            answer = await self._answers(path, _one_token(model, path))
            if isinstance(answer, _NotLive):
                return f"{answer.why} (one token, asked since a request failed on it)"
            if self._failed_on.get(model, ("", 0))[1] == failure:  # none failed since asked
                del self._failed_on[model]
        return None

    def served_models(self) -> frozenset[str] | None:
        """The models the engine's last /v1/models answer listed; None until one came, and
        with a model override (every request goes under that one name)."""
        return None if self._model_override else self._listed

    def _names_served(self) -> str:
        """What to do about a model name the server does not serve, and what it lists."""
        listed = ", ".join(sorted(self._listed)) if self._listed else "nothing yet"
        return (f"the inference server lists {listed}: serve the model under the name sent "
                f"(vLLM's --served-model-name), or set GPUSCHED_OPENAI_MODEL to the one it "
                f"lists")

    def _note_listed(self, resp: httpx.Response) -> None:
        """Keep the model ids of a /v1/models answer (OpenAI's `{"data": [{"id": ...}]}`);
        an answer of another shape keeps the last one."""
        try:
            data = resp.json()["data"]
            self._listed = frozenset(str(m["id"]) for m in data)
        except (ValueError, KeyError, TypeError):
            pass

    async def _answers(self, path: str, body: dict[str, object] | None = None
                       ) -> httpx.Response | _NotLive:
        """The engine's answer to a GET of `path` (a POST of `body`, given one) within
        HEALTH_TIMEOUT_S where it shows the engine live, else why it does not. The one
        definition of a live engine, for the heartbeat and for an error in a stream: /v1/models
        answers 200, and a request for a token any status but a 5xx, 408 or 429 (a refusal
        of it, from a gateway that serves only chat or for a model the server no longer
        lists, comes from a live engine)."""
        try:  # httpx's timeout bounds each read: one that trickles would hold the heartbeat
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                resp = await self._client.request("GET" if body is None else "POST", path,
                                                  json=body, timeout=HEALTH_TIMEOUT_S)
        except (TimeoutError, httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
            return _NotLive(f"inference server at {self._client.base_url} did not answer "
                            f"{path} within {HEALTH_TIMEOUT_S:g} s", busy=True)
        except httpx.HTTPError as exc:  # a connect's time-out too: nothing took the request
            return _NotLive(f"inference server at {self._client.base_url} unreachable: "
                            f"{exc!r}", busy=False)
        if resp.status_code != 200 and (body is None or resp.status_code >= 500
                                        or resp.status_code in (408, 429)):
            return _NotLive(f"inference server at {self._client.base_url} answered "
                            f"{resp.status_code} on {path}",
                            busy=resp.status_code in (408, 429))
        return resp

    async def close(self) -> None:
        await self._client.aclose()


@dataclass(frozen=True)
class _NotLive:
    """Why a check did not show the engine live (`_answers`). `busy`: no answer in time, or
    a 408 or 429, as from a live engine whose queue is full as well as from a wedged one;
    else it is not there (unreachable, a 5xx), or /v1/models failed."""

    why: str
    busy: bool


class _ErrorEvent(ExecutorError):
    """An error event in the engine's stream, or a finish reason of a reply it gave up on;
    `code` is the status the event names (vLLM's `code`), if any."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


class _Stalled(ExecutorUnavailable):
    """The engine sent nothing (keep-alive comments aside) for the time-out: wedged, its
    fault as a crash is. The request goes on elsewhere with its tokens, and the
    node takes no work until the engine generates again (`health`)."""


_LINE_END = re.compile(r"\r\n|\n|\r")
"""Server-sent events end lines so, and only so: JSON may hold U+2028 raw, which
`str.splitlines` (and so httpx's `aiter_lines`) takes for a line end."""


async def _start_of(resp: httpx.Response) -> str:
    """The start of a refusal's body, for its message: the rest is not waited for."""
    body = bytearray()
    try:
        async with asyncio.timeout(ERROR_BODY_WAIT_S):
            async for part in resp.aiter_bytes():
                body += part
                if len(body) >= ERROR_BODY_CHARS:
                    break
    except TimeoutError:
        pass
    return body.decode(errors="replace")[:ERROR_BODY_CHARS // 2]


def _one_token(model: str, path: str) -> dict[str, object]:
    """A request for one token of `model` on `path`: only a live engine answers it."""
    ask: dict[str, object] = {"model": model, "max_tokens": 1, "stream": False}
    return ask | ({"messages": [{"role": "user", "content": "ping"}]}
                  if path.endswith("/chat/completions") else {"prompt": "ping"})


def _message_of(body: str) -> str:
    """The message of an engine's error body (`_said`), else the body as it came (plain
    text, or cut off)."""
    try:
        error = json.loads(body)
    except ValueError:
        return body
    return _said(error)[0] or body


def _said(error: object) -> tuple[str | None, int | None]:
    """The message and status code of an engine's error, a body or an event: `message` and
    `code` in vLLM's (`{"object": "error", "message": ..., "code": 400}`), OpenAI's and
    SGLang's (`{"error": {"message": ..., "code": ...}}`), the text of TGI's (`{"error":
    ...}`); None for what it lacks (OpenAI's `code` is a word, no status)."""
    if isinstance(error, dict):
        error = error.get("error") or error
    if not isinstance(error, dict):
        return (error if isinstance(error, str) and error else None), None
    message, code = error.get("message"), error.get("code")
    return (message if isinstance(message, str) and message else None,
            code if isinstance(code, int) and not isinstance(code, bool) else None)


async def _events(resp: httpx.Response, timeout_s: float) -> AsyncIterator[str]:
    """The data of each `data:` line, failing when none came for `timeout_s` (comments an
    engine sends to keep the connection open do not count) or one is over
    MAX_EVENT_CHARS. A line's pieces are joined once it ends (joining them as they came
    cost time growing with the square of its length)."""
    pending: list[str] = []  # the unfinished line, in pieces
    pending_chars, last = 0, time.monotonic()
    async for text in resp.aiter_text():
        *ended, rest = _LINE_END.split(text)  # a \r\n cut in two adds an empty line
        for i, piece in enumerate(ended):
            line = "".join(pending) + piece if i == 0 else piece
            if i == 0:
                pending, pending_chars = [], 0
            if line.startswith("data:"):
                last = time.monotonic()
                yield line[5:].strip()
        pending.append(rest)
        pending_chars += len(rest)
        if pending_chars > MAX_EVENT_CHARS:
            raise ExecutorError(f"inference server sent an event line over "
                                f"{MAX_EVENT_CHARS:,} characters")
        if time.monotonic() - last > timeout_s:
            raise _Stalled(f"inference server sent no event for {timeout_s:g} s")
    if (line := "".join(pending)).startswith("data:"):
        yield line[5:].strip()


def _event(data: str) -> tuple[str, int | None, int | None, str | None]:
    """The text of the first choice in one event, the engine's counts of completion tokens
    so far and of prompt tokens when the event carries them, and the choice's finish
    reason (None until the last); an error event raises `_ErrorEvent`."""
    try:
        event = json.loads(data)
    except ValueError:
        raise ExecutorError(f"inference server sent an event that is not JSON: "
                            f"{data[:200]!r}") from None
    if not isinstance(event, dict):
        raise ExecutorError(f"inference server sent an event that is not an object: "
                            f"{data[:200]!r}")
    if event.get("error") or event.get("object") == "error":  # the latter: older vLLM
        message, code = _said(event)
        raise _ErrorEvent(message or data[:200], code)
    choices = event.get("choices") or []
    if not isinstance(choices, list):
        raise ExecutorError(f"inference server sent choices that are not a list: "
                            f"{data[:200]!r}")
    text, finish = "", None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:  # one was asked for
            delta = choice.get("delta") or {}
            piece = choice.get("text") or (delta.get("content") if isinstance(delta, dict)
                                           else None)
            reason = choice.get("finish_reason")  # SGLang's native API sends an object
            if not isinstance(delta, dict) or not isinstance(piece, str | None) or \
                    not isinstance(reason, str | None):
                raise ExecutorError(f"inference server sent a choice of another shape than "
                                    f"OpenAI's: {data[:200]!r}")
            text += piece or ""
            finish = reason or finish
    usage = event.get("usage") if isinstance(event.get("usage"), dict) else {}
    return (text, _count(usage.get("completion_tokens"), 0),
            _count(usage.get("prompt_tokens"), 1), finish)


def _whole_characters(text: str) -> tuple[str, str]:
    """`text` without a trailing high surrogate (held for its pair in the next event: JSON
    escapes an emoji as two, which a proxy may split), and with any other lone surrogate
    replaced: records holding one cannot be written as UTF-8."""
    if text.isascii():
        return text, ""
    held = text[-1] if "\ud800" <= text[-1] <= "\udbff" else ""
    text = text[:-1] if held else text
    if any("\ud800" <= c <= "\udfff" for c in text):
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text, held


def _count(value: object, least: int) -> int | None:
    """A token count an engine sent, or None when it is not a plausible one."""
    if isinstance(value, int) and not isinstance(value, bool) and \
            least <= value <= MAX_USAGE_TOKENS:
        return value
    return None
