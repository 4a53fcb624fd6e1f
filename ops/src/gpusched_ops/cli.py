"""`gpusched`: the operator's command line (local stack, submit, usage, nodes, dead letters,
monitoring manifests, demo, bench)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import quote

import httpx
import typer
from aiokafka.conn import collect_hosts
from aiokafka.errors import KafkaConnectionError
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table
from rich.text import Text

from gpusched_common import topics
from gpusched_common.contracts import (
    DEAD_LETTER,
    MAX_QUEUE_LIST,
    REQUEST_ID,
    DeadLetter,
    invalid_fields,
)
from gpusched_common.kafka_records import dead_letter, retained
from gpusched_common.settings import server_root
from gpusched_ops.monitoring import OWN_LABELS, operator_manifests, operator_objects
from gpusched_ops.services import SERVICE_START_TIMEOUT_S, service_specs, urls
from gpusched_ops.stack import LocalStack, StackError, default_cache_dir, find_repo_root

app = typer.Typer(help="gpusched: share a GPU fleet between inference workloads and tenants.",
                  no_args_is_help=True, add_completion=False)
bench_app = typer.Typer(help="Benchmarks that print numbers next to a baseline.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()
errors = Console(stderr=True, soft_wrap=True)
"""Errors go to stderr, one line each: `--json > file` keeps only JSON."""

RunDir = Annotated[Path, typer.Option(envvar="GPUSCHED_RUN_DIR", help="State, logs, pids.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
DEFAULT_RUN_DIR = default_cache_dir() / "run"


def _stack(run_dir: Path) -> LocalStack:
    return LocalStack(run_dir)


def _table(*headers: str, title: str | None = None) -> Table:
    """A table whose cells wrap instead of being cut with an ellipsis: piped to a file or a
    CI log the console is 80 columns wide, and a cut model name or log path is no use."""
    return Table(*(Column(h, overflow="fold") for h in headers), title=title)


def _row(table: Table, *cells: str) -> None:
    """Add a row of text as it is: what services answer (ids, reasons, model names) is not
    read as Rich markup, where '[/x]' raised and '[b]' vanished."""
    table.add_row(*(Text(cell) for cell in cells))


def _fail(message: str, exit_code: int = 1) -> NoReturn:
    errors.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(exit_code)


def _refuse(message: str) -> NoReturn:
    """Refuse a value given on the command line (or in an environment variable) before
    anything is sent: one line, exit 2, as the parser's own refusals (`--limit 0`) exit;
    1 is left to a command that could not be done (a service down, or refusing)."""
    _fail(message, 2)


@contextlib.contextmanager
def _its_api(service: str) -> Iterator[None]:
    """Read an answer of `service` inside this: one that is not the shape of its API (a
    proxy's page, another program on its port, a number where text goes, a time out of any
    calendar) is a one-line error, not a traceback or a reply of nulls."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError, ValueError,
            OverflowError) as exc:
        _fail(f"{service} answered with something that is not its API ({exc!r})")


def _unreachable(service: str, url: str, cause: object) -> NoReturn:
    _fail(f"{service} not reachable at {url} ({cause}); is the stack up?")


def _http_errors(*names: str) -> tuple[type[Exception], ...]:
    """httpx's error classes `names`, and httpx2's where it is installed: the openai SDK runs
    on either, and an httpx2 error is no httpx one. Looked up when an error is raised: the
    commands that never meet one do not import httpx2."""
    modules = [httpx]
    with contextlib.suppress(ImportError):
        modules.append(importlib.import_module("httpx2"))
    return tuple(getattr(module, name) for module in modules for name in names)


def _no_answer(service: str, url: str, exc: BaseException, timeout_s: float,
               sent: str | None) -> NoReturn:
    """Fail for an HTTP answer that did not come whole. 'Not reachable' only where no
    connection was made, so nothing was sent; after that `service` may have taken the
    request, and `sent` says what it may be doing (a completion told 'not reachable' was
    sent again: run and billed twice)."""
    if isinstance(exc, _http_errors("ConnectError", "ConnectTimeout")):
        _unreachable(service, url, exc)
    lost = (f"no answer from {service} at {url} within {timeout_s:g} s"
            if isinstance(exc, _http_errors("TimeoutException")) else
            f"no whole answer from {service} at {url} ({exc})")
    _fail(f"{lost}; {sent}" if sent else lost)


