"""The three executors: simulated (deterministic, batched), torch (a real transformer on CPU)
and openai-compatible (streams from a local server that the test starts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from served_app import ServedApp

from gpusched_agent.adapters.executor import ExecutorError, Job, PromptTokens
from gpusched_agent.adapters.openai_executor import OpenAIExecutor
from gpusched_agent.adapters.simulated import SimulatedExecutor
from gpusched_common.catalog import GPU_TYPES, load_models
from gpusched_common.contracts import ChatTurn, InferenceRequest, Resume

CATALOG = load_models(Path(__file__).resolve().parents[2] / "config")
LISTS_EVERY_MODEL = {"object": "list", "data": [{"id": m, "object": "model"}
                                                for m in CATALOG.names]}
"""A /v1/models answer of a server that serves the whole catalog."""
SMALL = CATALOG.get("qwen2.5-1.5b")
H100 = GPU_TYPES["H100-80GB"]


def job(rid: str, max_tokens: int = 12, seed: int | None = None, prompt: str = "hello world",
        gpu: int = 0, **sampling: object) -> Job:
    req = InferenceRequest(request_id=rid, tenant="t", model=SMALL.name, prompt=prompt,
                           max_tokens=max_tokens, seed=seed, created_at_ms=0, **sampling)
    return Job(req, max(1, len(prompt) // 4), SMALL, H100, gpu, f"{rid}#0")


async def collect(it: AsyncIterator[str]) -> list[str]:
    return [t async for t in it]


async def test_simulated_executor_is_deterministic_under_a_seed() -> None:
    ex = SimulatedExecutor(time_scale=0.001, seed=3)
    a = await collect(ex.generate(job("a", seed=42)))
    b = await collect(ex.generate(job("b", seed=42)))
    c = await collect(ex.generate(job("c", seed=43)))
    assert a == b != c and len(a) == 12
    await ex.close()


async def test_simulated_decode_slows_down_with_the_batch() -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        await asyncio.sleep(0)

    ex = SimulatedExecutor(time_scale=1.0, seed=0, sleep=sleep)
    await collect(ex.generate(job("alone", max_tokens=3)))
    alone = max(slept[1:])
    slept.clear()
    await asyncio.gather(*(collect(ex.generate(job(f"b{i}", max_tokens=3, prompt="x" * 4000)))
                           for i in range(8)))
    assert max(slept) > alone  # more KV cache read per step
    await ex.close()


async def test_a_failed_prefill_fails_its_own_request_not_the_batch() -> None:
    """A prefill that fails (a long prompt out of GPU memory) ends its own request; the
    batch's other requests go on. Before, the failing request had already left the joining
    list, so its error reached every consumer but its own, which waited forever."""
    from gpusched_agent.adapters.batching import ContinuousBatcher, Sequence

    async def prefill(seq: Sequence) -> str:
        if seq.key == "bad":
            raise ExecutorError("CUDA out of memory")
        return "a"

    async def step(seqs: list[Sequence]) -> list[str]:
        await asyncio.sleep(0)
        return ["b"] * len(seqs)

    batch = ContinuousBatcher(prefill, step)
    good, bad = await asyncio.gather(collect(batch.run(Sequence("good", 4, 1))),
                                     collect(batch.run(Sequence("bad", 4, 1))),
                                     return_exceptions=True)
    assert good == ["a", "b", "b", "b"]
    assert isinstance(bad, ExecutorError)
    await batch.close()


async def test_a_failed_decode_step_fails_only_the_sequence_it_fails_for() -> None:
    """A decode step that raises is run again in halves: only the sequence whose step fails
    on its own ends with the error, and the others get every token, none twice. Before, one
    request's failure (a sampling error of its own) failed every request in the batch, other
    tenants' included."""
    from gpusched_agent.adapters.batching import ContinuousBatcher, Sequence

    async def prefill(seq: Sequence) -> str:
        return f"{seq.key}0"

    async def step(seqs: list[Sequence]) -> list[str]:
        await asyncio.sleep(0)
        if any(s.key == "bad" and s.produced >= 2 for s in seqs):
            raise ExecutorError("probability tensor contains nan")
        return [f"{s.key}{s.produced}" for s in seqs]

    batch = ContinuousBatcher(prefill, step)
    keys = ["a", "b", "bad", "c", "d"]
    results = await asyncio.gather(*(collect(batch.run(Sequence(k, 5, 1))) for k in keys),
                                   return_exceptions=True)
    for key, got in zip(keys, results):
        if key == "bad":
            assert isinstance(got, ExecutorError)
        else:
            assert got == [f"{key}{i}" for i in range(5)]
    await batch.close()


async def test_a_batch_too_big_for_one_step_goes_on_in_smaller_steps() -> None:
    """A step that fails for the batch's size (activations out of device memory) is split;
    every request still gets all of its tokens."""
    from gpusched_agent.adapters.batching import ContinuousBatcher, Sequence
    sizes: list[int] = []

    async def prefill(seq: Sequence) -> str:
        return "a"

    async def step(seqs: list[Sequence]) -> list[str]:
        await asyncio.sleep(0)
        sizes.append(len(seqs))
        if len(seqs) > 2:
            raise ExecutorError("CUDA out of memory")
        return ["b"] * len(seqs)

    batch = ContinuousBatcher(prefill, step)
    results = await asyncio.gather(*(collect(batch.run(Sequence(f"s{i}", 4, 1)))
                                     for i in range(6)))
    assert results == [["a", "b", "b", "b"]] * 6
    assert max(sizes) > 2 and 2 in sizes
    await batch.close()


async def test_a_step_run_again_in_halves_skips_a_half_whose_consumers_left() -> None:
    """A fails alone while B's client goes: the second half is empty. Before, step([]) was
    called, failed (torch.cat of nothing), was halved again into [] until RecursionError,
    which failed every request on the model, one that had just joined included."""
    from gpusched_agent.adapters.batching import ContinuousBatcher, Sequence
    calls: list[list[str]] = []
    consumers: dict[str, asyncio.Task] = {}

    async def prefill(seq: Sequence) -> str:
        return "p"

    async def step(seqs: list[Sequence]) -> list[str]:
        calls.append([s.key for s in seqs])
        if not seqs:
            raise RuntimeError("torch.cat(): expected a non-empty list")
        await asyncio.sleep(0)
        if any(s.key == "A" for s in seqs):
            if len(seqs) == 1:  # B's client leaves, D joins, while A runs alone
                consumers["B"].cancel()
                consumers["D"] = asyncio.create_task(collect(batch.run(Sequence("D", 3, 1))))
                await asyncio.sleep(0.01)
            raise ExecutorError("nan")
        return ["t"] * len(seqs)

    batch = ContinuousBatcher(prefill, step)
    consumers["A"] = asyncio.create_task(collect(batch.run(Sequence("A", 5, 1))))
    consumers["B"] = asyncio.create_task(collect(batch.run(Sequence("B", 5, 1))))
    a, _ = await asyncio.gather(consumers["A"], consumers["B"], return_exceptions=True)
    assert isinstance(a, ExecutorError)
    assert await asyncio.wait_for(consumers["D"], 5) == ["p", "t", "t"]
    assert [] not in calls
    await batch.close()


async def test_closing_a_batch_ends_a_request_in_its_prefill() -> None:
    """A request taken from the joining list and not yet active was in neither list that
    close() ends, so its consumer waited forever."""
    from gpusched_agent.adapters.batching import ContinuousBatcher, Sequence
    started = asyncio.Event()

    async def prefill(seq: Sequence) -> str:
        started.set()
        await asyncio.sleep(10)
        return "p"

    async def step(seqs: list[Sequence]) -> list[str]:
        return ["t"] * len(seqs)

    batch = ContinuousBatcher(prefill, step)
    consumer = asyncio.create_task(collect(batch.run(Sequence("X", 3, 1))))
    await started.wait()
    await batch.close()
    with pytest.raises(ExecutorError, match="unloaded"):
        await asyncio.wait_for(consumer, 2)


async def test_a_step_that_gives_a_wrong_number_of_tokens_fails_its_batch_only() -> None:
    """Before, the count was checked while emitting: the first sequences had a token, then
    the error failed every request on the model, those joining included."""
    from gpusched_agent.adapters.batching import ContinuousBatcher, Sequence

    async def prefill(seq: Sequence) -> str:
        return "p"

    async def step(seqs: list[Sequence]) -> list[str]:
        await asyncio.sleep(0)
        return ["t"] * (len(seqs) - 1)  # one short

    batch = ContinuousBatcher(prefill, step)
    got = await asyncio.gather(*(collect(batch.run(Sequence(k, 3, 1))) for k in "PQ"),
                               return_exceptions=True)
    assert all(isinstance(g, ExecutorError) and "gave 1 tokens for 2" in str(g) for g in got)
    await batch.close()


# --- torch -----------------------------------------------------------------------------------
torch = pytest.importorskip("torch", reason="the torch extra: pip install 'gpusched-agent[torch]'")


@pytest.fixture(scope="module")
def torch_executor():
    from gpusched_agent.adapters.torch_executor import TorchExecutor
    from gpusched_agent.adapters.torch_model import TinyConfig

    return TorchExecutor("cpu", seed=1, config=TinyConfig(dim=64, layers=2), threads=1)


async def test_torch_executor_generates_real_tokens_on_cpu(torch_executor) -> None:
    from gpusched_agent.adapters.torch_model import VOCAB

    await torch_executor.load(SMALL, 0)
    tokens = await collect(torch_executor.generate(job("t1", max_tokens=16, seed=5)))
    assert len(tokens) == 16 and all(t in VOCAB for t in tokens)
    again = await collect(torch_executor.generate(job("t2", max_tokens=16, seed=5)))
    assert again == tokens  # same seed, same weights: same text
    memory = torch_executor.memory_bytes()
    assert memory["weights"] > 0


async def test_torch_executor_says_where_each_gpus_copy_of_a_model_is(torch_executor) -> None:
    """ops/gpu-check compares it with NVML's GPU the work was placed on."""
    import torch

    await torch_executor.load(SMALL, 0)
    assert torch_executor.loaded_device(SMALL.name, 0) == torch.device("cpu")
    assert torch_executor.loaded_device(SMALL.name, 5) is None


def test_torch_executor_memory_counts_every_cuda_device(monkeypatch) -> None:
    """GPU i's work runs on cuda:i: the current device's allocator alone showed GPU 0's."""
    import torch

    from gpusched_agent.adapters.torch_executor import TorchExecutor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: {0: 10, 1: 32}[d])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: {0: 20, 1: 64}[d])
    memory = TorchExecutor("cuda").memory_bytes()
    assert (memory["cuda_allocated"], memory["cuda_peak_allocated"]) == (42, 84)


async def test_torch_batched_decoding_matches_decoding_alone(torch_executor) -> None:
    """Continuous batching must not change what a sequence generates: a request decoded in a
    batch with others of different lengths yields the same tokens as alone."""
    await torch_executor.load(SMALL, 0)
    alone = await collect(torch_executor.generate(job("x", max_tokens=10, seed=9)))
    together = await asyncio.gather(
        collect(torch_executor.generate(job("x", max_tokens=10, seed=9))),
        collect(torch_executor.generate(job("y", max_tokens=7, seed=1, prompt="a" * 90))),
        collect(torch_executor.generate(job("z", max_tokens=12, seed=2, prompt="bb"))))
    assert together[0] == alone
    assert [len(t) for t in together] == [10, 7, 12]


async def test_torch_samples_with_the_requests_temperature_and_top_p(torch_executor) -> None:
    """Temperature 0 (or below 1e-5, as in vLLM), or a top_p that keeps only the likeliest
    token, is greedy decoding: the seed no longer matters. The executor's default
    (temperature 1) samples, so seeds differ."""
    await torch_executor.load(SMALL, 0)

    async def text(seed: int, **sampling: float) -> list[str]:
        return await collect(torch_executor.generate(job(f"s{seed}", 24, seed, **sampling)))

    greedy = await text(1, temperature=0)
    assert await text(2, temperature=0) == greedy
    assert await text(4, temperature=1e-38) == greedy  # logits / t would overflow: greedy
    assert await text(3, top_p=1e-6) == greedy
    assert await text(1) != await text(2)


async def test_torch_request_too_long_for_the_model_says_so(torch_executor) -> None:
    with pytest.raises(ExecutorError, match="shorter request"):
        torch_executor.generate(job("huge", max_tokens=9000))


