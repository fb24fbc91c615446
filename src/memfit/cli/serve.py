"""``memfit serve``: the AUTOMATIC1111-compatible HTTP API and web page (memfit.serve) on uvicorn.

FastAPI and uvicorn come with the optional extra ``memfit[serve]``; they are imported only when
this command runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import socket
import sys

from memfit.cli.run_args import add_run_args, check_budget, run_options
from memfit.errors import MemfitError
from memfit.run.libraries import quiet_libraries
from memfit.sizes import parse_size

__all__ = ["register"]


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    srv = commands.add_parser("serve", help="serve an AUTOMATIC1111-compatible HTTP API and a web page, model kept warm")
    add_run_args(srv, budget_note="stages stay loaded between requests only while all of them fit it together",
                 model_help="with --models-dir: the checkpoint served first, a path (listed first if it is not in "
                 "DIR) or a name DIR's listing gives (default: the first listed)", several_configs=True)
    srv.add_argument("--models-dir", metavar="DIR", help="serve every checkpoint in DIR, switched between by request "
                     "(A1111's sd_model_checkpoint): an AUTOMATIC1111 models folder (Stable-diffusion/, VAE/, Lora/), "
                     "a ComfyUI one (checkpoints/, diffusion_models/, vae/, loras/, ...) or a folder of diffusers "
                     "folders and checkpoint files; one model is loaded at a time, --model picks the first")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs --api-auth)")
    srv.add_argument("--port", type=int, default=7861, help="port, 1 to 65535 (default 7861)")
    srv.add_argument("--api-auth", metavar="USER:PASSWORD", help="require HTTP basic auth (as AUTOMATIC1111's --api-auth)")
    srv.add_argument("--max-steps", type=int, default=150, help="most denoising steps a request may ask for (default 150)")
    srv.add_argument("--max-pixels", type=int, default=2048 * 2048, help="most width*height a request may ask for, "
                     "and the most pixels of an image it sends (default 4194304 = 2048x2048)")
    srv.add_argument("--max-images", type=int, default=8,
                     help="most images (batch_size*n_iter) per request (default 8)")
    srv.add_argument("--max-body", default="48MiB", metavar="SIZE", help="largest request body, e.g. 64MiB: a larger "
                     "one gets 413 before it is read (default 48MiB: an init image and a mask of 2048x2048 pixels)")
    srv.add_argument("--max-prompt-chars", type=int, default=20_000, metavar="N",
                     help="longest prompt or negative prompt, in characters (default 20000)")
    srv.add_argument("--max-seconds", type=float, default=600, metavar="S", help="refuse a request whose denoising "
                     "is estimated to take longer, from this checkpoint's earlier runs (pixels x steps x its "
                     "measured time per pixel and step); 0 turns the estimate off (default 600)")
    srv.add_argument("--shutdown-grace", type=float, default=30, metavar="S", help="on SIGTERM or Ctrl-C, the "
                     "seconds the running request has to finish before it is stopped at its next step or stage "
                     "(a second signal stops it at once) (default 30)")
    srv.add_argument("--no-warm", action="store_true", help="release every stage after each request, as generate does")
    srv.set_defaults(func=_serve)


def check_bind(host: str, auth: str | None) -> None:
    """Refuse to serve beyond this machine without a password, and a malformed --api-auth."""
    if auth is not None and (":" not in auth or not auth.split(":", 1)[0] or not auth.split(":", 1)[1]):
        raise MemfitError("--api-auth takes USER:PASSWORD, both non-empty.")
    if not _loopback(host) and auth is None:
        raise MemfitError(f"--host {host} lets other machines reach the server; add --api-auth USER:PASSWORD, "
                          "or bind 127.0.0.1.")


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_limits(args) -> None:
    """Refuse a port that is no port, limits that would refuse every request and a thread count that is no count,
    each in one sentence, before serve's own dependencies are imported."""
    from memfit.run.threads import check_threads

    check_threads(args.threads)
    if not 1 <= args.port <= 65535:
        raise MemfitError(f"--port {args.port} is not a port; give one from 1 to 65535 (default 7861).")
    for flag, value in (("--max-steps", args.max_steps), ("--max-pixels", args.max_pixels),
                        ("--max-images", args.max_images), ("--max-prompt-chars", args.max_prompt_chars)):
        if value < 1:
            raise MemfitError(f"{flag} {value} would refuse every request; give a positive number.")
    try:
        max_body = parse_size(args.max_body)
    except MemfitError as exc:
        raise MemfitError(f"--max-body: {exc}") from None
    if max_body < 1024:
        raise MemfitError(f"--max-body {args.max_body} would refuse every request; give a size such as 48MiB.")
    for flag, value in (("--max-seconds", args.max_seconds), ("--shutdown-grace", args.shutdown_grace)):
        if not 0 <= value < float("inf"):
            raise MemfitError(f"{flag} {value:g} must be a number of seconds, 0 or more.")