_QUIET = logging.NullHandler()


@app.callback()
def _quiet_libraries() -> None:
    # aiokafka logs a failed connection itself, and with no logging set up Python prints
    # that to stderr before the command's own one-line error says the same
    logging.getLogger("aiokafka").addHandler(_QUIET)  # once: the same handler


# Options are checked before a command runs, so a value that cannot be used is a one-line
# error naming it, with exit 2 (`_refuse`): it failed later, as a traceback or as a wrong
# cause ("is the stack up?", "not an event stream").

def _given_as(ctx: typer.Context, param: typer.CallbackParam) -> str:
    """What the user gave a value as: its option, or the environment variable it came from
    (the source's enum is compared by name: typer's own copy of click has its own)."""
    source = ctx.get_parameter_source(param.name or "")
    if getattr(source, "name", None) == "ENVIRONMENT":
        return str(param.envvar)
    return param.opts[0]


def _header_value(ctx: typer.Context, param: typer.CallbackParam, value: str | None
                  ) -> str | None:
    """A value sent in an HTTP header (an API key, a priority class): printable ASCII with
    no spaces around it (a key copied with its line end could not be sent)."""
    if value is None or (value.isascii() and value.isprintable() and value == value.strip()):
        return value
    bad = next((c for c in value if not (c.isascii() and c.isprintable())), None)
    _refuse(f"{_given_as(ctx, param)} cannot be sent in an HTTP header: it holds "
            + (f"{bad!r} (only printable ASCII can be)" if bad else "spaces around it"))


def _base_url(ctx: typer.Context, param: typer.CallbackParam, value: str) -> str:
    """A service's URL, which the commands append their paths to (/v1/...): its root
    (`server_root`), without a trailing slash (`http://host:8080/` asked for //v1/..., a
    bare 404) or a trailing /v1, as OpenAI clients write a base URL (it asked for
    /v1/v1/..., a bare 404 too), and with no query or fragment, which would end up before
    the path. A path before /v1 (a proxy's prefix) is kept, by `_ask` and the openai SDK
    alike."""
    try:
        url = httpx.URL(value)
        why = None if url.scheme in ("http", "https") and url.host else \
            "it needs http:// or https:// and a host"
        if why is None and ("?" in value or "#" in value):  # empty ones too
            why = "it can have no query (?) or fragment (#)"
        root = server_root(value)
    except (httpx.InvalidURL, ValueError) as exc:  # urllib's own reading is stricter
        why = str(exc)
    if why is not None:
        _refuse(f"{_given_as(ctx, param)} {value!r} is not a URL such as {param.default} "
                f"({why})")
    return root


def _bootstrap(ctx: typer.Context, param: typer.CallbackParam, value: str) -> str:
    try:
        collect_hosts(value, randomize=False)  # as the consumer will read it
    except ValueError:
        _refuse(f"{_given_as(ctx, param)} takes host:port[,host:port], not {value!r}")
    return value


def _service_url(service: str) -> Any:
    """The option `--<service>-url` (or GPUSCHED_<SERVICE>_URL), the local stack's by
    default."""
    return typer.Option(urls()[service], envvar=f"GPUSCHED_{service.upper()}_URL",
                        callback=_base_url)


ApiKey = Annotated[str, typer.Option(envvar="GPUSCHED_API_KEY", callback=_header_value)]


@app.command()
def up(run_dir: RunDir = DEFAULT_RUN_DIR) -> None:
    """Install (cached) and start Kafka, Redis, Jaeger and the services with two simulated
    GPU nodes; returns once every one is ready."""
    stack = _stack(run_dir)
    try:
        with console.status("installing Kafka, Redis and Jaeger (cached after the first run)"):
            stack.install()
        with console.status("starting Kafka, Redis and Jaeger"):
            endpoints = stack.start_infra()
        for spec in service_specs(endpoints):
            with console.status(f"starting {spec.name}"):
                stack.start_service(spec, timeout_s=SERVICE_START_TIMEOUT_S)
    except StackError as exc:
        _fail(str(exc))
    console.print(f"[green]up[/green]: router {urls()['router']}, accounting "
                  f"{urls()['accounting']}, Jaeger {endpoints.jaeger_query_url}; logs in "
                  f"{stack.log_dir}")


