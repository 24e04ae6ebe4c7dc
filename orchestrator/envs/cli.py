"""`orch env-server`: an env of the run config's registry (`orchestrator.config.ENVS`) served
over HTTP by :mod:`.server` (a front end: it composes the registry and the server)."""

from __future__ import annotations

import logging

import click

from orchestrator.config import served_env
from orchestrator.envs.server import MAX_DELAY_S, create_app, serve_command_line

log = logging.getLogger("orchestrator.envs.server")


@click.command("env-server")
@click.option("--env", "env_name", default="reverse_text", show_default=True, help="Env to serve (registered name).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 = pick a free port.")
@click.option("--seed", default=0, show_default=True, type=int, help="Env seed (tasks are a function of seed, index).")
@click.option(
    "--score-delay-s",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0, MAX_DELAY_S),
    help="Simulated grader latency added to every /score.",
)
@click.option("--min-len", type=click.IntRange(1), help="reverse_text: shortest prompt (default 3).")
@click.option("--max-len", type=click.IntRange(1), help="reverse_text: longest prompt (default 6).")
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
)
def env_server_command(
    env_name: str,
    host: str,
    port: int,
    seed: int,
    score_delay_s: float,
    min_len: int | None,
    max_len: int | None,
    log_level: str,
) -> None:
    """Serve an env over HTTP (POST /task, POST /score, GET /health, GET /stats)."""
    options = {k: v for k, v in (("min_len", min_len), ("max_len", max_len)) if v is not None}
    try:
        env = served_env(env_name, seed, **options)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--env") from None
    app = create_app(env, score_delay_s=score_delay_s)
    if not log.handlers:  # the CLI's own lines (cancelled handlers) next to uvicorn's
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
    log.setLevel(log_level.upper())

    def ready(base_url: str) -> None:
        click.echo(f"env-server {env_name} (seed {seed}) listening on {base_url}", err=False)

    serve_command_line(app, "env-server", host=host, port=port, log_level=log_level, on_ready=ready)


if __name__ == "__main__":  # python -m orchestrator.envs.cli
    env_server_command()
