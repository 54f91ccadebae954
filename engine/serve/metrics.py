"""Counters for /metrics in Prometheus' text format: requests by route and status, tokens in and
out, capture bytes sent, requests refused for a full queue, the queue depth and request latency.

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
