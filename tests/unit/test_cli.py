"""The `gpusched` command's output for people: tables stay whole where output is piped (a CI
log or a file gets an 80-column console, and a model name cut to "llama-3.…" is no use
there), and a service that is down or refuses reads as a reason with exit status 1, not a
traceback or a raw JSON body."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from gpusched_common.contracts import MAX_QUEUE_LIST, DeadLetter
from gpusched_ops.cli import (
    app,
    console,
    dead_letter_table,
    label_problem,
    namespace_problem,
    queue_table,
    usage_table,
)

MODELS = Path(__file__).resolve().parents[2] / "config" / "models.yaml"


def _row(requests: int) -> dict:
    return {"requests": requests, "prompt_tokens": 139_800, "completion_tokens": 21_600,
            "gpu_seconds": 4.281, "cost_usd": 0.0097}


def test_usage_table_keeps_every_name_and_header_whole_at_80_columns() -> None:
    models = [m["name"] for m in yaml.safe_load(MODELS.read_text())["models"]]
    data = {"group_by": "model", "start_ms": 1_764_700_000_000, "end_ms": 1_764_700_060_000,
            "tenants": [{"tenant": tenant, "totals": _row(120),
                         "groups": [{"group": m, **_row(30)} for m in models]}
                        for tenant in ("acme", "globex", "initech")]}
    console = Console(width=80, record=True)
    console.print(usage_table(data))
    text = console.export_text()

    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    for word in (*models, "globex", "initech", "completion", "seconds", "139800", "0.0097"):
        assert word in text, word


@pytest.mark.parametrize("args", [
    ["submit", "hi", "--router-url", "http://127.0.0.1:1"],
    ["usage", "--accounting-url", "http://127.0.0.1:1"],
    ["nodes", "--scheduler-url", "http://127.0.0.1:1"],
])
def test_a_service_that_is_down_gives_a_clear_error_and_exit_1(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)

    assert result.exit_code == 1, result.output
    assert "not reachable at http://127.0.0.1:1" in result.output
    assert "is the stack up?" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command,code", [("dead-letters", 1), ("reconcile", 2)])
def test_a_command_without_kafka_says_so_on_one_line(command: str, code: int) -> None:
    """In a process of its own, where nothing has set logging up: aiokafka's own 'Unable
    connect to ...' line came first, through Python's last-resort handler."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "gpusched_ops.cli", command, "--kafka",
                             "127.0.0.1:1"], capture_output=True, text=True, timeout=60,
                            check=False)

    assert result.returncode == code, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: Kafka not reachable at 127.0.0.1:1")


@pytest.mark.parametrize("args,env,printed", [
    (["usage", "--api-key", "ключ"], {},
     "error: --api-key cannot be sent in an HTTP header: it holds 'к' (only printable ASCII"),
    (["cancel", "r-1", "--api-key", "ключ"], {}, "--api-key cannot be sent in an HTTP header"),
    (["submit", "hi", "--api-key", "ключ"], {}, "--api-key cannot be sent in an HTTP header"),
    (["submit", "hi", "--priority", "batch\r"], {}, "--priority cannot be sent in an HTTP"),
    (["usage"], {"GPUSCHED_API_KEY": "sk-admin-demo\n"},
     "error: GPUSCHED_API_KEY cannot be sent in an HTTP header: it holds '\\n'"),
    (["usage", "--api-key", " sk-admin-demo"], {}, "it holds spaces around it"),
    (["nodes", "--scheduler-url", "http://[::1"], {},
     "error: --scheduler-url 'http://[::1' is not a URL such as http://127.0.0.1:8081 "
     "(Invalid port"),
    (["submit", "hi", "--router-url", "http://[::1"], {}, "--router-url 'http://[::1' is not"),
    (["usage"], {"GPUSCHED_ACCOUNTING_URL": "127.0.0.1:8082"},
     "GPUSCHED_ACCOUNTING_URL '127.0.0.1:8082' is not a URL such as http://127.0.0.1:8082 "
     "(it needs http:// or https:// and a host)"),
    (["dead-letters", "--kafka", "localhost:notaport"], {},
     "error: --kafka takes host:port[,host:port], not 'localhost:notaport'"),
    (["nodes", "--scheduler-url", "http://127.0.0.1:8081/?x=1"], {},
     "(it can have no query (?) or fragment (#))"),
    (["monitoring-manifests", "--label", "=x"], {},
     "error: --label =x: the key's name '' is not 1 to 63 letters, digits, '-', '_' and '.', "
     "a letter or digit at each end, as Kubernetes takes labels"),
    (["monitoring-manifests", "--label", "a b=c"], {}, "the key's name 'a b' is not 1 to 63"),
    (["monitoring-manifests", "--label", "-bad=1"], {}, "the key's name '-bad' is not"),
    (["monitoring-manifests", "--label", "Example.com/team=x"], {},
     "the key's prefix 'Example.com' is not a DNS subdomain"),
    (["monitoring-manifests", "--label", "team=a b"], {}, "the value 'a b' is not at most 63"),
    (["monitoring-manifests", "--namespace", "Bad_NS"], {},
     "error: --namespace 'Bad_NS': it is not 1 to 63 lowercase letters, digits and '-', a "
     "letter or digit at each end (an RFC 1123 DNS label), as Kubernetes names namespaces"),
    (["monitoring-manifests", "--dashboard-namespace", "grafana.monitoring"], {},
     "error: --dashboard-namespace 'grafana.monitoring': it is not 1 to 63 lowercase"),
    (["monitoring-manifests", "--label", "team=a", "--label", "team=b"], {},
     "error: --label team is given twice (team=a, team=b): an object has one value per key"),
    (["monitoring-manifests", "--label", "app.kubernetes.io/part-of=other"], {},
     "error: --label app.kubernetes.io/part-of=other: the manifests set "
     "app.kubernetes.io/part-of=gpusched themselves; give another key"),
    (["monitoring-manifests", "--label", "grafana_dashboard=0"], {},
     "the manifests set grafana_dashboard=1 themselves"),
])
def test_an_option_that_cannot_be_used_is_named_on_one_line_before_anything_is_sent(
        monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str],
        printed: str) -> None:
    """A key or priority a header cannot carry (a key copied with its line end), a URL that
    is none, a Kafka address without a port: each was a traceback of dozens of lines, or
    a wrong cause ('is the stack up?', 'not an event stream'). Exit 2, as the parser's own
    refusals: 1 said the command was tried and failed."""
    def nothing_sent(*args: object, **kwargs: object) -> httpx.Response:
        raise AssertionError("sent")
    monkeypatch.setattr(httpx, "get", nothing_sent)
    monkeypatch.setattr(httpx, "post", nothing_sent)

    result = CliRunner().invoke(app, args, env=env)

    assert result.exit_code == 2, result.output
    assert [printed in line for line in result.stderr.splitlines()] == [True], result.stderr
    assert result.stdout == ""