# --- openai-compatible -----------------------------------------------------------------------
class LocalServer(ServedApp):
    """A minimal OpenAI-compatible completions server: streams `max_tokens` deltas " w<i>",
    ending early, as an engine does, before a delta that would hold one of `stop`; or
    serves `app` instead."""

    def __init__(self, delay_s: float = 0.0, app: FastAPI | None = None) -> None:
        self.delay_s = delay_s
        self.bodies: list[dict] = []
        self.disconnected = 0
        super().__init__(app or self._app())

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:
            body = await request.json()
            self.bodies.append(body)

            async def events() -> AsyncIterator[bytes]:
                try:
                    for i in range(body["max_tokens"]):
                        if any(stop in f" w{i}" for stop in body.get("stop", ())):
                            break
                        await asyncio.sleep(self.delay_s)
                        chunk = {"choices": [{"index": 0, "text": f" w{i}"}]}
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.disconnected += 1
                    raise

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> StreamingResponse:
            body = await request.json()
            self.bodies.append(body)

            async def events() -> AsyncIterator[bytes]:
                for i in range(body["max_tokens"]):
                    chunk = {"choices": [{"index": 0, "delta": {"content": f" c{i}"}}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


async def test_openai_executor_streams_from_a_local_server() -> None:
    async with LocalServer() as server:
        ex = OpenAIExecutor(server.url, model_override="served-model")
        tokens = await collect(ex.generate(job("o1", max_tokens=9, seed=4)))
        await ex.close()
    assert tokens == [f" w{i}" for i in range(9)]
    assert server.bodies[0]["model"] == "served-model" and server.bodies[0]["stream"] is True
    assert server.bodies[0]["seed"] == 4
    assert "temperature" not in server.bodies[0]  # unset: the server's own default
    assert server.bodies[0]["stream_options"] == {"include_usage": True,
                                                  "continuous_usage_stats": True}


async def test_openai_executor_can_leave_stream_options_out() -> None:
    """For a server that refuses the field; each text delta then counts as one token."""
    async with LocalServer() as server:
        ex = OpenAIExecutor(server.url, stream_usage=False)
        assert await collect(ex.generate(job("o1", max_tokens=2))) == [" w0", " w1"]
        await ex.close()
    assert "stream_options" not in server.bodies[0]


async def test_a_chat_request_goes_to_the_chat_api_and_a_resumed_one_continues_its_reply(
) -> None:
    """The engine applies the model's chat template (before, it got the plain rendering
    on /v1/completions), with each message's name where the client gave one (no "name":
    null where it did not); a resumed reply is continued, not begun again."""
    turns = (ChatTurn(role="system", content="be brief"),
             ChatTurn(role="user", content="hi", name="alice"))
    async with LocalServer() as server:
        ex = OpenAIExecutor(server.url)
        chat = job("o3", max_tokens=3, messages=turns)
        assert await collect(ex.generate(chat)) == [" c0", " c1", " c2"]
        resumed = Job(chat.request.model_copy(update={"max_tokens": 2}), 9, SMALL, H100, 0,
                      "o3#1", prefix=" c0 c1")
        assert await collect(ex.generate(resumed)) == [" c0", " c1"]
        await ex.close()
    first, again = server.bodies
    assert first["messages"] == [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "hi", "name": "alice"}]
    assert "prompt" not in first
    assert again["messages"][-1] == {"role": "assistant", "content": " c0 c1"}
    assert again["continue_final_message"] is True and again["add_generation_prompt"] is False


async def test_openai_executor_forwards_the_requests_sampling_settings() -> None:
    async with LocalServer() as server:
        ex = OpenAIExecutor(server.url)
        await collect(ex.generate(job("o2", max_tokens=2, temperature=0.2, top_p=0.9,
                                      stop=["\n\n"])))
        await ex.close()
    assert (server.bodies[0]["temperature"], server.bodies[0]["top_p"]) == (0.2, 0.9)
    assert server.bodies[0]["stop"] == ["\n\n"]


async def test_openai_executor_stops_the_server_stream_when_cancelled() -> None:
    async with LocalServer(delay_s=0.01) as server:
        ex = OpenAIExecutor(server.url)
        got: list[str] = []

        async def consume() -> None:
            async for token in ex.generate(job("o2", max_tokens=10_000)):
                got.append(token)

        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ex.close()
        for _ in range(100):
            if server.disconnected:
                break
            await asyncio.sleep(0.01)
    assert 3 <= len(got) < 10_000 and server.disconnected == 1


async def test_openai_executor_reports_an_unreachable_server() -> None:
    ex = OpenAIExecutor("http://127.0.0.1:9")
    with pytest.raises(ExecutorError, match="unreachable"):
        await collect(ex.generate(job("o3")))
    await ex.close()


def engine(*events: str | bytes, content_type: str = "text/event-stream",
           timeout_s: float = 600.0, content=None) -> OpenAIExecutor:  # noqa: ANN001
    """An openai executor whose inference server answers every request with `events` (each
    a `data:` payload, or raw bytes sent as they are), or with the bytes `content` yields."""
    import httpx

    def body() -> bytes:
        return b"".join(e if isinstance(e, bytes) else f"data: {e}\n\n".encode()
                        for e in events)

    transport = httpx.MockTransport(lambda _: httpx.Response(
        200, headers={"content-type": content_type},
        content=content if content is not None else body()))
    return OpenAIExecutor("http://engine", timeout_s=timeout_s, client=httpx.AsyncClient(
        base_url="http://engine", transport=transport))


def delta(text: str, index: int = 0, counted: int | None = None, prompt: int = 17) -> str:
    """One event of `text`; with `counted`, the engine's running count of completion tokens
    and its count of the prompt (vLLM's `continuous_usage_stats`)."""
    usage = {"usage": {"prompt_tokens": prompt, "completion_tokens": counted}} if counted \
        else {}
    return json.dumps({"choices": [{"index": index, "text": text}]} | usage,
                      ensure_ascii=False)


def final_usage(completion_tokens: int) -> str:
    """The last event before [DONE] of an engine asked to `include_usage`."""
    return json.dumps({"choices": [], "usage": {"prompt_tokens": 17,
                                                "completion_tokens": completion_tokens}})


@pytest.mark.parametrize("ex,reason", [
    (lambda: engine('{"choices": [{"text": "hi"}]}', content_type="application/json"),
     "instead of an event stream"),
    (lambda: engine(delta(" a"), delta(" b")), "without [DONE]"),
    (lambda: engine(delta(" a"), '{"object": "error", "message": "CUDA out of memory"}'),
     "CUDA out of memory"),
    (lambda: engine(delta(" a"), "<html>bad gateway</html>"), "not JSON"),
], ids=["not-a-stream", "no-done", "old-vllm-error", "not-json"])
async def test_openai_executor_fails_a_reply_that_is_no_whole_stream(ex, reason: str) -> None:
    """Each used to pass for a completed (short or empty) answer, billed as such."""
    executor = ex()
    with pytest.raises(ExecutorError, match=re.escape(reason)):
        await collect(executor.generate(job("bad", max_tokens=5)))
    await executor.close()


def finish(text: str, reason: str) -> str:
    """The last event of a reply the engine ended for `reason`."""
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": reason}]})


async def test_an_engine_that_aborts_a_reply_fails_it_and_one_out_of_context_says_length(
) -> None:
    """vLLM's `abort` (and `error`) followed by [DONE] passed for a completed reply cut
    short, and an engine's own `length` before max_tokens (its context ran out) for `stop`."""
    from gpusched_common.contracts import RequestResult

    aborted = engine(delta("a"), finish("b", "abort"), "[DONE]")
    with pytest.raises(ExecutorError, match="finish reason 'abort'"):
        await collect(aborted.generate(job("ab", max_tokens=5)))
    await aborted.close()
    out_of_context = engine(delta("a"), finish("b", "length"), "[DONE]")
    sent, _ = await run_on(out_of_context, job("ctx", max_tokens=5).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.finish_reason, result.text) == ("completed", "length", "ab")
    await out_of_context.close()


async def test_a_stop_string_on_the_last_token_allowed_finishes_with_stop_not_length() -> None:
    """vLLM withholds a stop string it was passed and says `stop`, counting its tokens: one
    that ended on the last token `max_tokens` allows read `length`, as if cut off there."""
    from gpusched_common.contracts import RequestResult

    stopped = json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "stop",
                                       "stop_reason": "END"}],
                          "usage": {"prompt_tokens": 17, "completion_tokens": 4}})
    executor = engine(delta(" a", counted=1), delta(" b", counted=2), stopped, "[DONE]")
    sent, _ = await run_on(executor, job("end", max_tokens=4, stop=["END"]).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.finish_reason, result.text, result.completion_tokens) == (
        "completed", "stop", " a b", 4)
    await executor.close()


@pytest.mark.parametrize("reason", ["eos_token", "stop_sequence", "content_filter"])
async def test_other_finish_reasons_end_a_reply_normally(reason: str) -> None:
    """TGI before 2.3 ends a reply with `eos_token` or `stop_sequence`: not a failure."""
    executor = engine(delta("a"), finish("b", reason), "[DONE]")
    got = await collect(executor.generate(job("end", max_tokens=5)))
    assert [t for t in got if isinstance(t, str)] == ["a", "b"]
    await executor.close()


async def test_an_engine_count_beyond_max_tokens_keeps_the_text() -> None:
    """A count of 10**9 for one delta yielded that many empty items before the text, and
    the runtime's cut at max_tokens dropped the text."""
    executor = engine(delta("a", counted=10**9), "[DONE]")
    got = await collect(executor.generate(job("huge", max_tokens=4)))
    assert [t for t in got if isinstance(t, str)] == ["", "", "", "a"]
    await executor.close()