@app.command()
def down(run_dir: RunDir = DEFAULT_RUN_DIR) -> None:
    """Stop every process of the local stack (data stays in the run folder)."""
    _stack(run_dir).stop()
    console.print("[green]down[/green]")


@app.command()
def status(run_dir: RunDir = DEFAULT_RUN_DIR, as_json: JsonOut = False) -> None:
    """Each process of the local stack: pid, alive, resident memory, log file."""
    stack = _stack(run_dir)
    rows = stack.status()
    if as_json:
        print(json.dumps([{"name": r.name, "pid": r.pid, "alive": r.alive,
                           "rss_mib": r.rss_mib, "log": str(r.log_path)} for r in rows]))
        return
    table = _table("process", "pid", "state", "RSS MiB", "log",
                   title=f"logs in {stack.log_dir}")
    total = 0.0
    for r in rows:
        total += r.rss_mib or 0
        table.add_row(r.name, str(r.pid or "-"), "[green]up[/green]" if r.alive else
                      "[red]down[/red]", f"{r.rss_mib:.0f}" if r.rss_mib else "-",
                      r.log_path.name)
    table.add_row("total", "", "", f"{total:.0f}", "")
    console.print(table)


@app.command()
def nodes(as_json: JsonOut = False,
          scheduler_url: str = _service_url("scheduler"),
          ) -> None:
    """The fleet as the scheduler sees it: nodes, GPUs, free memory, loaded models (idle: none
    of its work runs there; unloaded when another model needs the room)."""
    data = _ask_json("scheduler", scheduler_url, "/v1/cluster", timeout=5)
    if as_json:
        print(json.dumps(data))
        return
    with _its_api("scheduler"):
        console.print(nodes_table(data))
        console.print(Text(
            f"pending: {_by_class(data['pending'])}, reservations: {data['reservations']}"
            + ("; this scheduler is a standby, ask the leader"
               if data.get("leader") is False else "")))


def nodes_table(data: dict) -> Table:
    """One row per GPU. A node the scheduler no longer hears from shows `lost` (with how
    long it has been silent), not the status its last report gave: the scheduler keeps
    that report, so a dead node read `ready` with its GPUs free. A GPU its agent reports
    unhealthy shows `unhealthy` and the agent's reason: it gets no work, and read `ready`."""
    now_ms = time.time() * 1000
    table = _table("node", "status", "GPU", "type", "free / total MiB", "running", "models")
    for node in data["nodes"]:
        status = node["status"]
        lost = node.get("live") is False and status != "stopped"  # a drained one is not lost
        if lost:
            seen = node.get("last_seen_ms")
            status = "lost" + (f" (silent {max(0.0, (now_ms - seen) / 1000):.0f} s)"
                               if isinstance(seen, int | float) else "")
        for gpu in node["gpus"]:
            gpu_status = status
            if not lost and gpu.get("healthy") is False:
                reason = gpu.get("unhealthy_reason")
                gpu_status = "unhealthy" + (f" ({reason})" if reason else "")
            _row(table, node["node_id"], gpu_status, str(gpu["index"]), gpu["gpu_type"],
                 f"{gpu['memory_free_mib']} / {gpu['memory_total_mib']}",
                 str(gpu["running_requests"]), ", ".join(
                     f"{m} (idle)" if m in (gpu.get("idle_models") or ()) else m
                     for m in gpu["loaded_models"]))
    return table


def _by_class(pending: dict) -> str:
    return f"{sum(pending.values())} (" + ", ".join(f"{c} {n}" for c, n in pending.items()) + ")"


@app.command()
def queue(limit: int = typer.Option(50, min=1, max=MAX_QUEUE_LIST,
                                    help="How many of the first in line to show."),
          as_json: JsonOut = False,
          scheduler_url: str = _service_url("scheduler"),
          ) -> None:
    """Requests waiting for a GPU, in the order the scheduler will consider them (aged work,
    then interactive, standard, batch): how long each has waited and its queue time limit
    (model xN: a gang of N GPUs)."""
    data = _ask_json("scheduler", scheduler_url, "/v1/queue", params={"limit": limit},
                     timeout=5)
    if as_json:
        print(json.dumps(data))
        return
    with _its_api("scheduler"):
        if data["requests"]:
            console.print(queue_table(data))
        shown = len(data["requests"])
        total = sum(data["pending"].values())
        console.print(Text(f"pending: {_by_class(data['pending'])}"
                           + (f"; the first {shown} shown" if 0 < shown < total else "")
                           + ("" if data["leader"] else
                              "; this scheduler is a standby, ask the leader")))