def test_an_error_page_of_another_server_is_one_line_that_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another program on the scheduler's port answered with its HTML page: it was printed
    whole, dozens of lines."""
    page = ("<!DOCTYPE HTML>\n<html lang=\"en\">\n    <head>\n<title>Error response</title>\n"
            "    </head>\n    <body>\n<p>Error code: 404</p>\n" + "<p>x</p>\n" * 20)
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(
        404, text=page, headers={"content-type": "text/html"}))

    result = CliRunner().invoke(app, ["nodes", "--scheduler-url", "http://127.0.0.1:1"])

    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        "error: 404 from http://127.0.0.1:1/v1/cluster, not an answer of scheduler's API (a "
        "proxy's, or another program's on that port?): <!DOCTYPE HTML>"]


def test_dead_letters_print_every_field_uncut_in_80_columns() -> None:
    letter = DeadLetter(source_topic="gpusched.requests.standard", partition=2, offset=1234567,
                        key="kafka-gpusched.requests.standard-2-1234567", payload="{oops",
                        reason="not valid JSON: EOF while parsing an object at line 1 column 5",
                        service="scheduler", at_ms=1_764_000_000_000)
    console = Console(width=80, record=True)
    console.print(dead_letter_table([letter]))
    text = console.export_text()

    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    for word in ("2025-11-24", "scheduler", "1234567", "EOF", "column"):
        assert word in text, word


def test_reconcile_without_kafka_says_so_and_exits_2() -> None:
    result = CliRunner().invoke(app, ["reconcile", "--kafka", "127.0.0.1:1"])

    assert result.exit_code == 2, result.output  # 1 means "totals differ"
    assert "Kafka not reachable at 127.0.0.1:1; is the stack up?" in result.output



def test_queue_limit_past_what_the_scheduler_lists_is_a_usage_error() -> None:
    """--limit 20000 passed the parser, then failed on the scheduler's validation with exit 1
    (no usage hint), against the README's exit 2 for a value the parser cannot take."""
    result = CliRunner().invoke(app, ["queue", "--limit", str(MAX_QUEUE_LIST + 1),
                                      "--scheduler-url", "http://127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert "--limit" in result.output


def test_queue_table_shows_each_waiting_request_in_line() -> None:
    """Whole on a terminal of 120 columns (ids to copy into a cancel); folded, never cut, on
    a pipe's 80."""
    row = {"position": 1, "request_id": "req-0123456789abcdef0123456789abcdef",
           "tenant": "initech", "priority_class": "batch", "chunk": "aged",
           "model": "llama-3.1-8b", "num_gpus": 2, "attempt": 1, "requeued": "preempted",
           "waited_ms": 312_400, "max_queue_ms": 600_000}
    data = {"requests": [row, {**row, "position": 2, "chunk": "batch", "max_queue_ms": None,
                               "attempt": 0, "requeued": None}]}
    wide = Console(width=120, record=True)
    wide.print(queue_table(data))
    text = wide.export_text()
    for word in (row["request_id"], "initech", "batch (aged)", "llama-3.1-8b x2", "312.4",
                 "600", "preempted"):
        assert word in text, word
    narrow = Console(width=80, record=True)
    narrow.print(queue_table(data))
    text = narrow.export_text()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())


def test_submit_whose_stream_ends_in_an_error_prints_the_reason_and_exits_1() -> None:
    """Also: --priority and --max-queue-ms reach the router as its headers."""
    heard: list[dict[str, str]] = []

    class Router(BaseHTTPRequestHandler):  # streams one chunk, then the error event
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            heard.append({k.lower(): v for k, v in self.headers.items()})
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": " half", "finish_reason": None}]}
            error = {"error": {"message": "request r failed on node n1: executor error: boom",
                               "type": "server_error", "param": None, "code": 502}}
            for event in (chunk, error):
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = CliRunner().invoke(app, [
            "submit", "hi", "--priority", "batch", "--max-queue-ms", "1500", "--router-url",
            f"http://127.0.0.1:{server.server_port}"])
    finally:
        server.shutdown()

    assert result.exit_code == 1, result.output
    [headers] = heard
    assert (headers["x-priority-class"], headers["x-max-queue-ms"]) == ("batch", "1500")
    assert " half" in result.output and "executor error: boom" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("response,printed", [
    (httpx.Response(400, json={"detail": "start (5) must be before end (1)"}),
     "error: 400: start (5) must be before end (1)"),
    (httpx.Response(422, json={"detail": [{"loc": ["query", "group_by"],
                                           "msg": "Input should be 'model'"}]}),
     "error: 422: group_by: Input should be 'model'"),
    (httpx.Response(502, text="Bad Gateway"), "error: 502 from http://127.0.0.1:8082/v1/usage, "
     "not an answer of accounting's API (a proxy's, or another program's on that port?): "
     "Bad Gateway"),
])
def test_usage_refused_by_accounting_prints_the_reason_and_exits_1(
        monkeypatch: pytest.MonkeyPatch, response: httpx.Response, printed: str) -> None:
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: response)

    result = CliRunner().invoke(app, ["usage"])

    assert result.exit_code == 1, result.output
    assert printed in result.output