async def test_an_engine_that_trickles_holds_neither_a_request_nor_the_heartbeat() -> None:
    """httpx's time-out bounds each read: a /v1/models, an error body or a non-stream body
    sent a byte a second never ended, and the heartbeat (which asks /v1/models) stopped."""
    app = FastAPI()

    async def trickle():  # noqa: ANN202
        while True:
            yield b"x"
            await asyncio.sleep(0.5)

    @app.get("/v1/models")
    async def models() -> StreamingResponse:
        return StreamingResponse(trickle(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        return StreamingResponse(trickle(), status_code=500, media_type="text/plain")

    async with LocalServer(app=app) as server:
        executor = OpenAIExecutor(server.url, timeout_s=3)
        try:
            async with asyncio.timeout(8):
                assert "did not answer /v1/models within 2 s" in await executor.health()
                with pytest.raises(ExecutorError, match="answered 500: x"):
                    await collect(executor.generate(job("t", max_tokens=3)))
        finally:
            await executor.close()


async def test_an_engine_that_sends_events_without_tokens_times_out() -> None:
    """Token-less events kept the request alive for ever: the time-out counted any event.
    An engine that sends events is alive (tool calls, reasoning text it does not count): the
    request fails, and is not handed on to take node after node down as a stall would."""
    from gpusched_agent.adapters.executor import ExecutorUnavailable

    async def idle():  # noqa: ANN202
        yield f"data: {delta('a')}\n\n".encode()
        while True:
            await asyncio.sleep(0.05)
            yield f"data: {json.dumps({'choices': []})}\n\n".encode()

    executor = engine(content=idle(), timeout_s=0.3)
    with pytest.raises(ExecutorError, match="no token for 0.3 s") as raised:
        async with asyncio.timeout(10):
            await collect(executor.generate(job("idle", max_tokens=5)))
    assert not isinstance(raised.value, ExecutorUnavailable)
    await executor.close()


async def test_a_huge_event_line_fails_fast_instead_of_growing_without_end() -> None:
    """An unfinished line was joined again with every piece (time growing with the square
    of its length: 16 MiB took 10 s) and never bounded."""
    async def endless_line():  # noqa: ANN202
        yield b'data: {"choices": [{"text": "'
        while True:
            yield b"x" * 65536

    executor = engine(content=endless_line())
    with pytest.raises(ExecutorError, match="event line over 1,000,000 characters"):
        async with asyncio.timeout(10):
            await collect(executor.generate(job("long", max_tokens=5)))
    await executor.close()


async def test_a_reply_too_large_for_one_record_ends_failed_instead_of_never() -> None:
    """Kafka refuses a record over 1 MB and the agent tried to publish the result forever,
    after a restart too (its final records are filed)."""
    from gpusched_common.contracts import RequestResult, TokenChunk, UsageRecord

    executor = engine(*(delta("x" * 600_000) for _ in range(3)), "[DONE]")
    sent, _ = await run_on(executor, job("big", max_tokens=10).request)
    # its last chunk would be too large too (the first token goes out alone): not sent
    assert [len(c.text) for c in sent if isinstance(c, TokenChunk)] == [600_000]
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert result.status == "failed" and "too large for one Kafka record" in \
        result.finish_reason and result.completion_tokens == 3
    assert sum(u.completion_tokens for u in sent if isinstance(u, UsageRecord)) == 3
    await executor.close()


async def test_openai_executor_keeps_tokens_that_hold_unicode_line_separators() -> None:
    """JSON may carry U+2028 and U+0085 raw (vLLM does); httpx's aiter_lines split the event
    there and the request failed with 'Unterminated string'."""
    executor = engine(delta("a\u2028b"), delta("\u0085"), delta(" é"), "[DONE]")
    assert await collect(executor.generate(job("u", max_tokens=5))) == ["a\u2028b", "\u0085",
                                                                          " é"]
    await executor.close()


async def test_openai_executor_takes_only_the_first_choice() -> None:
    executor = engine(delta(" a"), delta(" X", index=1), delta(" b"), "[DONE]")
    assert await collect(executor.generate(job("n", max_tokens=5))) == [" a", " b"]
    await executor.close()


async def test_openai_executor_fails_a_server_that_only_keeps_the_connection_open() -> None:
    """Keep-alive comments every 50 ms reset httpx's read time-out, so a stalled engine held
    the request forever; the time-out now counts events only."""
    from gpusched_agent.adapters.executor import ExecutorUnavailable

    async def stall():  # noqa: ANN202
        yield f"data: {delta(' a')}\n\n".encode()
        while True:
            await asyncio.sleep(0.05)
            yield b": keep-alive\n\n"

    executor = engine(content=stall(), timeout_s=0.3)
    got: list[str] = []
    with pytest.raises(ExecutorUnavailable, match="no event for 0.3 s"):
        async with asyncio.timeout(10):
            async for token in executor.generate(job("s", max_tokens=5)):
                got.append(token)
    assert got == [" a"]
    await executor.close()


async def test_openai_executor_opens_more_than_a_hundred_streams_at_once() -> None:
    """The node admits requests by memory, not by count; httpx's default pool let 100
    streams through and held the 101st until one ended. This engine answers nobody until
    it holds 120 requests at once."""
    held, everyone = [0], asyncio.Event()
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        held[0] += 1
        if held[0] >= 120:
            everyone.set()
        await everyone.wait()
        return StreamingResponse(iter([f"data: {delta(' a')}\n\n", "data: [DONE]\n\n"]),
                                 media_type="text/event-stream")

    async with LocalServer(app=app) as server:
        executor = OpenAIExecutor(server.url)
        try:
            async with asyncio.timeout(30):
                texts = await asyncio.gather(*(collect(executor.generate(job(f"c{i}", 1)))
                                               for i in range(120)))
        finally:
            everyone.set()  # let any request still held end, or the server never stops
            await executor.close()
    assert texts == [[" a"]] * 120


async def test_the_runtime_drops_what_an_engine_sends_beyond_max_tokens() -> None:
    """Tokens beyond max_tokens were taken and billed (9 for 5), and a preempt then handed
    back a request whose resume held more tokens than its max_tokens: invalid on the wire."""
    from gpusched_common.contracts import RequestResult, UsageRecord

    executor = engine(*(delta(f" t{i}") for i in range(9)), "[DONE]")
    sent, _ = await run_on(executor, job("over", max_tokens=5).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.finish_reason, result.completion_tokens) == (
        "completed", "length", 5)
    assert sum(u.completion_tokens for u in sent if isinstance(u, UsageRecord)) == 5
    await executor.close()


@pytest.mark.parametrize("events", [
    # vLLM with continuous_usage_stats: a token whose bytes end no character streams no text
    # (its count grows), and a delta of two tokens (speculative decoding)
    (delta("a", counted=1), delta("", counted=2), delta("bc", counted=4), delta("d", counted=5),
     final_usage(6)),
    # an engine that counts only at the end
    (delta("a"), delta("bc"), delta("d"), final_usage(6)),
], ids=["running-count", "final-count"])
async def test_the_engines_token_count_is_billed_not_its_text_deltas(events) -> None:
    """Each text delta counted as one token: 3 of the 6 the engine generated were billed,
    and a reply cut at max_tokens ended 'stop'."""
    from gpusched_common.contracts import RequestResult, TokenChunk, UsageRecord

    executor = engine(*events, "[DONE]")
    sent, _ = await run_on(executor, job("count", max_tokens=6).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.finish_reason, result.text, result.completion_tokens) == (
        "completed", "length", "abcd", 6)
    assert sum(u.completion_tokens for u in sent if isinstance(u, UsageRecord)) == 6
    assert sum(c.token_count for c in sent if isinstance(c, TokenChunk)) == 6
    # the prompt as the engine's tokenizer counted it, not the estimate (3 for "hello world")
    assert result.prompt_tokens == 17
    assert sum(u.prompt_tokens for u in sent if isinstance(u, UsageRecord)) == 17
    await executor.close()


async def test_an_engine_count_below_the_deltas_never_bills_less_than_them() -> None:
    executor = engine(delta("a", counted=1), delta("b", counted=1), final_usage(1), "[DONE]")
    assert await collect(executor.generate(job("low", max_tokens=5))) == [
        PromptTokens(17), "a", "b"]
    await executor.close()


async def test_an_engines_prompt_count_below_what_a_partial_record_billed_is_not_taken(
) -> None:
    """A record can bill nothing negative: the estimate already billed stands."""
    from gpusched_common.contracts import RequestResult, UsageRecord

    async def late():  # noqa: ANN202 - the engine's count comes after a partial record
        yield f"data: {delta('a')}\n\n".encode()
        await asyncio.sleep(0.05)
        yield f"data: {delta('b', counted=2, prompt=1)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    executor = engine(content=late())
    sent, runtime = make_runtime(executor, usage_interval_s=0.0)  # a record per token
    await place(runtime, job("est", max_tokens=2, prompt="p" * 40).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    usage = [m for m in sent if isinstance(m, UsageRecord)]
    assert result.prompt_tokens == sum(u.prompt_tokens for u in usage) == 10
    assert min(u.prompt_tokens for u in usage) >= 0
    await executor.close()


# --- selection -------------------------------------------------------------------------------
def test_executor_settings_are_validated_at_start_up() -> None:
    from pydantic import ValidationError

    from gpusched_agent.main import make_executor
    from gpusched_agent.settings import AgentSettings

    with pytest.raises(ValidationError, match="GPUSCHED_OPENAI_BASE_URL"):
        AgentSettings(executor="openai")
    with pytest.raises(ValidationError):
        AgentSettings(executor="tensorrt")
    assert make_executor(AgentSettings(executor="openai",
                                       openai_base_url="http://127.0.0.1:8000")).name == "openai"
    assert make_executor(AgentSettings(executor="torch", torch_device="cpu")).name == "torch"
    assert make_executor(AgentSettings()).name == "simulated"


@pytest.mark.parametrize("written,root", [
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
    ("https://gateway/vllm/v1", "https://gateway/vllm"),
    ("http://v1:8000", "http://v1:8000"),  # a host named v1 stays
    ("http://h/v1beta", "http://h/v1beta"),  # as do paths that only begin with v1
    ("http://h/v10/", "http://h/v10"),
    ("http://u:p@[::1]:8000/v1", "http://u:p@[::1]:8000"),
])
def test_the_inference_servers_url_may_end_in_v1_as_openai_clients_write_it(
        written: str, root: str) -> None:
    """GPUSCHED_OPENAI_BASE_URL=http://host:8000/v1, as OpenAI clients and vLLM's docs write
    it, had the agent ask /v1/v1/models: a 404, and the node down for good with nothing
    saying why."""
    from gpusched_agent.main import make_executor
    from gpusched_agent.settings import AgentSettings

    settings = AgentSettings(executor="openai", openai_base_url=written)
    assert settings.openai_base_url == root
    executor = make_executor(settings)
    assert str(executor._client.base_url).rstrip("/") == root


@pytest.fixture
def cuda_sees(monkeypatch):  # noqa: ANN201
    """Makes torch see CUDA devices with these UUIDs, in this order."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def sees(order: list[str]) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(order))
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: SimpleNamespace(uuid=order[i]))

    return sees


def test_the_agent_does_not_start_when_cuda_numbers_its_gpus_otherwise(cuda_sees) -> None:
    """GPU i of NVML's inventory runs on cuda:i. CUDA_VISIBLE_DEVICES (NVML ignores it) or
    CUDA's fastest-first order would run work on another GPU than the one the scheduler
    placed it on, and on memory the agent never accounted for: refuse to start instead."""
    from gpusched_agent.domain.inventory import build_inventory, simulated_reading
    from gpusched_agent.main import make_executor
    from gpusched_agent.settings import AgentSettings

    inventory = build_inventory(simulated_reading("2xH100-80GB", "n"))  # as if from NVML
    uuids = [g.uuid.removeprefix("GPU-") for g in inventory.gpus]
    settings = AgentSettings(executor="torch", torch_device="cuda")

    cuda_sees(uuids)
    assert make_executor(settings, inventory).name == "torch"
    for seen in (uuids[::-1], uuids[1:]):  # another order; CUDA_VISIBLE_DEVICES=1
        cuda_sees(seen)
        with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
            make_executor(settings, inventory)
    simulated = AgentSettings(executor="torch", torch_device="cuda", simulate="2xH100-80GB")
    assert make_executor(simulated, inventory).name == "torch"  # one GPU stands in for many


def test_the_agent_starts_beside_a_gpu_nvml_cannot_read(cuda_sees) -> None:
    """A GPU NVML cannot read is listed as 'GPU-unreadable-<i>', which no CUDA UUID equals:
    the torch executor refused to start, blaming CUDA_VISIBLE_DEVICES, where that GPU
    should only be unhealthy. It is still counted, and the others still compared."""
    from gpusched_agent.domain.inventory import (
        UNREADABLE_UUID_PREFIX,
        DeviceReading,
        NodeReading,
        build_inventory,
    )
    from gpusched_agent.main import make_executor
    from gpusched_agent.settings import AgentSettings

    inventory = build_inventory(NodeReading((
        DeviceReading(0, "GPU-a", "NVIDIA H100 80GB HBM3", 81559),
        DeviceReading(1, f"{UNREADABLE_UUID_PREFIX}1", "unreadable", 0, error="GPU is lost"),
        DeviceReading(2, "GPU-c", "NVIDIA H100 80GB HBM3", 81559))))
    assert [g.healthy for g in inventory.gpus] == [True, False, True]
    settings = AgentSettings(executor="torch", torch_device="cuda")

    cuda_sees(["a", "b", "c"])
    assert make_executor(settings, inventory).name == "torch"
    for seen in (["a", "c"], ["c", "b", "a"], ["a", "b", "c", "d"]):
        cuda_sees(seen)
        with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
            make_executor(settings, inventory)


def test_torch_on_auto_beside_nvml_gpus_does_not_fall_back_to_the_cpu(monkeypatch) -> None:
    """With a CPU-only torch on a node whose GPUs NVML reads, GPUSCHED_TORCH_DEVICE=auto
    ran every request on the CPU while the node reported H100s and billed GPU-seconds."""
    from gpusched_agent.domain.inventory import build_inventory, simulated_reading
    from gpusched_agent.main import make_executor
    from gpusched_agent.settings import AgentSettings

    inventory = build_inventory(simulated_reading("2xH100-80GB", "n"))  # as if from NVML
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="NVML found 2 GPU.*GPUSCHED_TORCH_DEVICE=cpu"):
        make_executor(AgentSettings(executor="torch", torch_device="auto"), inventory)
    on_purpose = make_executor(AgentSettings(executor="torch", torch_device="cpu"), inventory)
    simulated = make_executor(AgentSettings(executor="torch", simulate="2xH100-80GB"),
                              inventory)
    assert on_purpose.device_kind == simulated.device_kind == "cpu"


def test_the_agent_does_not_import_torch_unless_it_is_selected() -> None:
    import subprocess
    import sys

    code = ("import sys; from gpusched_agent.main import create_app; "
            "from gpusched_agent.settings import AgentSettings; "
            "create_app(AgentSettings(simulate='2xH100-80GB', node_id='n')); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def make_runtime(executor, before_publish=None, usage_interval_s: float = 5.0,  # noqa: ANN001
                 gpus: str = "1xL4-24GB") -> tuple[list, object]:
    """An agent runtime on `gpus` (one L4) with `executor`, and the list of what it
    publishes (each after `before_publish(message)` returns, when given: Kafka taking its
    time)."""
    from gpusched_agent.adapters.ledger import MemoryLedger
    from gpusched_agent.domain.inventory import parse_simulated
    from gpusched_agent.domain.node import NodeModel
    from gpusched_agent.runtime import AgentRuntime

    sent: list = []

    async def publish(message, topic, key, wait=True) -> None:
        if before_publish is not None:
            await before_publish(message)
        sent.append(message)

    return sent, AgentRuntime(
        "n", NodeModel.from_inventory(parse_simulated(gpus, "n")), CATALOG, executor,
        publish, MemoryLedger(), lambda: 0, chunk_tokens=4, heartbeat_s=1,
        usage_interval_s=usage_interval_s)


async def place(runtime, *requests: InferenceRequest, gpu: int = 0) -> None:  # noqa: ANN001
    """Place `requests` on `gpu` all at once and wait until they have ended."""
    from gpusched_common.contracts import Placement

    for request in requests:
        await runtime.command(Placement(
            placement_id=f"{request.request_id}#{request.attempt}", node_id="n",
            gpu_indices=(gpu,), kv_cache_mib=1, scheduler_epoch=0, placed_at_ms=0,
            request=request))
    async with asyncio.timeout(30):
        while runtime.in_flight:
            await asyncio.sleep(0.01)


async def run_on(executor, *requests: InferenceRequest) -> tuple[list, object]:
    """Run `requests` through a new runtime on `executor`: what it published, and the
    runtime."""
    sent, runtime = make_runtime(executor)
    await place(runtime, *requests)
    return sent, runtime


def test_the_torch_executor_numbers_cuda_devices_as_nvml_does() -> None:
    """The inventory's GPU i is NVML's (PCI bus order); CUDA would put the fastest first, so
    on a node of mixed GPUs a request could run on another GPU than the one it was placed
    on. An order the operator set is kept."""
    import os
    import subprocess
    import sys

    code = ("import os, gpusched_agent.adapters.torch_executor; "
            "print(os.environ['CUDA_DEVICE_ORDER'])")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_ORDER"}
    for given, expected in ((None, "PCI_BUS_ID"), ("FASTEST_FIRST", "FASTEST_FIRST")):
        run_env = env if given is None else env | {"CUDA_DEVICE_ORDER": given}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env=run_env)
        assert out.stdout.strip() == expected


async def test_the_runtime_runs_a_request_on_the_torch_executor_and_bills_it() -> None:
    from gpusched_agent.adapters.torch_executor import TorchExecutor
    from gpusched_agent.adapters.torch_model import TinyConfig
    from gpusched_common.contracts import RequestResult, UsageRecord

    executor = TorchExecutor("cpu", seed=0, config=TinyConfig(dim=32, layers=1), threads=1)
    sent, runtime = await run_on(executor, job("rt", max_tokens=10).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    [usage] = [m for m in sent if isinstance(m, UsageRecord)]
    assert result.status == "completed" and result.completion_tokens == 10
    assert usage.completion_tokens == 10 and usage.gpu_seconds > 0
    assert runtime.node.gpus[0].loaded_mib  # the model stays warm
    await executor.close()


async def test_a_request_beyond_the_torch_models_positions_is_refused_unbilled() -> None:
    """The catalog allows qwen2.5-1.5b 32,768 tokens, the torch model holds 8,192: a request
    in between failed as the executor's fault (a 502) with its prompt billed. It is refused
    as an engine refuses a prompt over its context: the client's 400, no prompt billed."""
    from gpusched_agent.adapters.torch_executor import TorchExecutor
    from gpusched_agent.adapters.torch_model import TinyConfig
    from gpusched_common.contracts import RequestResult, UsageRecord

    executor = TorchExecutor("cpu", seed=0, config=TinyConfig(dim=32, layers=1), threads=1)
    sent, _ = await run_on(executor, job("long", max_tokens=1000, prompt="x" * 36_000).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.engine_status_code, result.prompt_tokens) == ("failed", 400, 0)
    assert result.finish_reason == (
        "prompt (9000) + max_tokens (1000) exceed the torch model's maximum context length of "
        "8192 positions; send a shorter request")
    assert sum(u.prompt_tokens for u in sent if isinstance(u, UsageRecord)) == 0
    await executor.close()


def test_the_torch_models_limit_is_stated_where_its_refusals_are_read() -> None:
    """A request beyond the torch model's positions fails with a 400 on a torch node,
    though an openai node of a mixed fleet might run it, and counts toward
    GpuschedEngineRefusesRequests, whose advice (--max-model-len) does nothing there: the
    limit is stated in the alert's description, README and ARCHITECTURE."""
    import yaml

    from gpusched_agent.adapters.torch_model import TinyConfig

    root = Path(__file__).resolve().parents[2]
    limit = f"{TinyConfig().max_positions:,} positions"
    rules = yaml.safe_load((root / "ops/prometheus/gpusched-rules.yaml").read_text())
    [alert] = [rule for group in rules["groups"] for rule in group["rules"]
               if rule.get("alert") == "GpuschedEngineRefusesRequests"]
    assert f"torch model's {limit}" in alert["annotations"]["description"]
    for doc in ("README.md", "docs/ARCHITECTURE.md"):
        assert limit in " ".join((root / doc).read_text().split()), doc


async def test_requests_placed_at_once_on_a_cold_gpu_wait_for_one_load() -> None:
    """The node model counts the weights loaded from the first admission on, so the requests
    placed beside the first one used to skip the load and fail ('model ... is not loaded on
    GPU 0'), as ops/gpu-check's burst on a cold GPU showed."""
    from gpusched_agent.adapters.torch_executor import TorchExecutor
    from gpusched_agent.adapters.torch_model import TinyConfig
    from gpusched_common.contracts import RequestResult, UsageRecord

    executor = TorchExecutor("cpu", seed=0, config=TinyConfig(dim=32, layers=1), threads=1)
    loads: list[int] = []
    load = executor.load

    async def counted(model, gpu_index: int) -> None:
        loads.append(gpu_index)
        await load(model, gpu_index)

    executor.load = counted  # type: ignore[method-assign]
    sent, _ = await run_on(executor, *(job(f"cold{i}", max_tokens=6).request for i in range(4)))
    results = [m for m in sent if isinstance(m, RequestResult)]
    assert [(r.status, r.completion_tokens) for r in results] == [("completed", 6)] * 4
    assert sum(u.completion_tokens for u in sent if isinstance(u, UsageRecord)) == 24
    assert loads == [0]
    await executor.close()


class FailingFirstLoad(SimulatedExecutor):
    def __init__(self) -> None:
        super().__init__(time_scale=0.001, seed=0)
        self.loads = 0

    async def load(self, model, gpu_index: int) -> None:  # noqa: ANN001
        self.loads += 1
        await asyncio.sleep(0.01)
        if self.loads == 1:
            raise ExecutorError("CUDA out of memory")


async def test_a_failed_load_hands_its_waiters_back_and_the_next_request_loads_again() -> None:
    """The engine's fault, not the requests': they go back to be placed elsewhere."""
    from gpusched_common.contracts import RequestResult

    executor = FailingFirstLoad()
    sent, runtime = make_runtime(executor)
    await place(runtime, job("f1", max_tokens=3).request, job("f2", max_tokens=3).request)
    assert not [r for r in sent if isinstance(r, RequestResult)]
    assert sorted((r.request_id, r.requeued, r.refused) for r in sent
                  if isinstance(r, InferenceRequest)) == [("f1", "node_lost", 1),
                                                         ("f2", "node_lost", 1)]
    sent.clear()
    await place(runtime, job("f3", max_tokens=3).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert result.status == "completed" and executor.loads == 2
    await executor.close()


class SlowLoad(SimulatedExecutor):
    """Holds each model it has loaded, as a real engine does, and takes 0.2 s to load one."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.001, seed=0)
        self.held: set[tuple[int, str]] = set()

    async def load(self, model, gpu_index: int) -> None:  # noqa: ANN001
        await asyncio.sleep(0.2)
        self.held.add((gpu_index, model.name))

    async def unload(self, model_name: str, gpu_index: int) -> None:
        self.held.discard((gpu_index, model_name))

    def generate(self, job: Job):  # noqa: ANN201
        if (job.gpu_index, job.model.name) not in self.held:
            raise ExecutorError(f"model {job.model.name} is not loaded on GPU {job.gpu_index}")
        return super().generate(job)


async def test_a_request_cancelled_while_its_model_loads_leaves_the_model_loaded() -> None:
    """The node model keeps the weights after the cancel, so the executor must end up holding
    them too: the next request for the model runs without another load."""
    from gpusched_common.contracts import Cancel, RequestResult

    executor = SlowLoad()
    sent, runtime = make_runtime(executor)
    await place(runtime, job("c0", max_tokens=3).request)  # warm the runtime up
    executor.held.clear()
    runtime.node.gpus[0].loaded_mib.clear()
    first = asyncio.create_task(place(runtime, job("c1", max_tokens=3).request))
    await asyncio.sleep(0.05)  # c1 is loading its model
    runtime.cancel(Cancel(request_id="c1", reason="client_gone", at_ms=0))
    await first
    await place(runtime, job("c2", max_tokens=3).request)
    statuses = {r.request_id: r.status for r in sent if isinstance(r, RequestResult)}
    assert statuses == {"c0": "completed", "c1": "cancelled", "c2": "completed"}
    assert executor.held == {(0, SMALL.name)}
    await executor.close()


async def test_placements_that_evict_a_loading_model_share_the_eviction_and_the_load() -> None:
    """r0's llama is cancelled while it loads; r1 and r2 of mistral need its memory, and r1,
    which evicts it, is cancelled while it waits for llama's load to end. Before, r1's
    eviction and load ran in r1's own task: the cancel cut them short, the node model kept
    mistral loaded and llama evicted while the executor held llama and not mistral, and r2
    (admitted as needing no load) failed with 'not loaded', as did every later mistral."""
    from gpusched_common.contracts import Cancel, RequestResult

    executor = SlowLoad()
    sent, runtime = make_runtime(executor)
    llama, mistral = CATALOG.get("llama-3.1-8b"), CATALOG.get("mistral-7b")

    def request(rid: str, model) -> InferenceRequest:  # noqa: ANN001
        return job(rid, max_tokens=3).request.model_copy(update={"model": model.name})

    first = asyncio.create_task(place(runtime, request("r0", llama)))
    await asyncio.sleep(0.05)  # r0 loads llama
    runtime.cancel(Cancel(request_id="r0", reason="client_gone", at_ms=0))
    await first
    both = asyncio.create_task(place(runtime, request("r1", mistral), request("r2", mistral)))
    await asyncio.sleep(0.05)  # r1 waits for llama's load, to unload it
    runtime.cancel(Cancel(request_id="r1", reason="client_gone", at_ms=0))
    await both
    await place(runtime, request("r3", mistral))
    statuses = {r.request_id: r.status for r in sent if isinstance(r, RequestResult)}
    assert statuses == {"r0": "cancelled", "r1": "cancelled", "r2": "completed",
                        "r3": "completed"}
    assert executor.held == {(0, mistral.name)}
    assert list(runtime.node.gpus[0].loaded_mib) == [mistral.name]
    await executor.close()


@pytest.mark.parametrize("stop", ["cancel", "preempt"])
async def test_a_stop_during_a_partial_usage_send_still_bills_that_record(stop: str) -> None:
    """A partial usage record counts its tokens billed before it is sent; a cancel or a
    preempt landing while Kafka takes it used to drop it (a CancelledError is no Exception),
    so those tokens, or the prompt when it was the first record, were never billed."""
    from gpusched_common.contracts import Cancel, Preempt, RequestResult, UsageRecord

    sending = asyncio.Event()

    async def slow_partials(message) -> None:  # noqa: ANN001
        if isinstance(message, UsageRecord) and not message.final:
            if message.completion_tokens:  # the first partial is sent before any token
                sending.set()
            await asyncio.sleep(0.05)  # Kafka has not taken it yet

    executor = SimulatedExecutor(time_scale=0.001, seed=0)
    sent, runtime = make_runtime(executor, slow_partials, usage_interval_s=0.0)
    request = job("u", max_tokens=500, prompt="p" * 400).request
    running = asyncio.create_task(place(runtime, request))
    await asyncio.wait_for(sending.wait(), 10)  # inside a partial record's send
    if stop == "cancel":
        runtime.cancel(Cancel(request_id="u", reason="client_gone", at_ms=0))
    else:
        await runtime.command(Preempt(placement_id="u#0", request_id="u", node_id="n",
                                      scheduler_epoch=0, reason="for interactive work"))
    await running
    usage = [m for m in sent if isinstance(m, UsageRecord)]
    results = [m for m in sent if isinstance(m, RequestResult)]  # cancelled
    back = [m for m in sent if isinstance(m, InferenceRequest)]  # preempted: the next attempt
    generated = results[0].completion_tokens if results else len(back[0].resume.tokens)
    assert sum(u.prompt_tokens for u in usage) == request.prompt_token_count == 100
    assert sum(u.completion_tokens for u in usage) == generated > 0
    await executor.close()


async def test_a_preempted_request_too_large_to_hand_back_ends_failed_not_stuck() -> None:
    """With its tokens, the hand-back would be over Kafka's record limit: the agent tried
    to publish it again forever, holding its claim, and the request never ended."""
    from gpusched_common.contracts import MAX_RECORD_BYTES, Preempt, RequestResult, UsageRecord

    executor = SimulatedExecutor(time_scale=0.001, seed=0)
    sent, runtime = make_runtime(executor)
    request = job("big", max_tokens=30_000, prompt="\x01" * 165_000,
                  prompt_tokens=1_000).request  # within the model's context
    assert len(request.to_bytes()) < MAX_RECORD_BYTES  # it came in as one record
    running = asyncio.create_task(place(runtime, request))
    async with asyncio.timeout(10):
        while not runtime.in_flight or runtime._running["big#0"].completion_tokens < 1000:
            await asyncio.sleep(0.01)
    await runtime.command(Preempt(placement_id="big#0", request_id="big", node_id="n",
                                  scheduler_epoch=0, reason="for interactive work"))
    await running
    assert not [m for m in sent if isinstance(m, InferenceRequest)]
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert result.status == "failed" and "too large to hand back" in result.finish_reason
    usage = [m for m in sent if isinstance(m, UsageRecord)]
    assert sum(u.completion_tokens for u in usage) == result.completion_tokens >= 1000
    await executor.close()


async def test_a_request_preempted_before_its_first_token_bills_its_prompt_once() -> None:
    """The preempted attempt's final usage bills the prompt; the next one goes on with no
    tokens to resume. Before, only a resume with tokens counted the prompt billed, so it
    was billed again (100 + 100 prompt tokens)."""
    from gpusched_common.contracts import Preempt, RequestResult, UsageRecord

    executor = SlowLoad()
    sent, runtime = make_runtime(executor)
    request = job("p", max_tokens=3, prompt="x" * 400).request
    first = asyncio.create_task(place(runtime, request))
    await asyncio.sleep(0.05)  # loading its model
    await runtime.command(Preempt(placement_id="p#0", request_id="p", node_id="n",
                                  scheduler_epoch=0, reason="for interactive work"))
    await first
    [again] = [m for m in sent if isinstance(m, InferenceRequest)]
    assert again.attempt == 1 and again.resume is not None and not again.resume.tokens
    await place(runtime, again)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    usage = [m for m in sent if isinstance(m, UsageRecord)]
    assert result.status == "completed" and result.prompt_tokens == 100
    assert sum(u.prompt_tokens for u in usage) == 100
    assert sum(u.completion_tokens for u in usage) == result.completion_tokens == 3
    await executor.close()


async def test_a_cancel_stops_every_attempt_of_its_request_on_the_node() -> None:
    """Attempt 0, preempted, stays in the runtime until Redis takes its claim's release;
    attempt 1 placed here meanwhile must be cancelled too. Before, the cancel stopped the
    first run it found (the ending attempt 0) and attempt 1 completed."""
    from gpusched_common.contracts import Cancel, Preempt, RequestResult

    executor = SimulatedExecutor(time_scale=0.05, seed=0)
    sent, runtime = make_runtime(executor)
    release = runtime._ledger.release

    async def slow_release(placement_id: str, node_id: str) -> None:
        await asyncio.sleep(0.5)
        await release(placement_id, node_id)

    runtime._ledger.release = slow_release  # type: ignore[method-assign]
    request = job("c", max_tokens=400).request
    first = asyncio.create_task(place(runtime, request))
    await asyncio.sleep(0.1)
    await runtime.command(Preempt(placement_id="c#0", request_id="c", node_id="n",
                                  scheduler_epoch=0, reason="for interactive work"))
    async with asyncio.timeout(10):
        while not any(isinstance(m, InferenceRequest) for m in sent):
            await asyncio.sleep(0.005)
    [again] = [m for m in sent if isinstance(m, InferenceRequest)]
    second = asyncio.create_task(place(runtime, again))
    await asyncio.sleep(0.05)  # attempt 1 runs; attempt 0 still waits for its release
    runtime.cancel(Cancel(request_id="c", reason="client_gone", at_ms=0))
    await asyncio.gather(first, second)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert result.status == "cancelled" and result.completion_tokens < 400
    await executor.close()


async def test_an_engine_that_ends_the_text_early_finishes_with_stop_not_length() -> None:
    from gpusched_common.contracts import RequestResult, UsageRecord

    async with LocalServer() as server:
        executor = OpenAIExecutor(server.url)
        sent, _ = await run_on(executor, job("early", max_tokens=10, stop=[" w3"]).request)
        await executor.close()
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    [usage] = [m for m in sent if isinstance(m, UsageRecord)]
    assert (result.finish_reason, result.text) == ("stop", " w0 w1 w2")
    assert result.completion_tokens == usage.completion_tokens == 3


# --- an engine that is down ------------------------------------------------------------------
class Engine:
    """An inference server the test switches: `up` streams `tokens` deltas " e<i>"; `down`
    refuses connections; `busy` answers 503; `crash_after` drops the connection after that
    many deltas, once."""

    def __init__(self, tokens: int = 6, prompt_tokens: int | None = None) -> None:
        self.tokens, self.mode, self.crash_after = tokens, "up", None
        self.prompt_tokens = prompt_tokens
        self.asked: list[str] = []

    def __call__(self, request):  # noqa: ANN001, ANN204
        import httpx

        self.asked.append(request.url.path)
        if self.mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if self.mode == "busy":
            return httpx.Response(503, text="server is restarting")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=LISTS_EVERY_MODEL)
        left = json.loads(request.content)["max_tokens"]
        crash, self.crash_after = self.crash_after, None

        async def events():  # noqa: ANN202
            for i in range(left):
                if i == crash:
                    raise httpx.RemoteProtocolError("peer closed connection", request=request)
                event = json.loads(delta(f" e{i}"))
                if self.prompt_tokens is not None:  # as vLLM's continuous_usage_stats
                    event["usage"] = {"prompt_tokens": self.prompt_tokens,
                                      "completion_tokens": i + 1}
                yield f"data: {json.dumps(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=events())

    def executor(self) -> OpenAIExecutor:
        import httpx

        return OpenAIExecutor("http://engine", client=httpx.AsyncClient(
            base_url="http://engine", transport=httpx.MockTransport(self)))


@pytest.mark.parametrize("mode", ["down", "busy", "crash"])
async def test_an_unavailable_engine_is_told_apart_from_a_failed_request(mode: str) -> None:
    from gpusched_agent.adapters.executor import ExecutorUnavailable

    engine_ = Engine()
    engine_.mode, engine_.crash_after = ("up", 2) if mode == "crash" else (mode, None)
    executor = engine_.executor()
    got: list[str] = []
    with pytest.raises(ExecutorUnavailable):
        async for token in executor.generate(job("d", max_tokens=6)):
            got.append(token)
    assert got == ([" e0", " e1"] if mode == "crash" else [])
    assert (await executor.health() is None) == (mode == "crash")
    engine_.mode = "up"
    assert await executor.health() is None
    await executor.close()


@pytest.mark.parametrize("stall_at", [None, 2], ids=["before-headers", "mid-stream"])
async def test_a_wedged_engine_hands_its_request_back_and_the_node_waits_for_a_token(
        stall_at: int | None) -> None:
    """An engine that sent nothing for the time-out (httpx's ReadTimeout) failed its request
    as `executor error: ... ReadTimeout('')`, blamed on the request, with half its answer,
    and the node kept taking work: a wedged vLLM still answers /v1/models. Now it goes on
    elsewhere after its tokens, and the node takes none until the engine makes a token."""
    import httpx

    from gpusched_common.contracts import RequestResult

    wedged, asked = True, []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        asked.append((request.url.path, body.get("max_tokens")))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=LISTS_EVERY_MODEL)
        if wedged and (stall_at is None or not body["stream"]):
            raise httpx.ReadTimeout("", request=request)

        async def events():  # noqa: ANN202
            for i in range(body["max_tokens"]):
                if wedged and i == stall_at:
                    raise httpx.ReadTimeout("", request=request)
                yield f"data: {delta(f' e{i}')}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=events())

    executor = OpenAIExecutor("http://engine", client=httpx.AsyncClient(
        base_url="http://engine", transport=httpx.MockTransport(answer)))
    sent, runtime = make_runtime(executor)
    await place(runtime, job("w", max_tokens=6).request)
    assert not [m for m in sent if isinstance(m, RequestResult)]
    [again] = [m for m in sent if isinstance(m, InferenceRequest)]
    assert (again.requeued, again.resume and again.resume.tokens) == (
        "node_lost", None if stall_at is None else (" e0", " e1"))
    assert runtime.node.down == "inference server at http://engine sent nothing for 600 s"
    await runtime._check_engine()  # /v1/models answers, and is not enough
    assert "one token, asked since a request failed on it" in (runtime.node.down or "")
    assert asked[-2:] == [("/v1/models", None), ("/v1/completions", 1)]
    wedged = False
    await runtime._check_engine()
    assert runtime.node.down is None
    await runtime._check_engine()  # a token came: /v1/models is enough again
    assert asked[-1] == ("/v1/models", None) and asked[-2] == ("/v1/completions", 1)
    await executor.close()


async def test_each_stalled_model_is_probed_on_its_own_endpoint_and_a_refusal_is_alive(
        ) -> None:
    """After a stall, `health` asked `/v1/completions` for the last stalled model only: a
    chat-only server answered 404 and the node stayed down until the agent restarted; a
    second model's stall was never probed; and a stall during a probe was cleared by it."""
    import httpx

    from gpusched_agent.adapters.executor import ExecutorUnavailable

    wedged, asked = {"chat", "plain"}, []
    stall_during_probe = False

    async def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        path = request.url.path
        asked.append((path, body.get("model"), body.get("stream")))
        if path == "/v1/models":
            return httpx.Response(200, json=LISTS_EVERY_MODEL)
        if body["stream"] or body["model"] in wedged:
            raise httpx.ReadTimeout("", request=request)
        nonlocal stall_during_probe
        if stall_during_probe:  # a request stalls again while this probe is on its way
            stall_during_probe = False
            with pytest.raises(ExecutorUnavailable):
                await collect(executor.generate(chat))
        if path == "/v1/completions":
            return httpx.Response(404, json={"error": {"message": "only chat here"}})
        return httpx.Response(200, json={"choices": [{"message": {"content": "p"}}]})

    executor = OpenAIExecutor("http://engine", client=httpx.AsyncClient(
        base_url="http://engine", transport=httpx.MockTransport(answer)))
    plain = replace(job("p", max_tokens=3), model=SMALL.model_copy(update={"name": "plain"}))
    chat = job("c", max_tokens=3)
    chat = replace(chat, model=SMALL.model_copy(update={"name": "chat"}),
                   request=chat.request.model_copy(
                       update={"messages": (ChatTurn(role="user", content="hi"),)}))
    for stalled in (plain, chat):
        with pytest.raises(ExecutorUnavailable, match="sent nothing"):
            await collect(executor.generate(stalled))
    assert "one token" in (await executor.health() or "")
    wedged.clear()
    asked.clear()
    stall_during_probe = True
    assert await executor.health() is None  # a 404 is an answer: the engine is not wedged
    assert [(path, model) for path, model, stream in asked if stream is False] == [
        ("/v1/completions", "plain"), ("/v1/chat/completions", "chat")]
    asked.clear()
    await executor.health()  # the chat model stalled during its probe: asked again
    assert [(path, model) for path, model, stream in asked if stream is False] == [
        ("/v1/chat/completions", "chat")]
    asked.clear()
    assert await executor.health() is None
    assert [path for path, _, _ in asked] == ["/v1/models"]
    await executor.close()


VLLM_CONTEXT_400 = {
    "object": "error", "type": "BadRequestError", "param": None, "code": 400,
    "message": "This model's maximum context length is 8192 tokens. However, you requested "
    "8296 tokens (8196 in the messages, 100 in the completion). Please reduce the length of "
    "the messages or completion."}
"""vLLM's answer to a prompt its tokenizer finds longer than gpusched's estimate."""


def refusing(status: int, **reply: object):  # noqa: ANN201
    """An executor whose engine answers every request `status` with `reply`."""
    import httpx

    return OpenAIExecutor("http://engine", client=httpx.AsyncClient(
        base_url="http://engine", transport=httpx.MockTransport(
            lambda _: httpx.Response(status, **reply))))


@pytest.mark.parametrize("status,reply,message", [
    (400, {"json": VLLM_CONTEXT_400}, VLLM_CONTEXT_400["message"]),
    (400, {"json": {"error": {"message": "Conversation roles must alternate user/assistant/"
                              "user/assistant/...", "type": "BadRequestError", "code": 400}}},
     "Conversation roles must alternate user/assistant/user/assistant/..."),  # newer vLLM
    (422, {"json": {"error": "Input validation error: `inputs` tokens + `max_new_tokens` "
                             "must be <= 4096", "error_type": "validation"}},  # TGI
     "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096"),
    (413, {"text": "request body too large"}, "request body too large"),
], ids=["vllm", "openai-shape", "tgi", "plain-text"])
async def test_a_request_the_engine_refuses_fails_with_its_status_and_message(
        status: int, reply: dict, message: str) -> None:
    """Any engine would refuse it the same: not handed back as an unavailable engine's
    requests are, and the engine's status and words reach the client (before, a plain
    ExecutorError: its client got a 502, which the openai SDK sends twice more)."""
    from gpusched_agent.adapters.executor import ExecutorRefused, ExecutorUnavailable

    executor = refusing(status, **reply)
    with pytest.raises(ExecutorRefused) as raised:
        await collect(executor.generate(job("long")))
    assert not isinstance(raised.value, ExecutorUnavailable)
    assert raised.value.status_code == status
    assert str(raised.value) == f"inference server answered {status}: {message}"
    await executor.close()


@pytest.mark.parametrize("status", [408, 409, 500])
async def test_an_engine_status_about_itself_is_no_refusal_of_the_request(status: int) -> None:
    from gpusched_agent.adapters.executor import ExecutorRefused

    executor = refusing(status, text="try later")
    with pytest.raises(ExecutorError, match=f"answered {status}: try later") as raised:
        await collect(executor.generate(job("x")))
    assert not isinstance(raised.value, ExecutorRefused)
    await executor.close()


async def test_a_request_the_engine_refuses_ends_failed_with_its_status_and_no_prompt_billed(
) -> None:
    """Failed at once with the engine's 4xx, never handed back (it would be refused on any
    node), and billed as a request the engine turned away with a 500 is. Both were billed
    their prompt as estimated, which neither engine processed (5,000 tokens for a prompt
    vLLM found too long); the GPU time their placements held is billed."""
    from gpusched_common.contracts import NodeState, RequestResult, UsageRecord

    outcomes = {}
    for status, reply in ((400, {"json": VLLM_CONTEXT_400}), (500, {"text": "engine bug"})):
        sent, _ = await run_on(refusing(status, **reply), job("r", prompt="x" * 40).request)
        assert not [m for m in sent if isinstance(m, InferenceRequest)]  # no hand-back
        assert all(gpu.healthy for m in sent if isinstance(m, NodeState) for gpu in m.gpus)
        [result] = [m for m in sent if isinstance(m, RequestResult)]
        [usage] = [m for m in sent if isinstance(m, UsageRecord)]
        outcomes[status] = result, usage
    refused, broke = outcomes[400][0], outcomes[500][0]
    assert (refused.status, refused.engine_status_code) == ("failed", 400)
    assert refused.finish_reason == f"inference server answered 400: {VLLM_CONTEXT_400['message']}"
    assert (broke.status, broke.engine_status_code) == ("failed", None)
    assert broke.finish_reason == "executor error: inference server answered 500: engine bug"
    assert [(u.prompt_tokens, u.completion_tokens, u.final) for _, u in outcomes.values()
            ] == [(0, 0, True)] * 2
    assert all(u.gpu_seconds > 0 for _, u in outcomes.values())
    assert refused.prompt_tokens == broke.prompt_tokens == 0


@pytest.mark.parametrize("answer", [400, 503], ids=["refused", "unavailable"])
async def test_a_prompt_billed_before_the_engine_turned_the_request_away_stays_billed(
        answer: int) -> None:
    """An engine that took longer than a usage interval to answer: the partial record billed
    the prompt by then, and the result says so (usage is never taken back); handed back, the
    request carries its (empty) resume, so no later attempt bills the prompt again."""
    import httpx

    from gpusched_common.contracts import RequestResult, UsageRecord

    async def slow(_: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.3)
        return httpx.Response(answer, json=VLLM_CONTEXT_400) if answer == 400 \
            else httpx.Response(answer, text="server is restarting")

    executor = OpenAIExecutor("http://engine", client=httpx.AsyncClient(
        base_url="http://engine", transport=httpx.MockTransport(slow)))
    sent, runtime = make_runtime(executor, usage_interval_s=0.05)
    await place(runtime, job("slow", prompt="x" * 40).request)
    usage = [m for m in sent if isinstance(m, UsageRecord)]
    assert sum(u.prompt_tokens for u in usage) == 10
    assert usage[-1].final and usage[-1].prompt_tokens == 0  # billed by a partial record
    if answer == 400:
        [result] = [m for m in sent if isinstance(m, RequestResult)]
        assert (result.status, result.engine_status_code, result.prompt_tokens) == (
            "failed", 400, 10)
    else:
        [again] = [m for m in sent if isinstance(m, InferenceRequest)]
        assert (again.requeued, again.resume) == ("node_lost", Resume())
    await executor.close()


@pytest.mark.parametrize("turned_away", ["busy", "down"])
async def test_a_request_no_engine_took_is_billed_its_prompt_where_one_runs_it(
        turned_away: str) -> None:
    """Handed back by an engine that answered 503 or could not be reached, a request kept
    its prompt billed as estimated and went back as resumed, so where it ran next the
    engine's count was never taken (1,000 billed for a prompt vLLM counted 1,400); one that
    an engine then refused with a 400 failed billed 1,000 prompt tokens, and one that five
    engines turned away as well, though no engine ever processed it. Now it goes back
    unbilled and as it came: the attempt that runs it bills the prompt."""
    from gpusched_agent.runtime import MAX_ATTEMPTS
    from gpusched_common.contracts import RequestResult, UsageRecord

    away = Engine()
    away.mode = turned_away
    counting = Engine(tokens=2, prompt_tokens=1400)
    request = job("r", max_tokens=2, prompt="x" * 4000).request  # estimated: 1,000

    async def twice(first: Engine, then) -> list:  # noqa: ANN001
        sent, _ = await run_on(first.executor(), request)
        [again] = [m for m in sent if isinstance(m, InferenceRequest)]
        assert (again.requeued, again.resume, again.prompt_tokens) == ("node_lost", None, None)
        more, _ = await run_on(then, again)
        return sent + more

    sent = await twice(away, counting.executor())
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.prompt_tokens) == ("completed", 1400)
    assert sum(u.prompt_tokens for u in sent if isinstance(u, UsageRecord)) == 1400
    sent = await twice(away, refusing(400, json=VLLM_CONTEXT_400))
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.engine_status_code, result.prompt_tokens) == (
        "failed", 400, 0)
    assert sum(u.prompt_tokens for u in sent if isinstance(u, UsageRecord)) == 0
    last = request.model_copy(update={"attempt": MAX_ATTEMPTS - 1, "refused": MAX_ATTEMPTS - 1,
                                      "requeued": "node_lost"})
    sent, _ = await run_on(away.executor(), last)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.prompt_tokens) == ("failed", 0)
    assert sum(u.prompt_tokens for u in sent if isinstance(u, UsageRecord)) == 0


async def test_a_down_engine_hands_its_requests_back_and_the_node_takes_none_until_it_is_up(
) -> None:
    """Every request placed on a node whose engine restarted failed at once, and the node
    stayed ready, so the scheduler kept sending it work to fail."""
    from gpusched_common.contracts import NodeState, RequestResult, UsageRecord

    engine_ = Engine()
    engine_.mode = "down"
    sent, runtime = make_runtime(engine_.executor())
    reporting = None
    try:
        await place(runtime, job("a", max_tokens=6).request)  # before any check of the engine
        reporting = asyncio.create_task(runtime.report_forever())
        [again] = [m for m in sent if isinstance(m, InferenceRequest)]
        assert (again.attempt, again.requeued) == (1, "node_lost")
        assert not [m for m in sent if isinstance(m, RequestResult)]
        [usage] = [m for m in sent if isinstance(m, UsageRecord)]
        assert usage.final and usage.completion_tokens == 0
        async with asyncio.timeout(10):  # reported at once, not at the next heartbeat
            while not any(isinstance(m, NodeState) and not m.gpus[0].healthy for m in sent):
                await asyncio.sleep(0.01)
        down = [m for m in sent if isinstance(m, NodeState)][-1].gpus[0]
        assert "unreachable" in (down.unhealthy_reason or "")
        await place(runtime, job("b").request)  # sent before the scheduler saw the state
        assert [(m.request_id, m.attempt) for m in sent if isinstance(m, InferenceRequest)
                ] == [("a", 1), ("b", 1)]
        engine_.mode = "up"
        async with asyncio.timeout(10):  # the next heartbeat's check finds it back
            while not [m for m in sent if isinstance(m, NodeState)][-1].gpus[0].healthy:
                await asyncio.sleep(0.01)
        await place(runtime, again)
        [result] = [m for m in sent if isinstance(m, RequestResult)]
        assert (result.request_id, result.status, result.completion_tokens) == (
            "a", "completed", 6)
    finally:
        if reporting is not None:
            reporting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporting
        await runtime.executor.close()


async def test_a_request_whose_engine_crashed_mid_stream_goes_on_elsewhere_billed_once(
) -> None:
    """It failed with the tokens it had, so its client got half an answer; now the next
    attempt continues after them, and prompt and tokens are billed once over both."""
    from gpusched_common.contracts import RequestResult, TokenChunk, UsageRecord

    engine_ = Engine(prompt_tokens=23)
    engine_.crash_after = 4
    sent, runtime = make_runtime(engine_.executor())
    request = job("m", max_tokens=10, prompt="x" * 40).request
    await place(runtime, request)
    [again] = [m for m in sent if isinstance(m, InferenceRequest)]
    assert again.requeued == "node_lost" and again.resume.tokens == (" e0", " e1", " e2", " e3")
    # as the engine counted it (the estimate is 10), in its resume: the request is as it came
    assert again.resume.prompt_tokens == again.billed_prompt_tokens == 23
    assert again.asks() == request.asks() and again.prompt_tokens is None
    _, elsewhere = make_runtime(Engine(prompt_tokens=40).executor())  # another node
    elsewhere._publish = runtime._publish
    await place(elsewhere, again)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.completion_tokens) == ("completed", 10)
    assert result.text == " e0 e1 e2 e3" + "".join(f" e{i}" for i in range(6))
    usage = [m for m in sent if isinstance(m, UsageRecord)]
    # billed once, by the first run, as its engine counted it (the second counts the resumed
    # prefix in its prompt: billed already, as completion tokens)
    assert sum(u.prompt_tokens for u in usage) == result.prompt_tokens == 23
    assert sum(u.completion_tokens for u in usage) == 10
    streamed = "".join(c.text for c in sorted(
        (m for m in sent if isinstance(m, TokenChunk)), key=lambda c: c.seq))
    assert streamed == result.text
    await runtime.executor.close()
    await elsewhere.executor.close()


@pytest.mark.parametrize("then", ["drop", "eof", "preempt", "drain", "cancel"])
async def test_a_reply_the_engine_finished_is_complete_whatever_ends_the_run_before_done(
        then: str) -> None:
    """The engine said `stop` after 2 of 10 tokens (the model ended its text), then the
    connection dropped before [DONE], or a preempt or a drain came: the request went back,
    and another node went on past the model's own end (' a b MORE TEXT'); a stream ended
    cleanly there (a proxy) failed it, a 502 for a whole, billed reply. Now it completes
    with the engine's reason; a cancel, whose client was billed the reply, too. After a
    drop the node still waits for its engine's next health check."""
    import httpx

    from gpusched_common.contracts import Cancel, Preempt, RequestResult, UsageRecord

    finished = asyncio.Event()

    def finished_then(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=LISTS_EVERY_MODEL)

        async def events():  # noqa: ANN202
            yield f"data: {delta(' a')}\n\n".encode()
            yield f"data: {finish(' b', 'stop')}\n\n".encode()
            finished.set()  # asked for more: the agent has read the finish reason
            if then == "drop":
                raise httpx.RemoteProtocolError("peer closed connection", request=request)
            if then != "eof":  # the usage event and [DONE] have not come yet
                await asyncio.Event().wait()

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=events())

    executor = OpenAIExecutor("http://engine", client=httpx.AsyncClient(
        base_url="http://engine", transport=httpx.MockTransport(finished_then)))
    sent, runtime = make_runtime(executor)
    running = asyncio.create_task(place(runtime, job("ended", max_tokens=10).request))
    await asyncio.wait_for(finished.wait(), 10)
    if then == "preempt":
        await runtime.command(Preempt(placement_id="ended#0", request_id="ended", node_id="n",
                                      scheduler_epoch=0, reason="for interactive work"))
    elif then == "drain":
        await runtime.drain(timeout_s=0)
    elif then == "cancel":
        runtime.cancel(Cancel(request_id="ended", reason="client_gone", at_ms=0))
    await running
    assert not [m for m in sent if isinstance(m, InferenceRequest)]
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.finish_reason, result.text, result.completion_tokens) == (
        "completed", "stop", " a b", 2)
    assert sum(u.completion_tokens for u in sent if isinstance(u, UsageRecord)) == 2
    assert ("dropped the stream" in (runtime.node.down or "")) == (then == "drop")
    await executor.close()


