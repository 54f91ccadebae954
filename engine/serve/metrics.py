"""Counters for /metrics in Prometheus' text format: requests by route and status, tokens in and
out, capture bytes sent, requests refused for a full queue, the queue depth and request latency;
connections open, refused and timed out (engine/serve/connections.py), responses aborted for a
client that does not read, and the engine's deaths and restarts (engine/serve/supervisor.py).

`Recorder` is ASGI middleware that sees every response's status (errors included, streams once they
end); the handlers add tokens and bytes.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/capture", "/v1/points", "/v1/models", "/health",
          "/metrics")


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter = Counter()  # (route, status) -> n
        self.latency_sum: Counter = Counter()  # route -> seconds
        self.prompt_tokens = self.generation_tokens = self.capture_bytes = 0
        self.started = time.time()
        self.connections_open = 0
        self.connections_refused: Counter = Counter()  # reason -> n
        self.connections_timed_out: Counter = Counter()  # phase (headers, body, idle) -> n
        self.responses_aborted: Counter = Counter()  # reason (stalled, unsent) -> n
        self.engine_failures: Counter = Counter()  # kind (died, hung) -> n
        self.engine_restarts = 0
        self.engine_up = 1

    def render(self, queue_depth: int, queue_limit: int, rejected: int, model: str, backend: str,
               abandoned_tokens: int = 0) -> str:
        lines = ["# HELP interp_requests_total HTTP requests by route and status code.",
                 "# TYPE interp_requests_total counter"]
        for (route, status), n in sorted(self.requests.items()):
            lines.append(f'interp_requests_total{{route="{route}",status="{status}"}} {n}')
        lines += ["# HELP interp_request_seconds_sum Time spent answering, by route.",
                  "# TYPE interp_request_seconds_sum counter"]
        for route, s in sorted(self.latency_sum.items()):
            lines.append(f'interp_request_seconds_sum{{route="{route}"}} {s:.6f}')
        for name, help_, value, kind in (
                ("interp_prompt_tokens_total", "Prompt tokens processed.", self.prompt_tokens, "counter"),
                ("interp_generation_tokens_total", "Tokens generated.", self.generation_tokens, "counter"),
                ("interp_capture_bytes_total", "Raw bytes of captured tensors returned.", self.capture_bytes,
                 "counter"),
                ("interp_rejected_total", "Requests refused with 429 (queue full).", rejected, "counter"),
                ("interp_abandoned_tokens_total", "Tokens generated for requests whose client left, before they "
                 "stopped (eager stops between steps; vLLM aborts its requests and does not report these).",
                 abandoned_tokens, "counter"),
                ("interp_queue_depth", "Sequences admitted and not finished (queued or running).", queue_depth,
                 "gauge"),
                ("interp_queue_limit", "Most sequences admitted at once (--max-pending).", queue_limit, "gauge"),
                ("interp_uptime_seconds", "Seconds since the server started.", round(time.time() - self.started, 3),
                 "gauge")):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        for name, help_, kind, label, counts in (
                ("interp_connections_refused_total", "Connections refused at accept (503, closed): over "
                 "--max-connections, or over --max-connections-per-client from one address.", "counter", "reason",
                 self.connections_refused),
                ("interp_connections_timed_out_total", "Connections closed by a timeout: headers (--header-timeout), "
                 "body (--body-timeout), idle keep-alive (--keep-alive-timeout).", "counter", "phase",
                 self.connections_timed_out),
                ("interp_responses_aborted_total", "Responses aborted because their client did not read: stalled "
                 "(--stream-stall-timeout) or too many unsent bytes (--stream-buffer-bytes).", "counter", "reason",
                 self.responses_aborted),
                ("interp_engine_failures_total", "Times the engine was found dead or hung.", "counter", "kind",
                 self.engine_failures)):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{{label}="{k}"}} {n}' for k, n in sorted(counts.items())]
        for name, help_, value, kind in (
                ("interp_connections_open", "HTTP connections open now.", self.connections_open, "gauge"),
                ("interp_engine_restarts_total", "Restarts of the engine in place.", self.engine_restarts, "counter"),
                ("interp_engine_up", "1 while the engine serves, 0 while it is restarting or down.", self.engine_up,
                 "gauge")):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += ["# HELP interp_model_info The model served.", "# TYPE interp_model_info gauge",
                  f'interp_model_info{{model="{model}",backend="{backend}"}} 1']
        return "\n".join(lines) + "\n"


class Recorder:
    """Counts each response by route and status and adds its time to the route's latency sum."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = 500
        t0 = time.perf_counter()

        async def seen(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)
        try:
            await self.app(scope, receive, seen)
        finally:
            self.metrics.requests[(route, status)] += 1
            self.metrics.latency_sum[route] += time.perf_counter() - t0
