"""`colibri-plan serve`: an OpenAI-compatible HTTP server over the engine, with a plan in force.

The model (and plan) are opened as `run` opens them; the engine runs in one thread of its own
(colibri_plan/serve/worker.py) behind the FastAPI app of colibri_plan/serve/app.py, on uvicorn. Loopback
only unless ``--host`` names another interface.
"""

from __future__ import annotations

import click

from colibri_plan.cli.common import collect_arg, emit, get_ctx, json_option, options_arg, progress, warn
from colibri_plan.run_options import DEFAULTS as D
from colibri_plan.run_options import RunOptions

#: the default port (vLLM's; llama.cpp's server takes 8080)
DEFAULT_PORT = 8000
#: the environment variable read for --api-key (keeps the key out of the process list)
API_KEY_ENV = "COLIBRI_PLAN_API_KEY"
#: the server's own options, handed to the command as one ``net`` dict
_NET = ("host", "port", "api_key", "model_name", "context_tokens", "max_queue", "max_body_bytes")


def _socket(host: str, port: int):
    """A listening TCP socket on ``host``:``port`` (0 = a free port), bound before uvicorn starts so that
    the address printed is the one served.

    Raises:
        InputError: the address cannot be resolved or bound (in use, not this machine's).
    """
    import socket

    from colibri_plan.errors import InputError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise InputError(f"--host {host}: cannot resolve it ({exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port} ({exc.strerror}); give another --port "
                         "(0 picks a free one)") from None
    return sock


def _is_loopback(sock) -> bool:
    import ipaddress

    return ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback


def _context(plan, asked: int | None) -> int:
    """Prompt + new tokens a request may ask: --context, else the plan's KV budget, else 4096."""
    if asked is not None:
        return asked
    if plan is not None:
        kv = (plan.doc.get("trunk") or {}).get("kv") or {}
        planned = kv.get("context_tokens", (plan.doc.get("budgets") or {}).get("context_tokens"))
        if isinstance(planned, int) and not isinstance(planned, bool) and planned > 0:
            return planned
    return 4096


@click.command("serve")
@click.option("--model", "model_path", required=True, type=click.Path(),
              help="Expert pack folder (or a Hugging Face checkpoint folder).")
