"""Every check of what a run needs from outside (its inference endpoints, its env server, its
metric sinks' credentials) happens before the run dir exists and before the model is built: one
line, exit 2, no run dir, no model cache. Against real local HTTP servers: a closed port, a
server answering HTTP 500, an `orch env-server` with another seed, an `orch serve`."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from orchestrator.envs.server import running_server
from tests.inference.util import serving
from tests.support.cli import orch, orch_argv


def _closed_port() -> int:
    """A port nothing listens on: bound, then closed (a connection to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused_before_anything(runs: Path, result: subprocess.CompletedProcess, starts: str) -> str:
    """Exit 2, one line starting with `starts`, and nothing left: no run dir, no model built."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("orch: error: " + starts), result.stderr
    assert not (runs / "r").exists()
    assert not (runs / ".cache").exists()  # the default model (built and warm-started there) was not
    return lines[0]


def _run(runs: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The default run (reverse_text, the hf trainer on the default model) with `args`."""
    return orch("run", "--runs-dir", str(runs), "--name", "r", "--max-steps", "3", *args, env=env)


def test_a_refused_connection_is_told_as_refused_before_the_model_is_built(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    line = _refused_before_anything(
        tmp_path, _run(tmp_path, "--inference", url), f"inference endpoint {url} cannot serve the run"
    )
    assert line.endswith("GET /v1/models got connection refused: nothing listens there")


def test_an_endpoint_always_answering_500_is_refused_before_the_model_is_built(tmp_path):
    async def dead(request):
        return PlainTextResponse("engine is dead", status_code=500)

    app = Starlette(routes=[Route("/{path:path}", dead)])
    with running_server(app) as server:
        result = _run(tmp_path, "--inference", server.base_url)
    line = _refused_before_anything(tmp_path, result, f"inference endpoint {server.base_url} cannot serve the run")
    assert line.endswith("GET /v1/models answered HTTP 500: engine is dead")


def test_an_orch_serve_endpoint_cannot_load_the_hf_trainers_weights(tmp_path):
    with serving() as server:
        result = _run(tmp_path, "--inference", server.base_url)
    line = _refused_before_anything(tmp_path, result, f"inference endpoint {server.base_url} is an `orch serve`")
    assert "loads `orch serve`'s own policy files, not the HF model dirs the trainer publishes" in line


def test_an_env_server_nobody_listens_on_is_refused_before_the_run_dir(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    _refused_before_anything(
        tmp_path,
        _run(tmp_path, "--set", f"env.reverse_text.server={url}"),
        f"env.reverse_text.server: GET {url}/health: env server unreachable",
    )


def test_an_env_server_with_another_seed_is_refused_before_the_run_dir(tmp_path):
    """`orch env-server --seed 5` serves other tasks than the run's (seed 0)."""
    server = subprocess.Popen(
        orch_argv("env-server", "--port", "0", "--seed", "5", "--log-level", "warning"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert server.stdout is not None
        first = server.stdout.readline()  # the server says where it listens once it does
        assert "listening on " in first, first
        url = first.rsplit("listening on ", 1)[1].strip()
        result = _run(tmp_path, "--set", f"env.reverse_text.server={url}")
    finally:
        server.terminate()
        server.wait(30)
    line = _refused_before_anything(tmp_path, result, f"env.reverse_text.server: {url} serves reverse_text tasks")
    assert line.endswith(
        "of {'seed': 5, 'min_len': 3, 'max_len': 6}, this run's are {'seed': 0, 'min_len': 3, 'max_len': 6}: "
        "start it with --seed 0 --min-len 3 --max-len 6"
    )


WANDB_SETTINGS = ("WANDB_CONFIG_DIR", "WANDB_BASE_URL")


def _without_wandb_credentials(home: Path) -> dict:
    """An environment whose W&B credentials would be in `home` (none yet), on W&B's public host."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    wandb = {"WANDB_CONFIG_DIR": str(home / ".config" / "wandb"), "WANDB_BASE_URL": "https://api.wandb.ai"}
    return {**env, "HOME": str(home), **wandb}


def _no_wandb_credentials_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's environment as `_without_wandb_credentials`'s; the home it points to."""
    home = tmp_path / "home"
    home.mkdir()
    for name, value in _without_wandb_credentials(home).items():
        monkeypatch.setenv(name, value)
    for name in [k for k in os.environ if k.startswith("WANDB_") and k not in WANDB_SETTINGS]:
        monkeypatch.delenv(name)
    return home


def test_wandb_online_without_a_key_is_refused_before_the_run_dir(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    result = _run(tmp_path, "--set", "metrics.wandb.project=x", env=_without_wandb_credentials(home))
    line = _refused_before_anything(tmp_path, result, "metrics.wandb logs online to https://api.wandb.ai")
    assert line.endswith(
        "finds no W&B API key: set WANDB_API_KEY or run `wandb login`, or log offline with "
        "--set metrics.wandb.mode=offline (`wandb sync` uploads it later)"
    )


def test_wandb_credentials_are_found_where_wandb_finds_them(tmp_path, monkeypatch):
    """A key in ~/.netrc (what `wandb login` writes), or offline mode, passes the check."""
    from orchestrator.config import WandbSection
    from orchestrator.observe.sinks import SinkUnavailable, WandbSink

    home = _no_wandb_credentials_here(tmp_path, monkeypatch)
    WandbSink.check(WandbSection(project="x", mode="offline"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    WandbSink.check(WandbSection(project="x"))
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(SinkUnavailable, match="finds no W&B API key"):
        WandbSink.check(WandbSection(project="x"))
    netrc = home / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    WandbSink.check(WandbSection(project="x"))


def test_a_wandb_whose_credential_lookup_breaks_skips_the_check(tmp_path, monkeypatch):
    """The lookup uses wandb's private APIs: one that raises (another wandb's layout) skips the
    check, as wandb.init will say what is missing; a key really missing is still refused."""
    from wandb.sdk.lib.wbauth import authenticate

    from orchestrator.config import WandbSection
    from orchestrator.observe.sinks import SinkUnavailable, WandbSink

    _no_wandb_credentials_here(tmp_path, monkeypatch)
    with pytest.raises(SinkUnavailable, match="finds no W&B API key"):
        WandbSink.check(WandbSection(project="x"))

    def changed(*args, **kwargs):
        raise TypeError("_use_system_auth() got an unexpected keyword argument 'update_session'")

    monkeypatch.setattr(authenticate, "_use_system_auth", changed)
    WandbSink.check(WandbSection(project="x"))
