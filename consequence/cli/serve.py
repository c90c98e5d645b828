"""``consequence serve``: the OpenAI-compatible endpoint (docs/agents.md)."""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
from pathlib import Path

import typer
from rich.markup import escape

from consequence.cli.app import app
from consequence.cli.common import check_model_dir, console, quiet_libraries

LOOPBACK = "127.0.0.1"


@app.command("serve")
def serve_cmd(
    model: str | None = typer.Option(
        None,
        help="Checkpoint folder, a run folder (its checkpoints/final) or a registered model name; default: the bundled tiny model.",
    ),
    host: str = typer.Option(
        LOOPBACK,
        help="Address to listen on; loopback by default (the endpoint has no authentication: anything that can reach it can use the model).",
    ),
    port: int = typer.Option(8000, min=0, max=65535, help="Port (0 = any free port; the one bound is printed)."),
    name: list[str] | None = typer.Option(
        None,
        "--served-model-name",
        "--name",
        help="A model name that /v1/models lists and requests may give; repeat for several (the first is listed "
        "first). Default: the registered name or hub id given to --model (its converted folder's name also "
        "answers), else the checkpoint folder's name.",
    ),
    temperature: float = typer.Option(
        1.0, min=0.0, max=2.0, help="Temperature of a request that gives none (0 = greedy)."
    ),
    top_p: float = typer.Option(1.0, min=0.01, max=1.0, help="Top-p of a request that gives none (1 = off)."),
    top_k: int = typer.Option(0, min=0, help="Top-k of every sampled request (0 = off; not an OpenAI field)."),
    max_tokens: int = typer.Option(
        256, min=1, help="Tokens per reply of a request that gives no max_tokens (capped by the context left)."
    ),
    seed: int = typer.Option(0, help="Seed of the sampling generator shared by requests without a seed."),
    max_batch: int = typer.Option(64, min=1, help="The most requests sampled together in one generate call."),
    batch_wait_ms: float = typer.Option(
        5.0,
        min=0.0,
        help="How long a batch waits for more requests after its first, and again while more keep arriving (at most 10 waits).",
    ),
    max_body_bytes: int = typer.Option(
        4 * 2**20, min=1, help="The largest request body in bytes; a larger one is refused with 413 before it is read."
    ),
    session_ttl: float = typer.Option(
        3600.0,
        min=0.0,
        help="Seconds after its last call that a session (its record and K/V) is forgotten; 0 = never.",
    ),
) -> None:
    """Serve a policy through an OpenAI-compatible API (/v1/models, /v1/chat/completions, /v1/responses,
    /v1/completions).

    Calls under /s/SESSION/v1 (or with an X-Session-Id header) are recorded token-exactly,
    one trajectory per session (GET /s/SESSION/record). GET /metrics gives Prometheus
    counters. Stops cleanly on SIGTERM or Ctrl-C.
    """
    import uvicorn

    from consequence.evaluate.run import resolve_model
    from consequence.harness.renderer import Renderer
    from consequence.policy.tiny import load_policy
    from consequence.serve.app import ServeSettings, create_app, model_context_length

    try:
        path = resolve_model(model)
        check_model_dir(str(path))
        quiet_libraries()
        policy, tokenizer = load_policy(path)
        renderer = Renderer(tokenizer, [])
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    if not _is_loopback(host):
        console.print(f"[yellow]warning:[/] listening on {escape(host)}: the endpoint has no authentication")
    names = served_names(model, path, name or [])
    settings = ServeSettings(
        names[0],
        model_context_length(policy),
        temperature,
        top_p,
        top_k,
        max_tokens,
        seed,
        max_batch,
        batch_wait_ms / 1000,
        aliases=tuple(names[1:]),
        max_body_bytes=max_body_bytes,
        session_ttl_s=session_ttl,
    )
    _log_to_console()
    try:
        sock = _bind(host, port)
    except OSError as e:
        console.print(
            f"[red]error:[/] cannot listen on {escape(host)}:{port} ({escape(str(e))}); pick another "
            "--port (0 = any free one)"
        )
        raise typer.Exit(2) from None
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(policy, renderer, settings), host=host, port=port, log_level="warning", lifespan="on")
    )
    console.print(
        f"serving {escape(settings.model_name)} ({escape(str(path))}) at http://{host}:{port}/v1 "
        f"(sessions: http://{host}:{port}/s/SESSION/v1); SIGTERM or Ctrl-C stops",
        soft_wrap=True,
    )
    # uvicorn handles SIGTERM / SIGINT (stop accepting, finish the requests in flight, stop the
    # batcher), then re-raises the signal to the handler it found: make that one a no-op, so a
    # requested stop exits 0 after the shutdown instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    console.print("endpoint stopped")


def served_names(model: str | None, path: Path, given: list[str]) -> list[str]:
    """The names the endpoint answers to, the first listed first (vLLM's ``--served-model-name``).

    ``given`` when any (empty names refused); else the registered name or hub id ``model``
    as typed, then the folder ``path`` it resolved to (a registered model's converted
    folder, ``smollm2-135m-instruct-b179c9523d0e``, still answers); else ``path``'s name.

    Raises:
        typer.BadParameter: an empty name.
    """
    if given:
        if any(not n.strip() for n in given):
            raise typer.BadParameter("a served model name may not be empty", param_hint="--served-model-name")
        return list(dict.fromkeys(given))
    from consequence.config import is_hub_id
    from consequence.policy.named import is_named

    if model is not None and (is_named(model) or is_hub_id(model)):
        return list(dict.fromkeys([model, path.name]))
    return [path.name]


def _log_to_console() -> None:
    """Show the endpoint's log (each 4xx with its reason, ignored fields, expired sessions) on stderr."""
    log = logging.getLogger("consequence.serve")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one), so the port is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