@pytest.mark.parametrize("response,code,printed", [
    (httpx.Response(202, json={"status": "cancelling"}), 0, "cancelling req-1"),
    (httpx.Response(409, json={"error": {"message": "request 'req-1' has ended already: "
                                         "completed", "code": "request_ended"}}),
     1, "error: 409: request 'req-1' has ended already: completed"),
    (httpx.Response(404, json={"error": {"message": "request 'req-1' is unknown (or "
                                         "expired)"}}), 1, "is unknown (or expired)"),
])
def test_cancel_asks_the_router_and_prints_its_answer(
        monkeypatch: pytest.MonkeyPatch, response: httpx.Response, code: int,
        printed: str) -> None:
    asked: list[tuple[str, dict]] = []

    def post(url: str, **kwargs: object) -> httpx.Response:
        asked.append((url, kwargs["headers"]))
        return response
    monkeypatch.setattr(httpx, "post", post)

    result = CliRunner().invoke(app, ["cancel", "req-1", "--api-key", "sk-globex-demo"])

    assert result.exit_code == code, result.output
    assert printed in result.output.replace("\n", "")
    assert asked == [("http://127.0.0.1:8080/v1/requests/req-1/cancel",
                      {"Authorization": "Bearer sk-globex-demo"})]


@pytest.mark.parametrize("request_id,printed", [
    ("", "'' is no request id (String should have at least 1 character): give its "
     "x-request-id, or the id a 504 or `gpusched queue` names"),
    ("a/b", "'a/b' is no request id (String should match pattern '^[A-Za-z0-9._:@-]+$')"),
    ("a/b?c", "(String should match pattern '^[A-Za-z0-9._:@-]+$')"),
    (" ", "(String should match pattern '^[A-Za-z0-9._:@-]+$')"),
    ("x" * 129, "(String should have at most 128 characters)"),
])
def test_cancel_of_an_id_no_request_can_have_is_refused_naming_what_ids_are(
        monkeypatch: pytest.MonkeyPatch, request_id: str, printed: str) -> None:
    """An id the contracts cannot hold ('a/b', a space, 129 characters) was asked of the
    router, which answered a bare '404: Not Found' (an empty one said an id was needed):
    refused before anything is sent, naming the characters ids are made of."""
    def nothing_sent(*args: object, **kwargs: object) -> httpx.Response:
        raise AssertionError("sent")
    monkeypatch.setattr(httpx, "post", nothing_sent)

    result = CliRunner().invoke(app, ["cancel", request_id])

    assert result.exit_code == 2, result.output
    assert [printed in line for line in result.stderr.splitlines()] == [True], result.stderr


def test_cancel_sends_an_id_of_every_character_ids_may_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def post(url: str, **kwargs: object) -> httpx.Response:
        asked.append(url.removeprefix("http://127.0.0.1:8080"))
        return httpx.Response(202, json={"status": "cancelling"})
    monkeypatch.setattr(httpx, "post", post)

    result = CliRunner().invoke(app, ["cancel", "Aa0._:@-"])

    assert result.exit_code == 0, result.output
    assert asked == ["/v1/requests/Aa0._%3A%40-/cancel"]


@pytest.mark.parametrize("request_id", [".", ".."])
def test_cancel_of_a_dot_id_reaches_the_routers_cancel_route(
        monkeypatch: pytest.MonkeyPatch, request_id: str) -> None:
    """httpx resolves a '.' or '..' segment as a folder: `cancel ..` asked for /v1/cancel and
    printed the router's bare '404: Not Found'. Asked of the router's own app."""
    import asyncio

    from gpusched_common.settings import TelemetrySettings
    from gpusched_router import main as router_main
    from gpusched_router.adapters.results import STATUS_KEY
    from gpusched_router.settings import RouterSettings

    read: list[str] = []

    class NoStatuses:  # Redis as the cancel route reads it: no request is known
        def register_script(self, script: str) -> None:
            return None

        async def hgetall(self, key: str) -> dict:
            read.append(key)
            return {}

        async def aclose(self) -> None:
            return None

    monkeypatch.setattr(router_main, "make_redis", lambda settings: NoStatuses())
    router = router_main.create_app(RouterSettings(
        telemetry=TelemetrySettings(otlp_endpoint="")))

    def post(url: str, **kwargs: Any) -> httpx.Response:
        async def ask() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(router)) as client:
                return await client.post(url, **kwargs)
        return asyncio.run(ask())
    monkeypatch.setattr(httpx, "post", post)

    result = CliRunner().invoke(app, ["cancel", request_id])

    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        f"error: 404: request '{request_id}' is unknown (or expired)"]
    assert read == [STATUS_KEY.format(request_id)]