async def test_a_request_handed_back_by_engines_too_often_ends_failed() -> None:
    """Preemptions used the same count: a request preempted four times failed for good the
    first time an engine was unavailable. Only attempts agents could not run count now."""
    from gpusched_agent.runtime import MAX_ATTEMPTS
    from gpusched_common.contracts import RequestResult

    engine_ = Engine()
    engine_.mode = "busy"
    sent, runtime = make_runtime(engine_.executor())
    preempted = job("p").request.model_copy(update={"attempt": MAX_ATTEMPTS - 1,
                                                    "requeued": "preempted"})
    last = job("f").request.model_copy(update={"attempt": MAX_ATTEMPTS - 1,
                                               "refused": MAX_ATTEMPTS - 1,
                                               "requeued": "node_lost"})
    await place(runtime, preempted, last)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert result.request_id == "f" and result.status == "failed"
    assert result.finish_reason.startswith(
        f"not runnable after {MAX_ATTEMPTS} attempts: executor unavailable") and (
        "503" in result.finish_reason)
    [again] = [m for m in sent if isinstance(m, InferenceRequest)]
    assert (again.request_id, again.attempt, again.refused) == ("p", MAX_ATTEMPTS, 1)
    await runtime.executor.close()


# --- what an engine may send -----------------------------------------------------------------
async def test_an_emoji_split_across_events_is_joined_and_a_lone_half_replaced() -> None:
    """JSON escapes an emoji as a surrogate pair, which a proxy may split across events:
    each half became a string no record can hold as UTF-8, so the request's result could
    not be published, and the agent tried again forever."""
    split = ['{"choices": [{"text": "\\ud83d"}]}', '{"choices": [{"text": "\\ude00!"}]}',
             '{"choices": [{"text": "\\udc00"}]}', "[DONE]"]
    executor = engine(*split)
    sent, _ = await run_on(executor, job("emoji", max_tokens=5).request)
    for message in sent:
        message.to_bytes()  # each can go to Kafka
    from gpusched_common.contracts import RequestResult

    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert result.status == "completed" and result.text == "\U0001F600!\ufffd"
    await executor.close()


