"""The openai-compatible executor: forwards each request to an inference server on the node
(vLLM, SGLang, TGI, llama.cpp server) over its streaming /v1/completions API, or for a chat
request /v1/chat/completions, so the engine applies the model's own chat template.

The engine does the batching and owns the memory; every streamed text delta counts as one
token (vLLM and llama.cpp stream one token per event), so billed completion tokens are the
deltas the client received. Closing the stream closes the connection: engines abort there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import httpx

from gpusched_agent.adapters.executor import ExecutorError, Job
from gpusched_common.catalog import ModelSpec


class OpenAIExecutor:
    name = "openai"
    time_scale = 1.0

    def __init__(self, base_url: str, model_override: str | None = None,
                 api_key: str | None = None, timeout_s: float = 600.0,
                 client: httpx.AsyncClient | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._model_override = model_override
        self._client = client or httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def load(self, model: ModelSpec, gpu_index: int) -> None:
        """The engine loads its own models; nothing to do."""

    async def unload(self, model_name: str, gpu_index: int) -> None:
        """The engine owns its memory; nothing to do."""

    async def generate(self, job: Job) -> AsyncGenerator[str, None]:
        request = job.request
        body: dict[str, object] = {"model": self._model_override or job.model.name,
                                   "max_tokens": request.max_tokens, "stream": True}
        body |= {k: v for k, v in (("seed", request.seed), ("temperature", request.temperature),
                                   ("top_p", request.top_p), ("stop", request.stop))
                 if v is not None}
        if request.messages is not None:  # the engine applies the model's chat template
            path = "/v1/chat/completions"
            messages = [m.model_dump() for m in request.messages]
            if job.prefix:  # vLLM's way to go on with the reply it had begun
                messages.append({"role": "assistant", "content": job.prefix})
                body |= {"continue_final_message": True, "add_generation_prompt": False}
            body["messages"] = messages
        else:
            path, body["prompt"] = "/v1/completions", request.prompt
        try:
            async with self._client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:500]
                    raise ExecutorError(f"inference server answered {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise ExecutorError(f"inference server error: {event['error']}")
                    for choice in event.get("choices") or ():
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            yield text
        except httpx.HTTPError as exc:
            raise ExecutorError(f"inference server at {self._client.base_url} unreachable or "
                                f"broke the stream: {exc!r}") from exc

    async def close(self) -> None:
        await self._client.aclose()