def _check_port_free(host: str, port: int) -> None:
    """Refuse an address the server could not listen on (a port in use, a privileged one) before it starts, rather
    than a traceback once it does."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise MemfitError(f"--host {host} is not an address of this machine ({exc.strerror}).") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise MemfitError(f"Cannot listen on {host}:{port} ({exc.strerror}); give another --port, or stop what "
                              "listens there.") from None


def _log_to_stdout() -> logging.Logger:
    """The server's log (a line per request, one at shutdown) on stdout, beside the lines it prints as it starts."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("memfit serve: %(message)s"))
    log = logging.getLogger("memfit.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def _serve(args) -> int:
    _check_limits(args)
    check_bind(args.host, args.api_auth)
    check_budget(args.budget)  # not --model: with --models-dir it may be a name in DIR's listing
    quiet_libraries()
    try:
        import uvicorn

        from memfit.serve import Limits, create_app
        from memfit.serve.app import STOP_WAIT
    except ImportError as exc:
        raise MemfitError(f"memfit serve needs its optional dependencies ({exc.name} is missing): "
                          "pip install 'memfit[serve]'.") from exc
    from memfit.serve.checkpoints import Checkpoints

    options = run_options(args)
    # A checkpoint memfit refuses (pickle without --allow-pickle, a truncated file) as --model stops the server
    # here, with the message memfit generate gives, not at every request; one in --models-dir is listed with it.
    checkpoints = Checkpoints.open(options.pop("model"), models_dir=args.models_dir, configs=options.pop("config") or (),
                                   warm=not args.no_warm, **options)
    _check_port_free(args.host, args.port)  # after the model's own refusals, which need no port
    # /sdapi/v1/cmd-flags: A1111's own names where the meaning is the same (port, listen), memfit's otherwise.
    flags = {"host": args.host, "port": args.port, "listen": not _loopback(args.host), "backend": args.backend,
             "fallback": args.fallback, "allow_pickle": args.allow_pickle}
    limits = Limits(max_steps=args.max_steps, max_pixels=args.max_pixels, max_images=args.max_images,
                    max_body_bytes=parse_size(args.max_body), max_prompt_chars=args.max_prompt_chars,
                    max_seconds=args.max_seconds or None)
    app = create_app(checkpoints, limits=limits, auth=args.api_auth, flags=flags, shutdown_grace=args.shutdown_grace)
    log = _log_to_stdout()
    queue = app.state.queue

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # SIGTERM / Ctrl-C: waiting requests are answered (503) at once, the running one has the grace
            # period to finish (a second signal: none), then uvicorn closes the connections and the app's
            # shutdown ends the worker.
            grace = 0 if self.should_exit else args.shutdown_grace
            waiting = queue.close(grace)
            running = queue.running
            log.info("%s: stopping; %d waiting request(s) answered 503%s", signal.Signals(sig).name, waiting,
                     f", the running one {running.id} stops at once" if running and not grace else
                     f", the running one {running.id} has {grace:g} s to finish" if running else "")
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                # uvicorn re-raises the signals it caught once it has shut down, so the process would
                # die by SIGTERM after draining; a drained server exits with status 0 instead.
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    captured[:] = [s for s in captured if s != signal.SIGTERM]

    selected = checkpoints.selected
    print(f"memfit serve: {selected.path} ({selected.pipeline}) on http://{args.host}:{args.port}/", flush=True)
    if checkpoints.library is not None:
        listed = checkpoints.listing.checkpoints
        print(f"memfit serve: {len(checkpoints.servable())} of {len(listed)} checkpoints in "
              f"{checkpoints.library.root} can be served (GET /memfit/v1/models lists every one)", flush=True)
        for entry in listed:
            if entry.error:
                print(f"memfit serve: cannot serve {entry.name}: {entry.error}", flush=True)
    # uvicorn waits for open requests at shutdown: no longer than the grace period and the wait for the running
    # request's next cancellation point.
    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                          timeout_graceful_shutdown=args.shutdown_grace + STOP_WAIT)).run()
    if queue.stop(STOP_WAIT):  # else a request stuck in one long call: its memory goes with the process
        checkpoints.close()
    return 0