@pytest.mark.parametrize("counts", [True, False], ids=["engine-counts", "no-counts"])
async def test_a_lone_half_at_the_end_of_the_reply_is_replaced_and_its_token_billed_once(
        counts: bool) -> None:
    """The half waited for its rest, which never came: it was dropped from the text."""
    from gpusched_common.contracts import RequestResult, UsageRecord

    def event(escaped: str, count: int) -> str:  # JSON escapes: no lone half is UTF-8
        usage = f', "usage": {{"completion_tokens": {count}}}' if counts else ""
        return f'{{"choices": [{{"text": "{escaped}"}}]{usage}}}'

    executor = engine(event("a", 1), event("\\ud83d", 2), "[DONE]")
    sent, _ = await run_on(executor, job("half", max_tokens=5).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.text, result.completion_tokens) == ("a\ufffd", 2)
    assert sum(u.completion_tokens for u in sent if isinstance(u, UsageRecord)) == 2
    await executor.close()


async def test_a_stop_string_in_a_delta_of_several_tokens_bills_them_all() -> None:
    """The text came first and the delta's other tokens after it, so the runtime, closing
    the stream at the stop string, billed 2 of the 4 tokens the engine counted."""
    from gpusched_common.contracts import RequestResult, UsageRecord

    executor = engine(delta("ab", counted=1), delta("xSTOP", counted=4), delta("more", counted=5),
                      "[DONE]")
    sent, _ = await run_on(executor, job("stop", max_tokens=9, stop=["STOP"]).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.text, result.finish_reason, result.completion_tokens) == ("abx", "stop", 4)
    assert sum(u.completion_tokens for u in sent if isinstance(u, UsageRecord)) == 4
    await executor.close()