def test_usage_of_an_empty_tenant_asks_for_it_not_for_every_tenant(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--tenant '' was left out of the query: it printed every tenant's usage."""
    asked: list[object] = []

    def get(url: str, **kwargs: object) -> httpx.Response:
        asked.append(kwargs["params"])
        return httpx.Response(404, json={"detail": "no tenant '': it is not configured and "
                                                   "has no usage; tenants: acme"})
    monkeypatch.setattr(httpx, "get", get)

    result = CliRunner().invoke(app, ["usage", "--tenant", ""])

    assert result.exit_code == 1, result.output
    assert "error: 404: no tenant '': it is not configured" in result.output
    assert asked == [{"group_by": "model", "tenant": ""}]


@pytest.mark.parametrize("key,value,refused", [
    ("release", "kube-prometheus-stack", False),
    ("app.kubernetes.io/name", "router", False),
    ("team", "", False),
    ("a" * 63, "A_b.c-" + "d" * 57, False),
    ("a" * 64, "x", True),
    ("team", "x" * 64, True),
    ("example.com/", "x", True),
    ("/team", "x", True),
    ("a/b/c", "x", True),
    ("team", "-x", True),
    ("team_", "x", True),
])
def test_labels_follow_kubernetes_rules(key: str, value: str, refused: bool) -> None:
    """Labels Kubernetes refuses made manifests that `kubectl apply` refused whole."""
    assert (label_problem(key, value) is not None) == refused


@pytest.mark.parametrize("name,refused", [
    ("gpusched", False),
    ("kube-prometheus-stack", False),
    ("0", False),
    ("a" * 63, False),
    ("a" * 64, True),
    ("", True),
    ("Bad_NS", True),
    ("Monitoring", True),
    ("grafana.monitoring", True),
    ("-x", True),
    ("x-", True),
    ("x\n", True),
])
def test_namespaces_follow_kubernetes_rules(name: str, refused: bool) -> None:
    """A namespace is an RFC 1123 DNS label: `--namespace Bad_NS` printed manifests, with
    exit 0, that `kubectl apply` refused whole."""
    assert (namespace_problem(name) is not None) == refused


def test_nodes_marks_the_models_a_gpu_keeps_loaded_but_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = {"index": 0, "gpu_type": "L4-24GB", "memory_free_mib": 4774,
           "memory_total_mib": 23034, "running_requests": 1,
           "loaded_models": ["qwen2.5-1.5b", "llama-3.1-8b"], "idle_models": ["qwen2.5-1.5b"]}
    cluster = {"nodes": [{"node_id": "n1", "status": "ready", "gpus": [gpu]}],
               "pending": {}, "reservations": 0}
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(200, json=cluster))
    monkeypatch.setattr(console, "width", 160)  # one line per GPU

    result = CliRunner().invoke(app, ["nodes"])

    assert result.exit_code == 0, result.output
    assert "qwen2.5-1.5b (idle)" in result.output and "llama-3.1-8b (idle)" not in result.output


def _serve(answer: Callable[[BaseHTTPRequestHandler], None], heard: list[str]
           ) -> ThreadingHTTPServer:
    """A router on a free port that notes the path of each POST, reads its body, and leaves
    the answer to `answer`."""

    class Router(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked answers

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            heard.append(self.path)
            self.rfile.read(int(self.headers["content-length"]))
            answer(self)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _router(reply: list[bytes], heard: list[str], hang_s: float = 0.0
            ) -> ThreadingHTTPServer:
    """A router on a free port that answers each POST 200 with `reply` as its event stream
    (after `hang_s` of silence), and ends the connection there, [DONE] or not."""
    import time

    def answer(handler: BaseHTTPRequestHandler) -> None:
        time.sleep(hang_s)
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        handler.send_header("connection", "close")
        handler.end_headers()
        for event in reply:
            handler.wfile.write(event)
        handler.close_connection = True

    return _serve(answer, heard)


def _chunk(text: str, finish: str | None = None) -> bytes:
    return ("data: " + json.dumps({
        "id": "c", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}]}) + "\n\n").encode()


@pytest.mark.parametrize("reply,hang_s,printed", [
    ([_chunk(" half")], 0.0, "ended after 1 chunks without a finish reason: the reply is "
     "cut short; the request was sent and may still run, and be billed"),
    ([_chunk(" half"), b"data: {not json\n\n"], 0.0,
     "router answered with something that is not its API (JSONDecodeError("),
    ([], 3.0, "no answer from router at http://127.0.0.1:"),
])
def test_submit_says_when_a_reply_is_cut_short_and_sends_it_once(
        reply: list[bytes], hang_s: float, printed: str) -> None:
    """A stream that ends without a finish reason (a proxy dropping the connection) exits
    1 instead of 0 with half a reply; one that is not events exits 1 with the reason instead
    of a traceback; a router that says nothing for --timeout gives up once. Before, the
    OpenAI SDK's defaults waited 600 s and then sent the completion again, twice: three
    runs of it, billed three times."""
    heard: list[str] = []
    server = _router(reply, heard, hang_s)
    try:
        result = CliRunner().invoke(app, [
            "submit", "hi", "--timeout", "1", "--router-url",
            f"http://127.0.0.1:{server.server_port}"])
    finally:
        server.shutdown()

    assert result.exit_code == 1, result.output
    assert printed in result.output and "Traceback" not in result.output
    assert heard == ["/v1/completions"]
    if reply:
        assert " half\n" in result.output  # the error on a line of its own


def test_submit_of_a_whole_reply_exits_0() -> None:
    heard: list[str] = []
    server = _router([_chunk(" whole"), _chunk("", "stop"), b"data: [DONE]\n\n"], heard)
    try:
        result = CliRunner().invoke(app, ["submit", "hi", "--router-url",
                                          f"http://127.0.0.1:{server.server_port}"])
    finally:
        server.shutdown()

    assert result.exit_code == 0, result.output
    assert result.stdout == " whole\n"