def queue_table(data: dict) -> Table:
    table = _table("#", "request", "tenant", "class", "model", "waited s", "limit s",
                   "requeued")
    for r in data["requests"]:
        limit = r["max_queue_ms"]
        _row(table, str(r["position"]), r["request_id"], r["tenant"],
             r["priority_class"] + (f" ({r['chunk']})" if r["chunk"] in ("aged", "preempting")
                                    else ""),
             r["model"] + (f" x{r['num_gpus']}" if r["num_gpus"] > 1 else ""),
             f"{r['waited_ms'] / 1000:.1f}", "-" if limit is None else f"{limit / 1000:g}",
             r["requeued"] or "-")
    return table


_LABEL_TEXT = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
"""A label's value, or its key's name: letters, digits, '-', '_', '.', a letter or digit at
each end (the empty text too)."""
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
"""An RFC 1123 DNS label, as Kubernetes names a namespace (at most 63 characters)."""
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL.pattern}(\.{_DNS_LABEL.pattern})*")


def namespace_problem(name: str) -> str | None:
    """Why Kubernetes refuses the namespace `name`, or None. `kubectl apply` refused the
    manifests made for such a namespace, every one of them."""
    if len(name) <= 63 and _DNS_LABEL.fullmatch(name):
        return None
    return ("it is not 1 to 63 lowercase letters, digits and '-', a letter or digit at each "
            "end (an RFC 1123 DNS label)")


def _namespace(ctx: typer.Context, param: typer.CallbackParam, value: str | None
               ) -> str | None:
    if value is not None and (why := namespace_problem(value)) is not None:
        _refuse(f"{_given_as(ctx, param)} {value!r}: {why}, as Kubernetes names namespaces")
    return value


def label_problem(key: str, value: str) -> str | None:
    """Why Kubernetes refuses the label `key: value`, or None: its rules for a qualified
    name ([DNS subdomain prefix/]name) and for a label value. `kubectl apply` refused the
    manifests made with such a label, every one of them."""
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix)):
        return (f"the key's prefix {prefix!r} is not a DNS subdomain (at most 253 lowercase "
                "letters, digits, '-' and '.', a letter or digit at each end)")
    if not (0 < len(name) <= 63 and _LABEL_TEXT.fullmatch(name)):
        return (f"the key's name {name!r} is not 1 to 63 letters, digits, '-', '_' and '.', "
                "a letter or digit at each end")
    if not (len(value) <= 63 and _LABEL_TEXT.fullmatch(value)):
        return (f"the value {value!r} is not at most 63 letters, digits, '-', '_' and '.', "
                "a letter or digit at each end")
    return None


@app.command("monitoring-manifests")
def monitoring_manifests(
    namespace: str = typer.Option("gpusched", callback=_namespace,
                                  help="Where the services run."),
    label: list[str] = typer.Option([], help="KEY=VALUE on every object, such as "
                                    "release=kube-prometheus-stack (repeatable)."),
    dashboard_namespace: str | None = typer.Option(
        None, callback=_namespace,
        help="Where Grafana's sidecar looks for dashboards (default: --namespace)."),
) -> None:
    """Print, for `kubectl apply -f -`, the Prometheus Operator's PodMonitor and
    PrometheusRule and the Grafana dashboard's ConfigMap, made from ops/prometheus and
    ops/grafana."""
    if bad := [entry for entry in label if "=" not in entry]:
        _refuse(f"--label takes KEY=VALUE, not {bad[0]!r}")
    labels: dict[str, str] = {}
    for entry in label:
        key, value = entry.split("=", 1)
        if (why := label_problem(key, value)) is not None:
            _refuse(f"--label {entry}: {why}, as Kubernetes takes labels")
        if key in labels:  # the last one was kept, silently
            _refuse(f"--label {key} is given twice ({key}={labels[key]}, {entry}): an "
                    "object has one value per key")
        if key in OWN_LABELS:  # it replaced theirs, or theirs replaced it, silently
            _refuse(f"--label {entry}: the manifests set {key}={OWN_LABELS[key]} "
                    "themselves; give another key")
        labels[key] = value
    try:
        root = find_repo_root()
    except StackError as exc:
        _fail(str(exc))
    print(operator_manifests(operator_objects(root, namespace, labels, dashboard_namespace)),
          end="")


