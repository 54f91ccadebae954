"""python -m engine.serve MODEL [--backend vllm|vllm-static|eager] [--host 127.0.0.1] [--port 8000]
[--api-key KEY] ...: load the model, then serve it (uvicorn) until SIGINT / SIGTERM. Exit status 0
after a graceful stop, 1 when the engine died or hung and could not be brought back."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time

from engine.core.backends import CAPTURE_BACKENDS, backend_for
from engine.serve.settings import FLAGS, ServeSettings, default, size_for_machine


def _size(s: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s)


def _epilog() -> str:
    """The backends it serves (from the registry, engine/core/backends.py) and an example."""
    return ("backends (--backend):\n" + "\n".join(f"  {b:12s} {backend_for(b).summary}" for b in CAPTURE_BACKENDS)
            + "\n\nexample (then ask it with curl, the openai client or engine.connect('http://127.0.0.1:8000')):\n"
              "  python -m engine.serve meta-llama/Llama-3.2-1B --backend eager --port 8000")


# the settings that keep the server up (engine/serve/settings.py: flag names and defaults): field, type, help
STAYING_UP = (
    ("header_timeout_s", float, "seconds a request's headers may take to arrive (408 and closed past it)"),
    ("body_timeout_s", float, "seconds a request's body may take to arrive once its headers did (408)"),
    ("keep_alive_timeout_s", float, "seconds an idle keep-alive connection is kept open"),
    ("max_connections", int, "open connections; one more is answered 503 and closed"),
    ("max_connections_per_client", int, "open connections of one client address; one more: 503, closed (behind a "
                                        "proxy, every client has the proxy's address)"),
    ("open_files", int, "raise the soft open-file limit toward this at start (at most the hard limit)"),
    ("stream_stall_timeout_s", float, "a response whose client reads none of it for this many seconds is aborted "
                                      "(its engine request cancelled)"),
    ("stream_buffer_bytes", _size, "a response leaving more bytes than this unsent is aborted, e.g. 4MiB"),
    ("engine_restarts", int, "restarts of a dead or hung engine within 10 minutes before the process exits 1 "
                             "(0: exit at once)"),
    ("engine_hang_timeout_s", float, "seconds without an engine step while requests wait: the engine is hung "
                                     "(restarted as if dead)"),
    ("shutdown_grace_s", float, "seconds in-flight requests may run after SIGTERM; then each gets a 503"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog())
    p.add_argument("model", help="a repo id (real if cached, else the zoo twin; `python -m engine.zoo list`) or a "
                                 "model directory")
    p.add_argument("--backend", default="vllm", choices=CAPTURE_BACKENDS, help="one of the backends below")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed on startup)")
    p.add_argument("--api-key", default=os.environ.get("INTERP_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $INTERP_API_KEY)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients send as `model` (default: MODEL); repeatable")
    p.add_argument("--source", default="auto", choices=("auto", "zoo", "real", "local"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=512, help="vLLM: positions per sequence")
    p.add_argument("--max-num-seqs", type=int, default=32, help="vLLM: sequences batched per step")
    p.add_argument("--static-points", default="auto",
                   help="vllm-static: 'auto' or comma-separated points / addresses")
    p.add_argument("--max-pending", type=int, default=256, help="sequences in flight before new requests get 429")
    p.add_argument("--max-body-bytes", type=_size, default=16 << 20, help="request body limit (413 above), e.g. 16MiB")
    p.add_argument("--max-capture-bytes", type=_size, default=None,
                   help="captured bytes one request may return (default: 1/64 of this machine's memory, between "
                        "16MiB and 256MiB)")
    p.add_argument("--max-response-bytes", type=_size, default=None,
                   help="encoded captures one response may carry (base64: 4/3 of the raw bytes; list: 25 bytes a "
                        "number); above it the request is a 413 naming the limit (default: as --max-capture-bytes)")
    p.add_argument("--cpu-workers", type=int, default=2,
                   help="threads that parse, check, tokenize and encode requests off the event loop")
    p.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens a request may ask")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file or string) for models without one")
    p.add_argument("--sae-dir", default=None,
                   help="a folder of SAEs (SAELens format, one folder each) that requests may name in readouts and "
                        "feature steers; without it, requests naming an SAE are refused")
    g = p.add_argument_group("staying up (docs/uptime.md)")
    for name, kind, what in STAYING_UP:
        g.add_argument(FLAGS[name], dest=name, type=kind, default=default(name), help=f"{what} (default: "
                       f"{default(name)})", metavar="SECONDS" if kind is float else "N" if kind is int else "BYTES")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--access-log", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    spec = backend_for(args.backend)
    if args.static_points != "auto" and not spec.declares:
        cli.error(f"--static-points declares the taps of a backend that declares them at load (vllm-static), "
                  f"not of --backend {args.backend}")
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    # an ignored SIGCHLD is inherited (a supervisor's, or a Ray driver's with the subreaper option): the
    # children vLLM starts would be reaped unseen, and its shutdown, unable to see them exit, would
    # force-kill them (leaking their shared memory)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    logging.getLogger("engine.vllm").propagate = False  # it has its own handler: its load report once, not twice
    try:  # the event loop vLLM's own server runs on; the vLLM backends' private loop is made under this policy
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    from engine.loading import load_model
    from engine.serve import build_app, runner_for
    points = "auto" if args.static_points == "auto" else args.static_points.split(",")
    kw = spec.load_kw(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, static_points=points)
    template = args.chat_template
    if template and os.path.isfile(template):
        template = open(template).read()
    try:  # checked before the model loads: a bad flag fails in a second
        machine = size_for_machine()
        settings = ServeSettings(
            served=tuple(args.served_model_name or ()), api_key=args.api_key, max_body_bytes=args.max_body_bytes,
            max_pending=args.max_pending,
            max_capture_bytes=machine if args.max_capture_bytes is None else args.max_capture_bytes,
            max_response_bytes=machine if args.max_response_bytes is None else args.max_response_bytes,
            max_tokens_limit=args.max_tokens_limit, chat_template=template, cpu_workers=args.cpu_workers,
            sae_dir=args.sae_dir, **{k: getattr(args, k) for k, _, _ in STAYING_UP})
    except ValueError as e:
        cli.error(str(e))
    from engine.serve import connections, lifecycle
    connections.raise_open_files(settings.open_files)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))  # before loading: a taken port fails in a second, not after a minute
    def load():  # the first load, and each restart of a dead engine (engine/serve/supervisor.py)
        return load_model(args.model, backend=args.backend, source=args.source, dtype=args.dtype, **kw)
    # SIGTERM while the model loads: noted, and acted on once the load is done (killed mid-load, the server
    # left vLLM's engine core and worker running with no parent, for good)
    stop = []
    old = signal.signal(signal.SIGTERM, lambda sig, frame: stop.append(sig))
    print(f"engine.serve: loading {args.model} ({args.backend})", flush=True)
    try:
        model = load()
    finally:
        signal.signal(signal.SIGTERM, old)
    runner = runner_for(model, load)
    if stop:
        print("engine.serve: SIGTERM while loading: the model was closed without serving", flush=True)
        runner.close()
        return 128 + signal.SIGTERM
    try:
        app = build_app(runner, settings)
        server = lifecycle.server(app, settings, log_level=args.log_level, access_log=args.access_log)
        host, port = sock.getsockname()[:2]
        print(f"engine.serve: {model.name} ({args.backend}) listening on http://{host}:{port}", flush=True)
        with server.signals():
            runner.serve(server.serve(sockets=[sock]))
        served = time.monotonic()
    finally:
        runner.close()
    if server.signalled_at:  # how the exit spent its time (docs/uptime.md quotes it)
        print(f"engine.serve: stopped serving {served - server.signalled_at:.1f} s after the signal (--shutdown-grace "
              f"{settings.shutdown_grace_s:g} s); the engine shut down in {time.monotonic() - served:.1f} s", flush=True)
    if server.exit_code:  # the engine was given up on: exit now, not after joining threads it may still hold
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(server.exit_code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