@click.option("--plan", "plan_path", type=click.Path(), default=None,
              help="Place experts as this plan says (as `run --plan`); needs a pack.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on; loopback unless you name another (then give --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="TCP port (0 picks a free one; the address is printed when ready).")
@click.option("--api-key", default=None, envvar=API_KEY_ENV, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on /v1 requests (401 without it).")
@click.option("--model-name", default=None, help="The id clients send as `model` [the pack folder's name].")
@click.option("--context", "context_tokens", type=click.IntRange(1, 1_000_000), default=None,
              help="Prompt + new tokens per request [the plan's context, else 4096].")
@click.option("--max-queue", type=click.IntRange(0, 1024), default=8, show_default=True,
              help="Requests that may wait while one decodes; past that, 429 with Retry-After.")
@click.option("--max-body-bytes", type=click.IntRange(1024, 2**30), default=4 * 2**20, show_default=True,
              help="Largest request body (413 past it).")
@click.option("--backend", default=D.backend, show_default=True,
              help="Backend for the experts: auto (cpu if usable, else numpy), cpu, numpy, opencl, ...")
@click.option("--device", "device_index", type=click.IntRange(0), default=D.device_index, show_default=True,
              help="Backend device index (a GPU backend without --plan holds every expert there).")
@click.option("--trunk", type=click.Choice(["cpu", "device"]), default=D.trunk,
              help="Where the dense trunk, attention and KV cache run (as `run --trunk`).")
@click.option("--read-threads", type=click.IntRange(1, 64), default=D.read_threads,
              help="Concurrent O_DIRECT expert reads with --plan [the plan's queue depth, else 8].")
@json_option
@collect_arg(set(_NET), "net", dict)
@options_arg(RunOptions)
def serve(opts, net, model_path, plan_path):
    """Serve the model over the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions, /health).

    One request decodes at a time; up to --max-queue wait, more get 429. Requests decode greedily unless
    they set temperature (with top_p, top_k, seed), stop at the model's EOS and stop strings, and stream
    as server-sent events with "stream": true. When ready it prints the address (with --json one JSON
    document on stdout: url, host, port, model, context_tokens, text); Ctrl-C stops it."""
    from pathlib import Path

    import uvicorn

    from colibri_plan.engine import runner
    from colibri_plan.engine.moe import RoutingRecorder
    from colibri_plan.engine.pack_text import open_text, text_status
    from colibri_plan.engine.session import EngineSession
    from colibri_plan.errors import UnsupportedError
    from colibri_plan.serve.app import ServeSettings, create_app
    from colibri_plan.serve.worker import EngineWorker

    host, port, api_key = net["host"], net["port"], net.get("api_key")
    max_queue = net["max_queue"]
    device_index, trunk, read_threads = opts.device_index, opts.trunk, opts.read_threads
    try:
        backend = runner.resolve_backend(opts.backend)
    except UnsupportedError as exc:
        raise click.BadParameter(str(exc), param_hint="--backend") from None
    plan = None
    if plan_path is not None:
        from colibri_plan.formats.plan import load_plan

        plan = load_plan(plan_path)
        if backend not in runner.HOST_BACKENDS:
            raise click.BadParameter(f"{backend}: with a plan, host tiers run on cpu or numpy; the plan "
                                     "names its GPUs", param_hint="--backend")
    sock = _socket(host, port)   # before minutes of loading: a taken port fails at once
    weights = worker = None
    try:
        weights = runner.open_weights(model_path, None)
        if plan is not None:
            from colibri_plan.verify import machine_warning, this_machine_fingerprint

            runner.check_plan(plan, weights)
            w = machine_warning(plan, this_machine_fingerprint())
            if w:
                warn(w)
        codec = open_text(weights)
        progress(text_status(weights))
        ctx = _context(plan, net.get("context_tokens"))
        arch = weights.arch
        placement = runner.placement_for(weights, plan, backend, device_index)
        where = runner.trunk_placement(weights, plan, trunk, backend, device_index)
        threads = read_threads or (plan.read_threads if plan is not None else 8)
        cpu = backend if backend in runner.HOST_BACKENDS else "cpu"

        def open_session():
            return EngineSession(weights, placement, cpu_backend=cpu, read_threads=threads, trunk=where,
                                 recorder=RoutingRecorder(arch, keep_ids=False), context_tokens=ctx)

        progress(f"serve: opening {model_path} on {backend}" + (f" with plan {plan_path}" if plan else ""))
        worker = EngineWorker(open_session, max_queue=max_queue)
        worker.start()
        name = net.get("model_name") or Path(model_path).resolve().name
        settings = ServeSettings(model_name=name, context_tokens=ctx, vocab_size=arch.vocab_size,
                                 api_key=api_key, max_body_bytes=net["max_body_bytes"])
        app = create_app(worker, settings, codec, lambda n, m: runner.check_context(arch, n, m))
        addr = sock.getsockname()
        shown = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
        url = f"http://{shown}:{addr[1]}/v1"
        if not _is_loopback(sock) and api_key is None:
            warn(f"serving on {addr[0]}, not a loopback address, without --api-key: anyone who reaches "
                 "this machine can use the model")
        doc = {"url": url, "host": addr[0], "port": addr[1], "model": name, "context_tokens": ctx,
               "text": codec is not None, "api_key": api_key is not None, "max_queue": max_queue}
        emit(doc, lambda: f"serving {name} at {url} (context {ctx} tokens, queue {max_queue}); Ctrl-C stops")
        level = "info" if get_ctx().verbose else "warning"
        server = uvicorn.Server(uvicorn.Config(app, log_level=level, lifespan="off",
                                               timeout_graceful_shutdown=5))
        server.run(sockets=[sock])
    finally:
        if worker is not None:
            worker.stop()
        if weights is not None and hasattr(weights, "close"):
            weights.close()
        sock.close()
