"""The NeMo Gym servers a run starts (`env.nemo_gym.launch`), and stops at its end.

Each server instance of the run's NeMo Gym config that has an entrypoint is one process of NeMo
Gym's interpreter (`env.nemo_gym.venv`), started in the server's directory (a user's, where one
is found from where orch runs, else NeMo Gym's built-in one) by :mod:`.launch_server`, under the
same guard as orch's vLLM servers (its own process group, which dies with orch, SIGKILLed
included). Logs: ``RUN_DIR/logs/nemo_gym-NAME.log``. A server that exits fails every episode
after it (each episode first checks them), naming it and its log's last line.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.contracts import ComponentFailed
from orchestrator.inference.vllm_launch import LOGS_DIR, exit_message, spawn_guarded, stop_guarded, wait_serving
from orchestrator.nemo_gym.config import NemoGymSettings, server_directory, server_instances

LAUNCHER = Path(__file__).with_name("launch_server.py")


class NemoGymServerError(ComponentFailed):
    """A NeMo Gym server orch started did not start, or died."""


@dataclass
class Server:
    name: str
    url: str
    directory: Path
    entrypoint: str
    log_path: Path
    proc: subprocess.Popen | None = None


class NemoGymServers:
    def __init__(self, settings: NemoGymSettings, config: dict[str, Any], run_dir: Path):
        self.settings = settings
        self.config_yaml = yaml.safe_dump(config, sort_keys=False)
        self.servers = [
            Server(
                name,
                f"http://{own['host']}:{own['port']}",
                server_directory(settings, kind, server),
                str(own["entrypoint"]),
                run_dir / LOGS_DIR / f"nemo_gym-{name}.log",
            )
            for name, (kind, server, own) in server_instances(config).items()
            if "entrypoint" in own
        ]

    def url_of(self, name: str) -> str:
        return next(server.url for server in self.servers if server.name == name)

    def start(self) -> None:
        python = str(self.settings.venv / "bin" / "python")
        for server in self.servers:
            env = {
                **os.environ,
                "NEMO_GYM_CONFIG_DICT": self.config_yaml,
                "NEMO_GYM_CONFIG_PATH": server.name,
                "PYTHONPATH": str(server.directory),
            }
            env.pop("VIRTUAL_ENV", None)  # orch's, not NeMo Gym's
            command = [python, str(LAUNCHER), server.entrypoint]
            server.proc = spawn_guarded(command, env, server.log_path, self.settings.stop_timeout_s, server.directory)
        names = ", ".join(f"{s.name} ({s.url})" for s in self.servers)
        print(f"orch: started NeMo Gym servers {names} (logs in {self.servers[0].log_path.parent})", file=sys.stderr)

    def check_alive(self) -> None:
        """NemoGymServerError if a server has exited."""
        for server in self.servers:
            exited = exit_message(f"NeMo Gym server {server.name} ({server.url})", server.proc, server.log_path)
            if exited is not None:
                raise NemoGymServerError(exited)

    async def wait_ready(self) -> None:
        """Until every server answers ``GET /``, at most `ready_timeout_s` (at once if one exits)."""
        timeout_s = self.settings.ready_timeout_s
        print(f"orch: waiting up to {timeout_s:g}s for {len(self.servers)} NeMo Gym server(s)", file=sys.stderr)
        await wait_serving(
            [(f"{s.name} (log: {s.log_path})", s.url + "/") for s in self.servers],
            timeout_s,
            self.check_alive,
            lambda names: NemoGymServerError(f"NeMo Gym server(s) not ready after {timeout_s:g}s: {names}"),
        )

    def stop(self) -> None:
        stop_guarded(
            [(f"NeMo Gym server {s.name}", s.proc) for s in self.servers if s.proc is not None],
            self.settings.stop_timeout_s,
        )

    @contextlib.asynccontextmanager
    async def running(self):
        """The servers up for the block, stopped after it (whatever ends it)."""
        try:
            self.start()
            await self.wait_ready()
            yield self
        finally:
            self.stop()