@pytest.mark.parametrize("ending", ["/", "/v1", "/v1/"])
def test_a_service_url_with_a_trailing_slash_a_v1_or_a_path_asks_for_the_apis_paths(
        monkeypatch: pytest.MonkeyPatch, ending: str) -> None:
    """`--router-url http://host:8080/` asked for //v1/completions, and `.../v1`, as OpenAI
    clients write a base URL, for /v1/v1/completions: every command failed with a bare
    '404: Not Found'. The slash and the /v1 are dropped, as the agent drops them from
    GPUSCHED_OPENAI_BASE_URL; a path before them (a proxy's prefix) is kept."""
    heard: list[str] = []
    server = _router([_chunk(" whole", "stop"), b"data: [DONE]\n\n"], heard)
    try:
        for url in (f"http://127.0.0.1:{server.server_port}{ending}",
                    f"http://127.0.0.1:{server.server_port}/gpusched{ending}/"):
            result = CliRunner().invoke(app, ["submit", "hi", "--router-url", url])
            assert result.exit_code == 0, result.output
    finally:
        server.shutdown()
    assert heard == ["/v1/completions", "/gpusched/v1/completions"]

    asked: list[str] = []

    def get(url: str, **kwargs: object) -> httpx.Response:
        asked.append(url)
        return httpx.Response(200, json={"nodes": [], "pending": {}, "reservations": 0,
                                         "group_by": "model", "start_ms": 0, "end_ms": 0,
                                         "tenants": []})
    monkeypatch.setattr(httpx, "get", get)
    for args in (["nodes", "--scheduler-url", f"http://127.0.0.1:8081{ending}"],
                 ["usage", "--accounting-url", f"http://proxy/accounting{ending}"]):
        assert CliRunner().invoke(app, args).exit_code == 0
    assert CliRunner().invoke(app, ["nodes"], env={
        "GPUSCHED_SCHEDULER_URL": f"http://127.0.0.1:8081{ending}"}).exit_code == 0
    assert asked == ["http://127.0.0.1:8081/v1/cluster",
                     "http://proxy/accounting/v1/usage",
                     "http://127.0.0.1:8081/v1/cluster"]


def _cut_after(body: bytes, request_id: str | None) -> Callable[[BaseHTTPRequestHandler],
                                                                 None]:
    """An answer that breaks off: 200 and its headers (with `request_id` as x-request-id)
    and `body` as a first chunk, then the connection ends, as when the router restarts
    midway. With no request id, the connection ends before any answer."""
    def answer(handler: BaseHTTPRequestHandler) -> None:
        if request_id is not None:
            handler.send_response(200)
            handler.send_header("x-request-id", request_id)
            handler.send_header("content-type", "application/json" if body.startswith(b"{")
                                else "text/event-stream")
            handler.send_header("transfer-encoding", "chunked")
            handler.end_headers()
            handler.wfile.write(f"{len(body):x}\r\n".encode() + body + b"\r\n")
            handler.wfile.flush()
        handler.close_connection = True
        handler.connection.shutdown(socket.SHUT_RDWR)
    return answer


@pytest.mark.parametrize("args,answer,printed", [
    ([], _cut_after(_chunk(" half"), "req-7"), "request req-7 was sent and may still run, "
     "and be billed: GET /v1/requests/req-7 on the router shows how it ends, `gpusched "
     "cancel req-7` stops it; submitting it again runs it twice"),
    (["--json"], _cut_after(b'{"id": "c", "object": ', "req-7"), "request req-7 was sent"),
    (["--json"], _cut_after(b"", None), "the request was sent and may still run, and be "
     "billed: `gpusched queue` shows its id while it waits for a GPU"),
])
def test_submit_whose_reply_breaks_off_says_the_request_was_sent_not_unreachable(
        args: list[str], answer: Callable[[BaseHTTPRequestHandler], None],
        printed: str) -> None:
    """It said 'router not reachable ...; is the stack up?' of a request the router had
    taken, which ran and was billed: the operator sent it again, and it ran twice."""
    heard: list[str] = []
    server = _serve(answer, heard)
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        result = CliRunner().invoke(app, ["submit", "hi", *args, "--router-url", url])
    finally:
        server.shutdown()

    assert result.exit_code == 1, result.output
    [error] = result.stderr.splitlines()
    assert error.startswith(f"error: no whole answer from router at {url} (")
    assert printed in error and "not reachable" not in error
    assert heard == ["/v1/completions"]
    if not args:
        assert result.stdout == " half\n"


@pytest.mark.parametrize("args,printed", [
    (["nodes", "--scheduler-url", "http://127.0.0.1:1"],
     "error: no answer from scheduler at http://127.0.0.1:1 within 5 s"),
    (["cancel", "req-7", "--router-url", "http://127.0.0.1:1"],
     "error: no answer from router at http://127.0.0.1:1 within 30 s; it was sent, and may "
     "have been carried out"),
])
def test_a_service_that_does_not_answer_in_time_is_not_called_unreachable(
        monkeypatch: pytest.MonkeyPatch, args: list[str], printed: str) -> None:
    """A hung service read 'not reachable ... (timed out); is the stack up?'."""
    def hung(url: str, **kwargs: object) -> httpx.Response:
        raise httpx.ReadTimeout("timed out")
    monkeypatch.setattr(httpx, "get", hung)
    monkeypatch.setattr(httpx, "post", hung)

    result = CliRunner().invoke(app, args)

    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [printed]


@pytest.mark.parametrize("cluster,args,shown", [
    ("not json", ["--json"], "answered /v1/cluster with something that is not JSON"),
    ({}, [], "scheduler answered with something that is not its API (KeyError('nodes'))"),
])
def test_an_answer_that_is_not_the_services_api_is_a_one_line_error(
        monkeypatch: pytest.MonkeyPatch, cluster: object, args: list[str], shown: str) -> None:
    reply = httpx.Response(200, text=cluster) if isinstance(cluster, str) else \
        httpx.Response(200, json=cluster)
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: reply)

    result = CliRunner().invoke(app, ["nodes", *args])

    assert result.exit_code == 1 and shown in result.stderr and "Traceback" not in result.output
    assert result.stdout == ""  # `nodes --json > file` gets no error text in its JSON


_TOTALS = {"requests": 1, "prompt_tokens": 1, "completion_tokens": 1, "gpu_seconds": 1.0,
           "cost_usd": 0.1}


@pytest.mark.parametrize("usage,shown", [
    ({"start_ms": 0, "end_ms": 1, "tenants": [
        {"tenant": "acme", "totals": {**_TOTALS, "gpu_seconds": "1.0"}}]},
     "(ValueError(\"Unknown format code 'f'"),
    ({"start_ms": 10**20, "end_ms": 1, "tenants": []}, "(OverflowError("),
])
def test_usage_whose_numbers_are_not_the_apis_is_a_one_line_error(
        monkeypatch: pytest.MonkeyPatch, usage: dict, shown: str) -> None:
    """A number as text, or a time no calendar has: a ValueError or OSError traceback."""
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(200, json=usage))

    result = CliRunner().invoke(app, ["usage"])

    assert result.exit_code == 1, result.output
    [error] = result.stderr.splitlines()
    assert error.startswith("error: accounting answered with something that is not its API")
    assert shown in error