async def test_an_engines_prompt_count_beyond_the_models_context_is_not_billed() -> None:
    """Billed as it came (999,999,999 tokens), and carried on a hand-back, it sized the next
    attempt's KV cache so that no GPU could ever hold it."""
    from gpusched_common.contracts import RequestResult, UsageRecord

    executor = engine(delta("a", counted=1, prompt=999_999_999), "[DONE]")
    sent, _ = await run_on(executor, job("huge", max_tokens=1).request)
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert result.prompt_tokens == sum(u.prompt_tokens for u in sent
                                       if isinstance(u, UsageRecord)) == 3  # the estimate
    await executor.close()


@pytest.mark.parametrize("event", [
    '{"choices": [{"delta": "hi"}]}', '{"choices": [{"text": 5}]}',
    '{"choices": [{"delta": {"content": ["a"]}}]}', '{"choices": {"0": {"text": "a"}}}',
    '{"choices": [{"text": "a", "finish_reason": {"type": "stop", "matched": 2}}]}',
], ids=["delta-string", "text-number", "content-list", "choices-object", "finish-object"])
async def test_an_event_of_another_shape_fails_as_the_engines_fault(event: str) -> None:
    """They raised AttributeError or TypeError from inside the executor (a finish reason
    as an object, as SGLang's native API sends: "unhashable type: 'dict'"), or (choices as
    an object) passed for an empty answer."""
    executor = engine(event, "[DONE]")
    with pytest.raises(ExecutorError, match="shape|not a list"):
        await collect(executor.generate(job("odd", max_tokens=3)))
    await executor.close()