@app.command("dead-letters")
def dead_letters(
    last: int = typer.Option(20, min=1, help="How many of the newest to show."),
    kafka: str = typer.Option("127.0.0.1:9092", envvar="GPUSCHED_KAFKA_BOOTSTRAP",
                              callback=_bootstrap, help="Kafka bootstrap."),
    as_json: JsonOut = False,
) -> None:
    """The newest records a service refused, from gpusched.dead-letters: when, which service,
    where the record came from (topic, partition, offset, key) and why."""
    try:
        letters = asyncio.run(read_dead_letters(kafka, last))
    except KafkaConnectionError as exc:
        _unreachable("Kafka", kafka, exc)
    if as_json:
        print(json.dumps([letter.model_dump() for letter in letters]))
        return
    with _its_api(topics.DEAD_LETTERS.name):  # at_ms from a clock in microseconds
        console.print(dead_letter_table(letters))


def dead_letter_table(letters: list[DeadLetter]) -> Table:
    table = _table("at (UTC)", "service", "from", "key", "reason",
                   title=f"{topics.DEAD_LETTERS.name}: the newest {len(letters)}")
    for letter in letters:
        _row(table, _utc(letter.at_ms, "%Y-%m-%d %H:%M:%S"), letter.service,
             f"{letter.source_topic}[{letter.partition}]@{letter.offset}", letter.key or "",
             letter.reason)
    return table


async def read_dead_letters(bootstrap: str, last: int) -> list[DeadLetter]:
    """The newest `last` dead letters, oldest first (a record that is not one is shown as a
    letter whose reason says so)."""
    letters = []
    async for record in retained(bootstrap, topics.DEAD_LETTERS.name, last):
        try:
            letters.append(DEAD_LETTER.validate_json(record.value or b""))
        except ValidationError as exc:
            letters.append(dead_letter(record, f"not a dead letter: {invalid_fields(exc)}",
                                       "?", record.timestamp))
    return sorted(letters, key=lambda letter: letter.at_ms)[-last:]


@app.command()
def submit(
    prompt: str = typer.Argument(..., help="Prompt text."),
    model: str = typer.Option("qwen2.5-1.5b"),
    max_tokens: int = typer.Option(32),
    api_key: ApiKey = "sk-acme-demo",
    priority: str | None = typer.Option(None, callback=_header_value,
                                        help="interactive, standard or batch."),
    max_queue_ms: int | None = typer.Option(
        None, help="Give up (503) when no GPU took it within this many milliseconds."),
    router_url: str = _service_url("router"),
    timeout: float = typer.Option(
        330.0, min=1, help="Longest wait for the router's next bytes, in seconds: above its "
        "GPUSCHED_REQUEST_TIMEOUT_S (300), after which it answers 504 itself."),
    as_json: JsonOut = False,
) -> None:
    """Send one completion through the router and stream its tokens (--json: wait for the
    whole reply and print it as JSON). One attempt: nothing is sent twice."""
    from openai import APIConnectionError, APIError, APIStatusError, OpenAI, Timeout

    # No retries: the SDK's would send the completion again after a time-out or a cut
    # connection, and run it twice (a key would stop that, but also the cancel that a
    # Ctrl-C sends by hanging up).
    client = OpenAI(base_url=f"{router_url}/v1", api_key=api_key, max_retries=0,
                    timeout=Timeout(timeout, connect=5.0))  # the SDK's own: it may not
    # be httpx's (openai 3.63 runs on httpx2, and refused httpx.Timeout: every submit failed)
    headers = {"X-Priority-Class": priority} if priority else {}
    if max_queue_ms is not None:
        headers["X-Max-Queue-Ms"] = str(max_queue_ms)
    streamed, finished, request_id = 0, False, None
    try:
        # the response's headers before its body: they name the request should the body break
        with client.completions.with_streaming_response.create(
                model=model, prompt=prompt, max_tokens=max_tokens, stream=not as_json,
                extra_headers=headers) as response:
            request_id = response.headers.get("x-request-id")
            with _its_api("router"):
                if as_json:
                    result = response.parse()
                    if not isinstance(result.choices, list):  # the SDK does not check: `{}`
                        raise TypeError(f"choices is {result.choices!r}, not a list")
                    print(result.model_dump_json())
                    return
                try:
                    for chunk in response.parse():
                        if chunk.choices:
                            sys.stdout.write(chunk.choices[0].text)
                            sys.stdout.flush()
                            streamed += 1
                            finished = finished or chunk.choices[0].finish_reason is not None
                finally:
                    if streamed:  # the reply ends its line, before any error on stderr
                        print(flush=True)
    except APIStatusError as exc:  # the router's OpenAI-shaped error carries the reason
        reason = exc.body.get("message") if isinstance(exc.body, dict) else None
        _fail(f"{exc.status_code}: {reason or exc.message}")
    except (APIConnectionError, *_http_errors("TransportError")) as exc:
        # the SDK raises its own (a time-out too) from the transport's; a whole (--json)
        # reply's body is read raw
        lost = exc.__cause__ if isinstance(exc, APIConnectionError) else exc
        _no_answer("router", router_url, lost or exc, timeout, _may_still_run(request_id))
    except APIError as exc:  # an error event in the stream: the request failed midway
        _fail(exc.message)
    if not as_json and not finished:
        _fail(f"the stream ended after {streamed} chunks without a finish reason: the reply "
              f"is cut short; {_may_still_run(request_id)}")