@pytest.mark.parametrize("args,reply,shown", [
    ([], [_chunk(" half"), b"data: 42\n\n"], "AttributeError(\"'int' object has no"),
    ([], [_chunk(" half"), b'data: {"choices": [{}]}\n\n'], "TypeError("),
    (["--json"], [b'{}'], "TypeError('choices is None, not a list')"),
])
def test_submit_of_a_reply_that_is_not_a_completion_is_a_one_line_error(
        args: list[str], reply: list[bytes], shown: str) -> None:
    """An event that is JSON but no completion chunk was a traceback; a whole reply of `{}`
    printed a completion of nulls and exited 0."""
    heard: list[str] = []
    server = _router(reply, heard)
    try:
        result = CliRunner().invoke(app, ["submit", "hi", *args, "--router-url",
                                          f"http://127.0.0.1:{server.server_port}"])
    finally:
        server.shutdown()

    assert result.exit_code == 1, result.output
    [error] = result.stderr.splitlines()
    assert error.startswith("error: router answered with something that is not its API")
    assert shown in error
    assert result.stdout == ("" if args else " half\n")


def test_dead_letters_whose_time_is_no_time_is_a_one_line_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer's at_ms in microseconds: a ValueError traceback. --json prints it as it is."""
    from types import SimpleNamespace

    from gpusched_ops import cli

    letter = {"source_topic": "gpusched.usage", "partition": 0, "offset": 1, "key": "k",
              "payload": "{}", "reason": "bad", "service": "accounting",
              "at_ms": 1_764_000_000_000_000}

    async def retained(bootstrap: str, topic: str, last: int
                       ) -> AsyncIterator[SimpleNamespace]:
        yield SimpleNamespace(topic=topic, partition=0, offset=3, key=None,
                              value=json.dumps(letter).encode(), timestamp=1_764_000_000_000)
    monkeypatch.setattr(cli, "retained", retained)

    result = CliRunner().invoke(app, ["dead-letters"])
    assert result.exit_code == 1, result.output
    [error] = result.stderr.splitlines()
    assert error.startswith("error: gpusched.dead-letters answered with something that is "
                            "not its API (OverflowError(")
    as_json = CliRunner().invoke(app, ["dead-letters", "--json"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)[0]["at_ms"] == letter["at_ms"]


def test_nodes_shows_a_node_the_scheduler_no_longer_hears_from_as_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler keeps a lost node's last report: it read 'ready', with free GPUs."""
    import time

    gpu = {"index": 0, "gpu_type": "L4-24GB", "memory_free_mib": 23034,
           "memory_total_mib": 23034, "running_requests": 0, "loaded_models": []}
    cluster = {"nodes": [
        {"node_id": "n1", "status": "ready", "gpus": [gpu], "live": False,
         "last_seen_ms": int(time.time() * 1000) - 42_000},
        {"node_id": "n2", "status": "ready", "gpus": [gpu], "live": True,
         "last_seen_ms": int(time.time() * 1000)}],
        "pending": {"interactive": 1, "batch": 2}, "reservations": 0, "leader": True}
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(200, json=cluster))
    monkeypatch.setattr(console, "width", 160)

    result = CliRunner().invoke(app, ["nodes"])

    assert result.exit_code == 0, result.output
    [n1] = [line for line in result.output.splitlines() if "n1" in line]
    [n2] = [line for line in result.output.splitlines() if "n2" in line]
    assert "lost (silent 4" in n1 and "ready" not in n1 and "ready" in n2
    stopped = {**cluster, "nodes": [{**cluster["nodes"][0], "status": "stopped"}]}
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(200, json=stopped))
    drained = CliRunner().invoke(app, ["nodes"])
    assert "stopped" in drained.output and "lost" not in drained.output
    assert "pending: 3 (interactive 1, batch 2)" in result.output


def test_nodes_shows_an_unhealthy_gpu_with_its_reason(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """It read 'ready' with its memory free, and nothing said why no work went there."""
    gpu = {"index": 0, "gpu_type": "H100-80GB", "memory_free_mib": 81559,
           "memory_total_mib": 81559, "running_requests": 0, "loaded_models": []}
    cluster = {"nodes": [{"node_id": "n1", "status": "ready", "live": True, "gpus": [
        {**gpu, "healthy": False, "unhealthy_reason": "inference server down"},
        {**gpu, "index": 1, "healthy": False}, {**gpu, "index": 2, "healthy": True}]}],
        "pending": {}, "reservations": 0, "leader": True}
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: httpx.Response(200, json=cluster))
    monkeypatch.setattr(console, "width", 160)

    result = CliRunner().invoke(app, ["nodes"])

    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "n1" in line]
    assert "unhealthy (inference server down)" in rows[0] and "ready" not in rows[0]
    assert "unhealthy" in rows[1] and "ready" not in rows[1]
    assert "ready" in rows[2] and "unhealthy" not in rows[2]