async def test_an_event_with_a_null_error_field_is_a_good_one() -> None:
    executor = engine('{"choices": [{"text": " a"}], "error": null}', "[DONE]")
    assert await collect(executor.generate(job("null", max_tokens=3))) == [" a"]
    await executor.close()


ENGINE_DEAD = json.dumps({"error": {
    "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    "type": "BadRequestError", "param": None, "code": 400}})
"""What vLLM streams, inside its 200, once its engine process has died (EngineDeadError)."""


class ErrorInStream:
    """An inference server that streams `events` and, asked for one token without a stream
    (the agent's probe), answers as `probe` says: `token` at once, `slow` after the health
    check's time-out (queued behind a busy batch), `404` (a refusal), `500` (a dead vLLM's
    engine), `gone` (its port closed)."""

    def __init__(self, *events: str, probe: str) -> None:
        self.events, self.probe, self.probes = events, probe, 0

    async def __call__(self, request):  # noqa: ANN001, ANN204
        import httpx

        from gpusched_agent.adapters import openai_executor

        if request.url.path == "/v1/models":
            return httpx.Response(200, json=LISTS_EVERY_MODEL)
        if not json.loads(request.content)["stream"]:
            self.probes += 1
            if self.probe == "gone":
                raise httpx.ConnectError("connection refused", request=request)
            if self.probe == "slow":
                await asyncio.sleep(2 * openai_executor.HEALTH_TIMEOUT_S)
            return httpx.Response(200, json={"choices": [{"text": "p"}]}) \
                if self.probe in ("token", "slow") else httpx.Response(int(self.probe))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content="".join(f"data: {e}\n\n" for e in self.events))

    def executor(self) -> OpenAIExecutor:
        import httpx

        return OpenAIExecutor("http://engine", client=httpx.AsyncClient(
            base_url="http://engine", transport=httpx.MockTransport(self)))


@pytest.mark.parametrize("events,tokens", [
    ((delta(" a"), delta(" b"), ENGINE_DEAD, "[DONE]"), (" a", " b")),
    ((ENGINE_DEAD, "[DONE]"), ()),
    ((delta(" a"), finish("", "error"), "[DONE]"), (" a",)),
], ids=["mid-stream", "before-any-token", "finish-reason-error"])
async def test_an_error_in_the_stream_hands_the_request_back_and_the_node_waits_for_a_token(
        events: tuple[str, ...], tokens: tuple[str, ...]) -> None:
    """vLLM does not drop the connection when its engine dies: it sends an error event
    (EngineDeadError as a 400) and [DONE] inside its 200. The request failed, 502 with a
    Python dict for its reason, its tokens lost, and the node took more work to fail the
    same way. Now it goes on elsewhere after its tokens, and the node takes no work until
    the engine generates a token."""
    from gpusched_common.contracts import RequestResult

    server = ErrorInStream(*events, probe="500")
    sent, runtime = make_runtime(server.executor())
    await place(runtime, job("dead", max_tokens=6).request)
    assert not [m for m in sent if isinstance(m, RequestResult)]
    [again] = [m for m in sent if isinstance(m, InferenceRequest)]
    assert (again.requeued, again.resume.tokens if again.resume else ()) == ("node_lost", tokens)
    assert runtime.node.down is not None and "{" not in runtime.node.down
    assert runtime.node.down.startswith(
        "inference server at http://engine failed the request in its stream: ")
    await runtime._check_engine()  # /v1/models answers, and is not enough
    assert "one token, asked since a request failed on it" in (runtime.node.down or "")
    server.probe = "token"
    await runtime._check_engine()
    assert runtime.node.down is None
    await runtime.executor.close()


TOO_LONG = json.dumps({"error": {
    "message": "The decoder prompt (length 9000) is longer than the maximum model length of "
    "8192. Make sure that `max_model_len` is no smaller than the number of text tokens.",
    "type": "BadRequestError", "param": None, "code": 400}})
"""What vLLM streams, inside its 200, for a prompt its tokenizer finds too long."""


@pytest.mark.parametrize("probe", ["token", "slow", "404"])
async def test_an_error_event_before_any_token_from_a_live_engine_is_its_refusal(
        probe: str, monkeypatch) -> None:  # noqa: ANN001
    """vLLM's engine checks the prompt's length itself and says so in the stream: the
    request failed with a 502 and its prompt billed. An engine not found dead refused the
    request, as its 400 before a stream would say: the client gets the 400 and the engine's
    words (context_length_exceeded at the router), no prompt billed. A busy one, whose
    request for a token waits behind its batch past the check's time-out, took the node
    out of service instead, and the request on to four more nodes to fail 'not runnable
    after 5 attempts'; a 404 to it, live enough for the heartbeat, did the same."""
    from gpusched_agent.adapters import openai_executor
    from gpusched_common.contracts import RequestResult, UsageRecord

    monkeypatch.setattr(openai_executor, "HEALTH_TIMEOUT_S", 0.05)
    server = ErrorInStream(TOO_LONG, "[DONE]", probe=probe)
    sent, runtime = make_runtime(server.executor())
    await place(runtime, job("long", max_tokens=6, prompt="x" * 400).request)
    assert not [m for m in sent if isinstance(m, InferenceRequest)]
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.engine_status_code, result.prompt_tokens) == ("failed", 400, 0)
    assert result.finish_reason == ("inference server answered 400: The decoder prompt (length "
                                    "9000) is longer than the maximum model length of 8192. Make "
                                    "sure that `max_model_len` is no smaller than the number of "
                                    "text tokens.")
    assert sum(u.prompt_tokens for u in sent if isinstance(u, UsageRecord)) == 0
    assert runtime.node.down is None and server.probes == 1
    await runtime._check_engine()
    assert runtime.node.down is None
    assert server.probes == 1  # nothing to probe: the engine is up
    await runtime.executor.close()


@pytest.mark.parametrize("event,probe", [
    (TOO_LONG, "500"), (TOO_LONG, "gone"), (ENGINE_DEAD, "token"),
], ids=["probe-500", "probe-unreachable", "engine-dead-words"])
async def test_an_error_event_before_any_token_from_a_dead_engine_is_no_refusal(
        event: str, probe: str) -> None:
    """A refusal's status in the stream is vLLM's engine dying too: where its words say so,
    or the request for a token finds the engine gone, the request goes on elsewhere and the
    node waits for its engine."""
    from gpusched_common.contracts import RequestResult

    server = ErrorInStream(event, "[DONE]", probe=probe)
    sent, runtime = make_runtime(server.executor())
    await place(runtime, job("r", max_tokens=6).request)
    assert not [m for m in sent if isinstance(m, RequestResult)]
    [again] = [m for m in sent if isinstance(m, InferenceRequest)]
    assert (again.requeued, again.refused) == ("node_lost", 1)
    assert (runtime.node.down or "").startswith(
        "inference server at http://engine failed the request in its stream: ")
    assert server.probes == (event != ENGINE_DEAD)  # its words are enough
    await runtime.executor.close()


@pytest.mark.parametrize("body,probe,back", [
    ('{"message": "EngineCore encountered an issue."}', "token", True),  # in vLLM's words
    ('{"message": "tokenizer crashed on this prompt"}', "token", False),  # this request's
    ("", "500", False),  # a path that fails whatever it is asked (a chat template raising)
], ids=["dead-engine-words", "request-fault", "path-fault"])
async def test_a_500_instead_of_a_stream_is_the_engine_failing_where_it_says_so(
        body: str, probe: str, back: bool) -> None:
    """A dead vLLM answers new requests 500 while its /v1/models still answers: each such
    request failed for good, unbilled, and the node took more to fail the same way. Where
    vLLM's words say its engine died, the request goes on elsewhere and the node waits for
    a token; any other 500 is the request's fault, as before (judged by a request for one
    token on the same path, one that fails whatever it is asked took the node down for
    good)."""
    import httpx

    from gpusched_common.contracts import RequestResult

    server = ErrorInStream(probe=probe)

    async def answer(request):  # noqa: ANN001, ANN202
        if request.url.path != "/v1/models" and json.loads(request.content)["stream"]:
            return httpx.Response(500, content=body)
        return await server(request)

    executor = OpenAIExecutor("http://engine", client=httpx.AsyncClient(
        base_url="http://engine", transport=httpx.MockTransport(answer)))
    sent, runtime = make_runtime(executor)
    await place(runtime, job("r", max_tokens=6).request)
    handed = [m for m in sent if isinstance(m, InferenceRequest)]
    results = [m for m in sent if isinstance(m, RequestResult)]
    assert (len(handed), len(results)) == ((1, 0) if back else (0, 1))
    assert (runtime.node.down is not None) == back
    if not back:
        assert results[0].status == "failed" and results[0].prompt_tokens == 0
    await executor.close()


async def test_a_health_check_asked_before_a_fault_does_not_clear_it() -> None:
    """A heartbeat's check that the engine answered before a request found it gone cleared
    the mark once it returned, and the node took work for a dead engine."""
    engine_ = Engine()
    executor = engine_.executor()
    answered, release = asyncio.Event(), asyncio.Event()
    health = executor.health

    async def slow_health() -> str | None:
        answer = await health()  # the engine is up when asked ...
        answered.set()
        await release.wait()  # ... and the answer takes its time to come back
        return answer

    executor.health = slow_health  # type: ignore[method-assign]
    sent, runtime = make_runtime(executor)
    check = asyncio.create_task(runtime._check_engine())
    await answered.wait()
    engine_.mode = "down"
    await place(runtime, job("a", max_tokens=3).request)
    release.set()
    await check
    assert runtime.node.down is not None and "unreachable" in runtime.node.down
    engine_.mode = "up"
    executor.health = health  # type: ignore[method-assign]
    await runtime._check_engine()  # asked after the fault: it clears it
    assert runtime.node.down is None
    await executor.close()


async def test_a_token_no_record_can_hold_is_made_writable_whatever_the_executor() -> None:
    """A lone surrogate from any executor made every record of its request unwritable:
    the agent tried to publish its result forever."""
    from gpusched_agent.adapters.executor import Job as ExecutorJob
    from gpusched_common.contracts import RequestResult

    class Surrogates(SimulatedExecutor):
        def generate(self, job: ExecutorJob):  # noqa: ANN201
            async def tokens():  # noqa: ANN202
                for token in (" a", "\ud800", " b"):
                    yield token
            return tokens()

    executor = Surrogates(time_scale=0.001, seed=0)
    sent, _ = await run_on(executor, job("s", max_tokens=3).request)
    for message in sent:
        message.to_bytes()
    [result] = [m for m in sent if isinstance(m, RequestResult)]
    assert (result.status, result.text) == ("completed", " a? b")
    await executor.close()


async def test_unloading_a_model_ends_the_requests_decoding_on_it() -> None:
    """Unloading (or closing) a model while requests still decode on it ends them with an
    ExecutorError. Before, the batch's loop was cancelled under them and their consumers
    waited for the next token forever."""
    from gpusched_agent.adapters.torch_executor import TorchExecutor
    from gpusched_agent.adapters.torch_model import TinyConfig

    ex = TorchExecutor("cpu", seed=1, config=TinyConfig(dim=64, layers=2), threads=1)
    await ex.load(SMALL, 0)
    got: list[str] = []

    async def consume() -> None:
        async for token in ex.generate(job("long", max_tokens=4000)):
            got.append(token)

    consumer = asyncio.create_task(consume())
    async with asyncio.timeout(10):
        while len(got) < 3:
            await asyncio.sleep(0.001)
    await ex.unload(SMALL.name, 0)
    with pytest.raises(ExecutorError, match="unloaded"):
        async with asyncio.timeout(5):
            await consumer
    await ex.close()


async def test_a_load_while_the_same_model_unloads_leaves_it_loaded() -> None:
    """A load that comes while an unload of the same model awaits its batch finds the model
    gone and loads it again. Before, the unload removed the model only after that await:
    the load returned at once for a model about to go, and every later request for it on
    that GPU failed 'not loaded'."""
    from gpusched_agent.adapters.torch_executor import TorchExecutor
    from gpusched_agent.adapters.torch_model import TinyConfig

    ex = TorchExecutor("cpu", seed=1, config=TinyConfig(dim=64, layers=2), threads=1)
    await ex.load(SMALL, 0)
    stream = ex.generate(job("running", max_tokens=4000))
    await anext(stream)  # the batch's loop is decoding
    await asyncio.gather(ex.unload(SMALL.name, 0), ex.load(SMALL, 0))
    with contextlib.suppress(ExecutorError):
        await stream.aclose()
    assert len(await collect(ex.generate(job("after", max_tokens=3)))) == 3
    await ex.close()


async def test_a_step_with_logits_that_are_not_finite_fails_alone_and_the_rest_keep_their_draws(
        torch_executor) -> None:
    """A sequence whose logits come out NaN fails alone, and the batch's other sequences
    draw exactly the tokens they draw without it: the step is checked before any of them
    draws from its generator, so running it again in halves draws the same. Before, the
    sequences sampled ahead of the bad one had drawn already and drew again."""
    await torch_executor.load(SMALL, 2)
    prompts = {"a": "alpha", "b": "bravo bravo", "c": "charlie"}

    def jobs(tag: str) -> list[Job]:
        return [job(f"{k}{tag}", max_tokens=8, seed=i, prompt=p, gpu=2)
                for i, (k, p) in enumerate(prompts.items())]

    alone = await asyncio.gather(*(collect(torch_executor.generate(j)) for j in jobs("1")))
    lm = torch_executor._models[(2, SMALL.name)]
    decode, fired = lm.decode, []

    def poisoned(tokens, positions, caches):  # noqa: ANN001, ANN202
        logits = decode(tokens, positions, caches)
        if len(tokens) == 3 and not fired:  # from the first step with all three in, the
            fired.append(caches[1])  # second sequence's logits are NaN
        bad = [i for i, cache in enumerate(caches) if fired and cache is fired[0]]
        if bad:
            logits = logits.clone()  # an inference tensor takes no writes out here
            logits[bad[0]] = float("nan")
        return logits

    lm.decode = poisoned
    try:
        again = await asyncio.gather(*(collect(torch_executor.generate(j)) for j in jobs("2")),
                                     return_exceptions=True)
    finally:
        del lm.decode
    assert fired
    assert isinstance(again[1], ExecutorError) and "not finite" in str(again[1])
    assert again[0] == alone[0] and again[2] == alone[2]


async def test_a_requests_kv_cache_is_made_off_the_event_loop(torch_executor) -> None:
    """The KV cache (prompt + max_tokens positions, zeroed) is made in the prefill's worker
    thread. Before, generate() made it on the event loop: about 27 ms for 8,192 positions
    on a CPU, so a burst of requests held heartbeats and token streams."""
    import threading

    await torch_executor.load(SMALL, 3)
    lm = torch_executor._models[(3, SMALL.name)]
    new_cache, threads = lm.new_cache, []

    def recording(capacity: int):  # noqa: ANN202
        threads.append(threading.current_thread())
        return new_cache(capacity)

    lm.new_cache = recording
    try:
        assert len(await collect(torch_executor.generate(job("kv", max_tokens=4, gpu=3)))) == 4
    finally:
        del lm.new_cache
    assert threads and threading.main_thread() not in threads


async def test_evicting_a_single_copy_beside_a_gangs_shard_unloads_it_in_the_executor() -> None:
    """A model held whole on GPU 1 and as a shard of a gang on GPUs (0, 1): the executor
    keeps the gang's copy under GPU 0, its first. Evicting the whole copy on GPU 1 unloads
    it in the executor. Before, the shard on GPU 1 counted as holding it there, so the
    executor kept the copy the node model had freed."""
    from gpusched_agent.adapters.ledger import MemoryLedger
    from gpusched_agent.adapters.torch_executor import TorchExecutor
    from gpusched_agent.adapters.torch_model import TinyConfig
    from gpusched_agent.domain.inventory import parse_simulated
    from gpusched_agent.domain.node import NodeModel
    from gpusched_agent.runtime import AgentRuntime
    from gpusched_common.contracts import Placement

    ex = TorchExecutor("cpu", seed=1, config=TinyConfig(dim=64, layers=2), threads=1)

    async def publish(message, topic, key, wait=True) -> None:  # noqa: ANN001
        pass

    runtime = AgentRuntime("n", NodeModel.from_inventory(parse_simulated("2xL4-24GB", "n")),
                           CATALOG, ex, publish, MemoryLedger(), lambda: 0, chunk_tokens=4,
                           heartbeat_s=1)

    async def place_on(request: InferenceRequest, gpus: tuple[int, ...], kv: int = 1) -> None:
        await runtime.command(Placement(
            placement_id=f"{request.request_id}#0", node_id="n", gpu_indices=gpus,
            kv_cache_mib=kv, scheduler_epoch=0, placed_at_ms=0, request=request))
        async with asyncio.timeout(30):
            while runtime.in_flight:
                await asyncio.sleep(0.01)

    other = CATALOG.get("mistral-7b")
    await place_on(job("whole", 3).request, (1,))
    await place_on(job("gang", 3).request.model_copy(update={"num_gpus": 2}), (0, 1))
    assert {(1, SMALL.name), (0, SMALL.name)} <= set(ex._models)
    await place_on(job("other", 3).request.model_copy(update={"model": other.name}), (1,),
                   kv=5000)  # room for it only without the whole copy on GPU 1
    assert SMALL.name not in runtime.node.gpus[1].loaded_mib
    assert (1, SMALL.name) not in ex._models and (0, SMALL.name) in ex._models
    await ex.close()


def listing(*models: str, override: str | None = None) -> OpenAIExecutor:
    """An executor whose engine lists `models` on /v1/models (and streams nothing)."""
    import httpx

    return OpenAIExecutor("http://engine", override, client=httpx.AsyncClient(
        base_url="http://engine", transport=httpx.MockTransport(lambda _: httpx.Response(
            200, json={"object": "list", "data": [{"id": m} for m in models]}))))


async def test_a_node_reports_the_models_it_serves_and_hands_back_the_others() -> None:
    """The scheduler placed any catalog model on any node: one whose engine serves some
    alone failed the rest (a 404, a 502 to the client) while it stayed ready. GPUSCHED_MODELS
    (here on the simulated executor) is reported, and a placement of another model, made
    on an older view of the node, is handed back as one this node could not run."""
    from gpusched_agent.adapters.ledger import MemoryLedger
    from gpusched_agent.domain.inventory import parse_simulated
    from gpusched_agent.domain.node import NodeModel
    from gpusched_agent.runtime import AgentRuntime
    from gpusched_common.contracts import NodeState

    sent: list = []

    async def publish(message, topic, key, wait=True) -> None:  # noqa: ANN001
        sent.append(message)

    runtime = AgentRuntime(
        "n", NodeModel.from_inventory(parse_simulated("1xL4-24GB", "n")), CATALOG,
        SimulatedExecutor(0.01, seed=1), publish, MemoryLedger(), lambda: 0, chunk_tokens=4,
        heartbeat_s=1, models=(SMALL.name,))
    await runtime.report()
    [state] = [m for m in sent if isinstance(m, NodeState)]
    assert state.models == (SMALL.name,)
    assert b'"models":["qwen2.5-1.5b"]' in state.to_bytes()
    other = job("o").request.model_copy(update={"model": "mistral-7b"})
    await place(runtime, other)
    [again] = [m for m in sent if isinstance(m, InferenceRequest)]
    assert (again.request_id, again.attempt, again.refused) == ("o", 1, 1)
    await place(runtime, job("s", max_tokens=2).request)
    assert [m.request_id for m in sent if type(m).__name__ == "RequestResult"
            and m.status == "completed"] == ["s"]


async def test_an_openai_node_serves_the_catalog_models_its_server_lists() -> None:
    """Without GPUSCHED_MODELS, an openai node serves the catalog models its server lists
    on /v1/models (the last answer, asked by the health check); with GPUSCHED_OPENAI_MODEL
    every request goes under that one name, so every model, as before. Unknown until the
    first answer: every model, as before."""
    from gpusched_common.contracts import NodeState

    sent, runtime = make_runtime(listing(SMALL.name, "some-lora", "mistral-7b"))
    assert runtime.served_models() is None
    await runtime._check_engine()
    assert runtime.served_models() == ("qwen2.5-1.5b", "mistral-7b")  # catalog order
    await runtime.report()
    assert [m for m in sent if isinstance(m, NodeState)][-1].models == (
        "qwen2.5-1.5b", "mistral-7b")
    await runtime.executor.close()
    _, runtime = make_runtime(listing(SMALL.name, override=SMALL.name))
    await runtime._check_engine()
    assert runtime.served_models() is None
    await runtime.executor.close()
    sent, runtime = make_runtime(SimulatedExecutor(0.01, seed=1))
    await runtime.report()
    assert [m for m in sent if isinstance(m, NodeState)][-1].models is None
    assert b'"models"' not in sent[-1].to_bytes()  # left out: older readers take it


async def test_an_openai_node_reports_its_models_from_its_first_report() -> None:
    """The first report went out before the first check of the engine: an openai node said
    it ran every model (and was healthy) until its next one, and work of other models was
    placed there to be handed back. A server that lists none of the catalog's names (TGI
    and llama.cpp list their own id, whatever a request asks for) leaves the node taking
    every model, with a warning to set GPUSCHED_MODELS, rather than taking none."""
    from gpusched_common.contracts import NodeState

    sent, runtime = make_runtime(listing(SMALL.name))
    reporting = asyncio.create_task(runtime.report_forever())
    try:
        async with asyncio.timeout(10):
            while not [m for m in sent if isinstance(m, NodeState)]:
                await asyncio.sleep(0.01)
        assert [m for m in sent if isinstance(m, NodeState)][0].models == (SMALL.name,)
    finally:
        reporting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporting
        await runtime.executor.close()
    _, runtime = make_runtime(listing("/models/qwen2.5-1.5b-instruct-q4.gguf"))
    await runtime._check_engine()
    assert runtime.served_models() is None
    await runtime.executor.close()


@pytest.mark.parametrize("override", ["qwen2.5-1.5b-instruct", None],
                         ids=["openai-model", "catalog-name"])
async def test_a_model_the_server_does_not_serve_goes_elsewhere_and_cools_down_here(
        override: str | None) -> None:
    """vLLM serving its model under the HF name, asked under GPUSCHED_OPENAI_MODEL's name or
    the catalog's (GPUSCHED_MODELS): every request placed there failed, a 502 "model does
    not exist", while the node stayed ready for more. Now the request goes back unbilled,
    the model is kept off the node for the load-failure cooldown, and the reason says what
    the server lists and what to set."""
    import httpx

    from gpusched_agent.adapters.executor import ExecutorLacksModel
    from gpusched_common.contracts import NodeState, RequestResult, UsageRecord

    served = "Qwen/Qwen2.5-1.5B-Instruct"

    def vllm(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": served}]})
        model = json.loads(request.content)["model"]
        return httpx.Response(404, json={
            "object": "error", "type": "NotFoundError", "param": None, "code": 404,
            "message": f"The model `{model}` does not exist."})

    executor = OpenAIExecutor("http://engine", override, client=httpx.AsyncClient(
        base_url="http://engine", transport=httpx.MockTransport(vllm)))
    sent, runtime = make_runtime(executor)
    failed: list[str] = []
    runtime._load_failed = failed.append
    await runtime._check_engine()
    with pytest.raises(ExecutorLacksModel) as raised:
        await collect(executor.generate(job("direct")))
    assert str(raised.value) == (
        f"inference server answered 404: The model `{override or SMALL.name}` does not exist. "
        f"(the inference server lists {served}: serve the model under the name sent (vLLM's "
        "--served-model-name), or set GPUSCHED_OPENAI_MODEL to the one it lists)")
    await place(runtime, job("r", prompt="x" * 40).request)
    assert not [m for m in sent if isinstance(m, RequestResult)]
    [again] = [m for m in sent if isinstance(m, InferenceRequest)]
    assert (again.attempt, again.refused, again.resume) == (1, 1, None)
    assert sum(u.prompt_tokens for u in sent if isinstance(u, UsageRecord)) == 0
    assert failed == [SMALL.name] and runtime.node.down is None
    [state] = [m for m in sent if isinstance(m, NodeState)]  # reported before the hand-back
    assert [f.model for f in state.load_failures or ()] == [SMALL.name]
    assert sent.index(state) < sent.index(again)
    await executor.close()


async def test_a_model_the_server_does_not_serve_stays_off_the_node_though_it_loads_elsewhere(
) -> None:
    """The openai executor's load does nothing and always succeeds: a placement sent before
    the scheduler knew of the 404, landing on the node's other GPU, ended the cooldown as it
    'loaded' the model, the node claimed the model again, and its own 404 started a second
    incident. Only a load that failed has its cooldown ended by one that succeeds."""
    import httpx

    asked, answer = asyncio.Event(), asyncio.Event()

    async def vllm(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "Qwen/Q"}]})
        if json.loads(request.content)["prompt"] == "slow":
            asked.set()
            await answer.wait()
        return httpx.Response(404, json={"object": "error", "code": 404,
                                         "message": f"The model `{SMALL.name}` does not exist."})

    executor = OpenAIExecutor("http://engine", SMALL.name, client=httpx.AsyncClient(
        base_url="http://engine", transport=httpx.MockTransport(vllm)))
    _, runtime = make_runtime(executor, gpus="2xL4-24GB")
    failed: list[str] = []
    runtime._load_failed = failed.append
    await place(runtime, job("first").request)
    assert [f.model for f in runtime.load_failures() or ()] == [SMALL.name]
    second = asyncio.create_task(place(runtime, job("second", prompt="slow").request, gpu=1))
    await asyncio.wait_for(asked.wait(), 10)  # loaded on GPU 1, waiting for the engine
    assert [f.model for f in runtime.load_failures() or ()] == [SMALL.name]
    answer.set()
    await second
    assert failed == [SMALL.name]  # one incident
    await executor.close()


def test_gpusched_models_must_name_catalog_models() -> None:
    from gpusched_agent.settings import AgentSettings

    assert AgentSettings(models="qwen2.5-1.5b,mistral-7b").served_models(CATALOG) == (
        "qwen2.5-1.5b", "mistral-7b")
    assert AgentSettings().served_models(CATALOG) is None
    with pytest.raises(ValueError, match="GPUSCHED_MODELS names qwen-2.5, not in the catalog"):
        AgentSettings(models="qwen2.5-1.5b,qwen-2.5").served_models(CATALOG)


async def test_an_engine_refusal_is_counted_by_model_and_status_for_operators() -> None:
    """The client gets the engine's 4xx as its own fault; a node whose engine refuses what
    the catalog allows (its --max-model-len below models.yaml's) showed nowhere."""
    calls = []
    for status, reply in ((400, {"json": VLLM_CONTEXT_400}), (500, {"text": "engine bug"})):
        sent, runtime = make_runtime(refusing(status, **reply))
        runtime._refused = lambda model, code: calls.append((model, code))
        request = job("r", prompt="x" * 40).request
        await place(runtime, request)
    assert calls == [(request.model, 400)]  # a 500 is the engine's own failure, not counted
