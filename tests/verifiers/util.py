"""Helpers of the verifiers tests: a recording HTTP proxy in front of a vLLM server, `orch run` on
the examples against it, and the run's log read back (the vLLM server itself comes from
tests/support/vllm_servers.py)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from orchestrator.core.events import SAMPLE_ID_STRIDE
from tests.support import logs, runs
from tests.support.cli import orch_argv

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
TASKSETS = Path(__file__).parent / "tasksets"


class RecordingProxy:
    """An HTTP proxy to `upstream` that keeps every /inference/v1/generate exchange as the engine
    saw and answered it: (request JSON, response JSON), and in `versions` the weight version the
    server held when the request came: that of the last `reload_weights` of a `weights/step_N`
    dir answered before it (orch sends no sampling request while a reload runs)."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.exchanges: list[tuple[dict, dict]] = []
        self.versions: list[int | None] = []
        self.loaded: int | None = None
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                served = proxy.loaded
                conn = http.client.HTTPConnection(host, int(port), timeout=300)
                conn.request(
                    self.command,
                    self.path,
                    body=body or None,
                    headers={"content-type": self.headers.get("content-type", "application/json")},
                )
                resp = conn.getresponse()
                answer = resp.read()
                if self.path.startswith("/inference/v1/generate") and resp.status == 200:
                    with lock:
                        proxy.exchanges.append((json.loads(body), json.loads(answer)))
                        proxy.versions.append(served)
                elif self.path.startswith("/collective_rpc") and resp.status == 200:
                    path = json.loads(body).get("kwargs", {}).get("weights_path", "")
                    proxy.loaded = int(path.rsplit("step_", 1)[1]) if "step_" in path else None
                self.send_response(resp.status)
                self.send_header("content-type", resp.getheader("content-type", "application/json"))
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_GET = do_POST = _forward

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


# The tiny model's chat template (orchestrator/hf/tiny_model.py) with every assistant answer but
# the last rendered empty, as a chat template that strips earlier turns' thinking does: a later
# turn's prompt does not extend the earlier call's tokens, so verifiers splits the trace.
STRIPPING_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n<|im_end|>\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def stripping_model(out: Path, model: Path) -> Path:
    """`model` (an HF dir) at `out` with STRIPPING_TEMPLATE as its chat template (same weights)."""
    shutil.copytree(model, out)
    (out / "chat_template.jinja").write_text(STRIPPING_TEMPLATE)
    return out


def samples_of(episode: dict) -> list[dict]:
    """A logged episode's samples (its decoded `episode_completed`): each one's slice of the arrays."""
    sizes = [n for n, _ in episode["samples"]] or [len(episode["token_ids"])]
    out, start = [], 0
    for index, n in enumerate(sizes):
        end = start + n
        out.append(
            {
                "episode_id": episode["episode_id"] + index * SAMPLE_ID_STRIDE,
                **{key: episode[key][start:end] for key in ("token_ids", "mask", "logprobs")},
            }
        )
        start = end
    return out


def orch_run_cmd(config: Path, runs_dir: Path, name: str, endpoint: str, model: Path, *extra: str) -> list[str]:
    """`orch run` of an example on the given endpoint (instead of a server of its own)."""
    assignments = [
        "inference.openai.launch.servers=0",
        f'inference.openai.endpoints=["{endpoint}"]',
        f"model.path={model}",
        f'env.verifiers.path=["{EXAMPLES / "verifiers_tasksets"}", "{TASKSETS}"]',
        "log.durability=normal",
    ]
    args = ["run", "--config", str(config), "--runs-dir", str(runs_dir), "--name", name, *runs.sets(*assignments)]
    return orch_argv(*args, *extra)


def orch_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def events(run_dir: Path, kind: str) -> list[dict]:
    """The `kind` events of a run's log, decoded (packed token lists included)."""
    return [event for _seq, event in logs.events(run_dir, kind)]


def harness_processes() -> list[int]:
    """Pids of verifiers harness programs still running (their scripts live in verifiers' cache)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if b"verifiers/runtimes/scripts" in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
    return pids