def test_text_from_a_service_is_printed_as_it_is_not_read_as_markup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reason or an id holding '[/x]' raised Rich's MarkupError (a traceback), and one
    holding '[b]' lost it."""
    refused = httpx.Response(400, json={"detail": "start='last[/week]' is neither ISO 8601 "
                                                  "nor [b]epoch ms"})
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: refused)
    result = CliRunner().invoke(app, ["usage", "--start", "last[/week]"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "start='last[/week]' is neither ISO 8601 nor [b]epoch ms" in result.output

    row = {"position": 1, "request_id": "req-[/x]-[b]y", "tenant": "acme",
           "priority_class": "batch", "chunk": "batch", "model": "m", "num_gpus": 1,
           "requeued": None, "waited_ms": 1000, "max_queue_ms": None}
    wide = Console(width=160, record=True)
    wide.print(queue_table({"requests": [row]}))
    assert "req-[/x]-[b]y" in wide.export_text()


@pytest.fixture
def empty_usage_topic(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpusched reconcile` reading a usage topic that holds nothing, no Kafka asked."""
    from gpusched_accounting import reconcile

    async def nothing_retained(bootstrap: str, since: object = None) -> tuple[list, dict]:
        return [], {}

    async def nothing_committed(bootstrap: str, group: str) -> dict:
        return {}

    monkeypatch.setattr(reconcile, "read_usage", nothing_retained)
    monkeypatch.setattr(reconcile, "applied_offsets", nothing_committed)


@pytest.mark.usefixtures("empty_usage_topic")
def test_reconcile_with_a_redis_url_that_is_none_exits_2_with_the_reason() -> None:
    """`--redis 127.0.0.1:6379` (no scheme) exited 1, 'totals differ', with a traceback."""
    result = CliRunner().invoke(app, ["reconcile", "--redis", "127.0.0.1:6379"])
    assert result.exit_code == 2, result.output
    assert "error: Redis URL must specify" in result.output
    assert "Traceback" not in result.output


@pytest.mark.usefixtures("empty_usage_topic")
def test_reconcile_prices_with_the_config_folder_accounting_bills_with(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--config-dir defaulted to the checkout's config/, not GPUSCHED_CONFIG_DIR: with an
    operator's own prices every priced day read as different, and in the Docker image (no
    checkout there) every cost recomputed as 0. A folder without prices.yaml is an error."""
    monkeypatch.setenv("GPUSCHED_CONFIG_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["reconcile"])

    assert result.exit_code == 2, result.output
    assert f"error: {tmp_path / 'prices.yaml'} is missing" in result.output


@pytest.mark.parametrize("differences,code", [([], 0), ([{
    "tenant": "initech", "day": "2026-12-04", "recomputed": {"prompt_tokens": 10},
    "live": {"prompt_tokens": 0}}], 1)])
def test_reconcile_names_the_days_still_being_billed_and_exits_1_only_for_a_difference(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, differences: list[dict],
        code: int) -> None:
    """A day accounting was still billing read as a difference and exited 1, as lost
    billing would; it is named as not checked, with why, in the text and the --json."""
    from gpusched_accounting import reconcile

    report = {"records": 7, "tenant_days_checked": 1, "differences": differences,
              "still_being_billed": [{"tenant": "acme", "day": "2026-12-05"}],
              "recomputed_total": {}}

    async def run(args: object) -> dict:
        return report

    monkeypatch.setattr(reconcile, "run", run)
    result = CliRunner().invoke(app, ["reconcile", "--json", str(tmp_path / "r.json")])

    assert result.exit_code == code, result.output
    assert f"{len(differences)} differ, 1 not checked: still being billed" in result.output
    assert "acme 2026-12-05: not checked: still being billed" in result.output
    assert "run reconcile again once accounting has caught up" in result.output
    assert json.loads((tmp_path / "r.json").read_text()) == report


@pytest.mark.parametrize("args,env", [
    (["--dedup-ttl-s", "0"], {}), (["--dedup-ttl-s", "-604800"], {}),
    (["--dedup-ttl-s", "3599"], {}), ([], {"GPUSCHED_DEDUP_TTL_S": "0"}),
])
def test_reconcile_refuses_a_dedup_window_accounting_refuses(
        monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str]) -> None:
    """Accounting starts with no window under an hour; reconcile took 0 or less, forgot
    every id at once and reported each redelivery, billed once live, as billed twice (exit
    1, 'totals differ')."""
    from gpusched_accounting import reconcile
    from gpusched_accounting.settings import MIN_DEDUP_TTL_S

    async def never_read(bootstrap: str) -> list:
        raise AssertionError("the topic was read")

    monkeypatch.setattr(reconcile, "read_usage", never_read)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["reconcile", *args])

    assert result.exit_code == 2, result.output
    assert "is no dedup window accounting takes" in result.output
    assert f"at least {MIN_DEDUP_TTL_S}" in result.output and "Traceback" not in result.output


def test_reconcile_reads_the_dedup_window_as_accounting_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUSCHED_DEDUP_TTL_S=7200.0, which accounting starts with, was refused as no window."""
    from gpusched_accounting import reconcile

    taken = []

    async def run(args: Any) -> dict:
        taken.append(args.dedup_ttl_s)
        return {"records": 0, "tenant_days_checked": 0, "differences": [],
                "still_being_billed": [], "recomputed_total": {}}

    monkeypatch.setattr(reconcile, "run", run)
    monkeypatch.setenv("GPUSCHED_DEDUP_TTL_S", "7200.0")
    result = CliRunner().invoke(app, ["reconcile"])
    assert result.exit_code == 0, result.output
    assert taken == [7200]