def _may_still_run(request_id: str | None) -> str:
    """What to do about a request whose reply was lost after it went out."""
    if request_id:
        return (f"request {request_id} was sent and may still run, and be billed: GET "
                f"/v1/requests/{request_id} on the router shows how it ends, `gpusched "
                f"cancel {request_id}` stops it; submitting it again runs it twice")
    return ("the request was sent and may still run, and be billed: `gpusched queue` shows "
            "its id while it waits for a GPU, `gpusched cancel ID` stops it; submitting it "
            "again may run it twice")


def _path_segment(text: str) -> str:
    """`text` as one segment of a URL path: '/' and '?' escaped, and a whole '.' or '..' as
    %2E, which the router reads back as the dots (httpx resolved them as a folder: `cancel
    ..` asked for /v1/cancel, and printed a bare 404)."""
    segment = quote(text, safe="")
    return segment.replace(".", "%2E") if segment in (".", "..") else segment


def _request_id(value: str) -> str:
    """A request id the contracts can hold (`RequestId`): one no request can have ('', 'a/b',
    ' ') was asked of the router, which answered a bare 404."""
    try:
        return REQUEST_ID.validate_python(value)
    except ValidationError as exc:
        _refuse(f"{value!r} is no request id ({exc.errors()[0]['msg']}): give its "
                "x-request-id, or the id a 504 or `gpusched queue` names")


@app.command()
def cancel(
    request_id: str = typer.Argument(..., callback=_request_id, help="The request's id: its "
                                     "x-request-id, or the one a 504 or `gpusched queue` "
                                     "names."),
    api_key: ApiKey = "sk-acme-demo",
    router_url: str = _service_url("router"),
) -> None:
    """Cancel one of your requests that has not ended: a waiting one ends unplaced and
    unbilled, a running one stops, billed for what it produced."""
    _ask("router", router_url, f"/v1/requests/{_path_segment(request_id)}/cancel",
         post=True, expect=202, timeout=30, headers={"Authorization": f"Bearer {api_key}"})
    console.print(Text(f"cancelling {request_id}: it ends 'cancelled' (GET "
                       f"/v1/requests/{request_id} shows when)"))


@app.command()
def usage(
    tenant: str | None = typer.Option(None),
    group_by: str = typer.Option("model", help="model, node, gpu_type, priority_class."),
    start: str | None = typer.Option(None, help="Window start: ISO 8601 or epoch ms "
                                     "(default: 24 h before the end)."),
    end: str | None = typer.Option(None, help="Window end (default: now)."),
    api_key: ApiKey = "sk-admin-demo",
    accounting_url: str = _service_url("accounting"),
    as_json: JsonOut = False,
) -> None:
    """Tokens, requests, GPU-seconds and cost per tenant over a window, from accounting."""
    # what was given, empty too: accounting names what is wrong with it (--tenant '' read
    # every tenant's usage)
    params = {name: value for name, value in (("group_by", group_by), ("tenant", tenant),
                                              ("start", start), ("end", end))
              if value is not None}
    data = read_usage(accounting_url, api_key, params)
    if as_json:
        print(json.dumps(data))
        return
    with _its_api("accounting"):
        console.print(usage_table(data))


