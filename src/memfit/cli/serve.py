"""``memfit serve``: the AUTOMATIC1111-compatible HTTP API and web page (memfit.serve) on uvicorn.

FastAPI and uvicorn come with the optional extra ``memfit[serve]``; they are imported only when
this command runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal

from memfit.cli.run_args import add_run_args, run_options
from memfit.errors import MemfitError

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
    srv.add_argument("--port", type=int, default=7861, help="port (default 7861)")
    srv.add_argument("--api-auth", metavar="USER:PASSWORD", help="require HTTP basic auth (as AUTOMATIC1111's --api-auth)")
    srv.add_argument("--max-steps", type=int, default=150, help="most denoising steps a request may ask for (150)")
    srv.add_argument("--max-pixels", type=int, default=2048 * 2048, help="most width*height a request may ask for")
    srv.add_argument("--max-images", type=int, default=8, help="most images (batch_size*n_iter) per request (8)")
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


def _serve(args) -> int:
    check_bind(args.host, args.api_auth)
    try:
        import uvicorn

        from memfit.serve import Limits, create_app
    except ImportError as exc:
        raise MemfitError(f"memfit serve needs its optional dependencies ({exc.name} is missing): "
                          "pip install 'memfit[serve]'.") from exc
    from memfit.serve.checkpoints import Checkpoints

    options = run_options(args)
    # A checkpoint memfit refuses (pickle without --allow-pickle, a truncated file) as --model stops the server
    # here, with the message memfit generate gives, not at every request; one in --models-dir is listed with it.
    checkpoints = Checkpoints.open(options.pop("model"), models_dir=args.models_dir, configs=options.pop("config") or (),
                                   warm=not args.no_warm, **options)
    # /sdapi/v1/cmd-flags: A1111's own names where the meaning is the same (port, listen), memfit's otherwise.
    flags = {"host": args.host, "port": args.port, "listen": not _loopback(args.host), "backend": args.backend,
             "fallback": args.fallback, "allow_pickle": args.allow_pickle}
    app = create_app(checkpoints, limits=Limits(args.max_steps, args.max_pixels, args.max_images), auth=args.api_auth,
                     flags=flags)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # SIGTERM / Ctrl-C: waiting requests are answered (503) at once, the running one finishes,
            # then uvicorn closes the connections and the app's shutdown ends the worker.
            app.state.queue.close()
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
    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")).run()
    checkpoints.close()
    return 0