@pytest.mark.parametrize("error", ["timeout", "noauth"])
def test_reconcile_with_redis_answering_an_error_exits_2_not_1(
        monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    """Exit 1 means the totals differ: a Redis time-out or NOAUTH exited 1 with a traceback."""
    from redis.exceptions import ResponseError
    from redis.exceptions import TimeoutError as RedisTimeout

    from gpusched_accounting import reconcile

    async def run(args: object) -> dict:
        raise RedisTimeout("Timeout reading from socket") if error == "timeout" else \
            ResponseError("NOAUTH Authentication required.")

    monkeypatch.setattr(reconcile, "run", run)
    result = CliRunner().invoke(app, ["reconcile"])

    assert result.exit_code == 2, result.output
    assert "answered with an error" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("error,said", [
    ("auth", "error: Redis at redis://:***@127.0.0.1:1/0 refused the credentials: "
     "invalid password"),
    ("wrongtype", "error: Redis at redis://:***@127.0.0.1:1/0 answered with an error: "
     "ResponseError: WRONGTYPE Operation against a key holding the wrong kind of value"),
])
def test_reconcile_says_what_redis_answered_and_never_its_password(
        monkeypatch: pytest.MonkeyPatch, error: str, said: str) -> None:
    """A wrong password read as 'not reachable; is the stack up?' (redis-py's
    AuthenticationError is a ConnectionError), an error's text was lost (its repr holds
    none), and the URL went out whole, password and all, to the terminal and CI logs."""
    from redis.exceptions import AuthenticationError, ResponseError

    from gpusched_accounting import reconcile

    async def run(args: object) -> dict:
        raise AuthenticationError("invalid password") if error == "auth" else ResponseError(
            "WRONGTYPE Operation against a key holding the wrong kind of value")

    monkeypatch.setattr(reconcile, "run", run)
    result = CliRunner().invoke(app, ["reconcile", "--redis",
                                      "redis://:hunter2@127.0.0.1:1/0"])
    assert result.exit_code == 2, result.output
    assert said in result.output and "hunter2" not in result.output


def test_reconcile_names_a_kafka_address_it_cannot_read() -> None:
    result = CliRunner().invoke(app, ["reconcile", "--kafka", "localhost:notaport"])
    assert result.exit_code == 2, result.output
    assert "--kafka: takes host:port[,host:port], not 'localhost:notaport'" in result.output


def test_the_stack_knows_its_processes_after_the_wall_clock_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil dates a process's start from the boot time the clock implies now: after an
    NTP step the recorded date no longer matched, and `down` forgot the process running."""
    import subprocess

    import psutil

    from gpusched_ops import stack as stack_module
    from gpusched_ops.stack import LocalStack

    proc = subprocess.Popen(["sleep", "30"])
    try:
        local = LocalStack(tmp_path)
        pid_file = tmp_path / "pids" / "redis.pid"
        pid_file.parent.mkdir(parents=True)
        created = psutil.Process(proc.pid).create_time()
        pid_file.write_text(f"{proc.pid}\n{created!r}\n{created - psutil.boot_time()!r}\n")
        assert local._process("redis") is not None
        stepped = psutil.boot_time() + 1.0  # the wall clock stepped forward by a second
        monkeypatch.setattr(stack_module.psutil, "boot_time", lambda: stepped)
        monkeypatch.setattr(stack_module.psutil.Process, "create_time",
                            lambda self, c=created: c + 1.0)
        assert local._process("redis") is not None
    finally:
        proc.kill()
        proc.wait()


def test_down_stops_the_services_in_the_reverse_of_ups_start_order(tmp_path: Path) -> None:
    """`up` starts accounting, the scheduler, the agents, then the router; `down` stopped
    them by name, accounting first, while the agents still sent it the usage of the work
    they stopped. However they were (re)started, and a service of no such role (a test's
    extra instance) first."""
    import subprocess
    import sys

    import psutil

    from gpusched_ops.stack import LocalStack

    order = tmp_path / "stopped"
    on_term = ("import signal, sys, time\n"
               "def stop(*_):\n"
               f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
               "signal.signal(signal.SIGTERM, stop)\n"
               "print('ready', flush=True)\n"
               "time.sleep(60)\n")
    local = LocalStack(tmp_path)
    procs = []
    try:
        for name in ("router", "accounting", "agent-b", "acct-extra", "scheduler", "agent-a"):
            proc = subprocess.Popen([sys.executable, "-c", on_term, name],
                                    stdout=subprocess.PIPE, start_new_session=True)
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            procs.append(proc)
            (tmp_path / "pids").mkdir(exist_ok=True)
            created = psutil.Process(proc.pid).create_time()
            (tmp_path / "pids" / f"{name}.pid").write_text(
                f"{proc.pid}\n{created!r}\n{created - psutil.boot_time()!r}\n")
        local.stop()
        assert order.read_text().split() == [
            "acct-extra", "router", "agent-a", "agent-b", "scheduler", "accounting"]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_test_stack_runs_as_processes_unless_containers_are_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers were chosen whenever a Docker engine answered, and there the tests that
    stop or pause Kafka or Redis stopped nothing and started a second Redis and Kafka on
    the default ports: `make test` failed on every machine with Docker."""
    from gpusched_ops import testing
    from gpusched_ops.stack import StackError

    class ProcessStack(Exception):
        pass

    def install(self: object) -> None:
        raise ProcessStack

    monkeypatch.setattr(testing, "docker_available", lambda: True)
    monkeypatch.setattr(testing, "_start_containers", lambda: pytest.fail("containers"))
    monkeypatch.setattr(testing.LocalStack, "install", install)
    monkeypatch.delenv(testing.CONTAINERS_ENV, raising=False)
    with pytest.raises(ProcessStack):
        testing.start_test_stack(tmp_path)
    monkeypatch.setenv(testing.CONTAINERS_ENV, "1")
    monkeypatch.setattr(testing, "docker_available", lambda: False)
    with pytest.raises(StackError, match="no Docker engine answers"):
        testing.start_test_stack(tmp_path)


def test_the_stop_order_is_the_reverse_of_the_start_order() -> None:
    from gpusched_ops.services import service_specs
    from gpusched_ops.stack import StackEndpoints, _stop_rank

    started = [spec.name for spec in service_specs(StackEndpoints(
        "127.0.0.1:1", "redis://127.0.0.1:1/0", "http://127.0.0.1:1", "http://127.0.0.1:2"))]
    ranks = [_stop_rank(name)[0] for name in reversed(started)]
    assert 0 not in ranks and ranks == sorted(ranks)


def test_a_url_python_cannot_split_is_refused_in_one_line() -> None:
    """httpx took 'http://a[' and urllib then raised in server_root: a traceback, exit 1."""
    result = CliRunner().invoke(app, ["nodes", "--scheduler-url", "http://a["])
    assert result.exit_code == 2, result.output
    assert "is not a URL such as" in result.output and "Traceback" not in result.output