def read_usage(accounting_url: str, api_key: str, params: dict) -> dict:
    """Accounting's `/v1/usage` report, or a clear error and exit."""
    return _ask_json("accounting", accounting_url, "/v1/usage", params=params, timeout=10,
                     headers={"Authorization": f"Bearer {api_key}"})


def _ask_json(service: str, base_url: str, path: str, **kwargs: Any) -> Any:
    """`_ask`'s answer as JSON, or a clear error and exit when it is not JSON."""
    resp = _ask(service, base_url, path, **kwargs)
    try:
        return resp.json()
    except ValueError:
        _fail(f"{service} at {base_url} answered {path} with something that is not JSON: "
              f"{_gist(resp.text)}")


def _ask(service: str, base_url: str, path: str, *, timeout: float, post: bool = False,
         expect: int = 200, **kwargs: Any) -> httpx.Response:
    """`service`'s answer to a GET (or POST) of `path`, or a clear error and exit: not
    reachable, no (whole) answer in time, or the status it answered with and its reason."""
    try:
        resp = (httpx.post if post else httpx.get)(f"{base_url}{path}", timeout=timeout,
                                                   **kwargs)
    except httpx.HTTPError as exc:
        _no_answer(service, base_url, exc, timeout,
                   "it was sent, and may have been carried out" if post else None)
    if resp.status_code != expect:
        reason = _reason(resp)
        _fail(f"{resp.status_code}: {reason}" if reason is not None else
              f"{resp.status_code} from {base_url}{path}, not an answer of {service}'s API "
              f"(a proxy's, or another program's on that port?): {_gist(resp.text)}")
    return resp


def _reason(resp: httpx.Response) -> str | None:
    """An error's reason: the router's OpenAI-shaped `error.message`, else FastAPI's `detail`
    string, or `param: message` per invalid field; None when the body holds none (it is
    not JSON, or not a gpusched service's error)."""
    try:
        body = resp.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):
        detail = "; ".join(f"{e['loc'][-1]}: {e['msg']}" for e in detail
                           if isinstance(e, dict) and e.get("loc") and "msg" in e) or None
    return detail if isinstance(detail, str) else None


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _utc(ms: float, form: str) -> str:
    """Epoch milliseconds as a UTC time in `form`. Added to the epoch, not converted by the
    platform: a time out of range raises OverflowError, where time.gmtime and
    datetime.fromtimestamp raise OSError on some platforms."""
    return (_EPOCH + timedelta(milliseconds=ms)).strftime(form)


def _gist(text: str, limit: int = 200) -> str:
    """A body that is not the API's, on one line: its first line, cut to `limit` characters
    (a proxy's or web server's HTML page printed whole was dozens of lines)."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return (line[:limit] + "…" if len(line) > limit else line) or "(an empty body)"


def usage_table(data: dict) -> Table:
    group = data.get("group_by") or "model"
    table = _table("tenant", group, "requests", "prompt\ntokens", "completion\ntokens",
                   "GPU-\nseconds", "cost\nUSD", title=f"usage from accounting, "
                   f"{_utc(data['start_ms'], '%Y-%m-%d %H:%M')} to "
                   f"{_utc(data['end_ms'], '%Y-%m-%d %H:%M')} UTC")

    def cells(row: dict) -> list[str]:
        return [str(row["requests"]), str(row["prompt_tokens"]), str(row["completion_tokens"]),
                f"{row['gpu_seconds']:.3f}", f"{row.get('cost_usd', 0):.4f}"]

    for t in data["tenants"]:
        table.add_row(Text(t["tenant"]), Text("all", style="bold"), *cells(t["totals"]))
        for row in t.get("groups") or []:
            _row(table, "", row["group"], *cells(row))
    return table


@app.command()
def demo(
    requests: int = typer.Option(60, min=1, max=5000, help="Requests in the workload."),
    seed: int = typer.Option(7),
    run_dir: RunDir = DEFAULT_RUN_DIR,
    as_json: JsonOut = False,
) -> None:
    """Start the local stack, run a short mixed workload from several tenants and priority
    classes, and print a report read back from the router, accounting and Jaeger."""
    from gpusched_ops.workload import make_plan, percentile, run_workload

    up(run_dir)
    endpoints = _stack(run_dir).endpoints()
    plans = make_plan(requests, seed)
    # usage from this run on (accounting widens the start to its minute), not the last 24 h
    started_ms = int(time.time() * 1000)
    started = time.perf_counter()
    with console.status(f"running {requests} requests"):
        outcomes = asyncio.run(run_workload(plans, urls()["router"], endpoints.kafka_bootstrap))
    wall_s = time.perf_counter() - started
    time.sleep(1.0)  # let the last usage records land before reading accounting back
    usage_data = read_usage(urls()["accounting"], "sk-admin-demo",
                            {"group_by": "model", "start": started_ms})
    traced = next((o for o in outcomes if o.trace_id), None)
    report = {
        "requests": len(outcomes), "wall_s": round(wall_s, 2),
        "by_class": {}, "usage": usage_data,
        "trace_url": f"{endpoints.jaeger_query_url}/trace/{traced.trace_id}" if traced else None,
        "trace_api": f"{endpoints.jaeger_query_url}/api/traces/{traced.trace_id}"
        if traced else None,
        "errors": [o.error for o in outcomes if o.error][:5],
    }
    for cls in ("interactive", "standard", "batch"):
        mine = [o for o in outcomes if o.priority_class == cls]
        ok = [o.latency_ms for o in mine if o.status == "completed"]
        report["by_class"][cls] = {
            "requests": len(mine), "completed": len(ok),
            "via_kafka": sum(o.via == "kafka" for o in mine),
            "p50_ms": round(percentile(ok, 50), 1), "p95_ms": round(percentile(ok, 95), 1),
            "p99_ms": round(percentile(ok, 99), 1)}
    if as_json:
        print(json.dumps(report))
    else:
        table = _table("priority class", "requests", "completed", "via Kafka", "p50 ms",
                       "p95 ms", "p99 ms", title=f"{len(outcomes)} requests in {wall_s:.1f} s")
        for cls, row in report["by_class"].items():
            table.add_row(cls, *(str(row[k]) for k in ("requests", "completed", "via_kafka",
                                                       "p50_ms", "p95_ms", "p99_ms")))
        console.print(table)
        console.print(usage_table(usage_data))
        console.print(f"one trace in Jaeger: {report['trace_url']}\n"
                      f"  (as JSON from Jaeger's API: {report['trace_api']})")
        if report["errors"]:
            console.print(f"[red]errors:[/red] {escape(str(report['errors']))}")
    done = sum(r["completed"] for r in report["by_class"].values())
    if done != len(outcomes):
        _fail(f"{len(outcomes) - done} of {len(outcomes)} requests did not complete")


PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True,
                "help_option_names": []}
"""Benchmarks and tools parse their own options (argparse); `--help` reaches them too."""


def _delegate(ctx: typer.Context, target: str) -> None:
    import importlib

    module, _, func = target.partition(":")
    raise typer.Exit(getattr(importlib.import_module(module), func)(list(ctx.args)))


@bench_app.command("solver", context_settings=PASS_THROUGH)
def bench_solver(ctx: typer.Context) -> None:
    """Placement solver: openb replay vs FGD, throughput vs the Python reference, optimality."""
    _delegate(ctx, "gpusched_scheduler.bench.solver:main")


@bench_app.command("scheduler", context_settings=PASS_THROUGH)
def bench_scheduler(ctx: typer.Context) -> None:
    """Placements/s and publish-to-placement latency through real Kafka."""
    _delegate(ctx, "gpusched_scheduler.bench.scheduler:main")


@bench_app.command("agent", context_settings=PASS_THROUGH)
def bench_agent(ctx: typer.Context) -> None:
    """Executor tokens/s and GPU-seconds per request; simulated executor overhead."""
    _delegate(ctx, "gpusched_agent.bench:main")


@bench_app.command("accounting", context_settings=PASS_THROUGH)
def bench_accounting(ctx: typer.Context) -> None:
    """Usage events/s applied through real Kafka and Redis, exact totals, query latency."""
    _delegate(ctx, "gpusched_accounting.bench:main")


@app.command(context_settings=PASS_THROUGH)
def reconcile(ctx: typer.Context) -> None:
    """Recompute usage totals from the usage topic and report differences from Redis."""
    _delegate(ctx, "gpusched_accounting.reconcile:main")


if __name__ == "__main__":
    app()
