"""Cancelling a verifiers episode (what drain and stop do) while its model call is in flight: the
harness subprocess ends, the call is dropped at the endpoint, the rollout's session is forgotten.
The endpoint is a stand-in that never answers a generate call, so no model server is needed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

from tests.inference.vllm_util import tiny_model  # noqa: E402
from tests.verifiers.util import EXAMPLES, harness_processes  # noqa: E402

pytestmark = pytest.mark.slow
HANG_GUARD_S = 300  # the first rollout on a machine builds the harness's uv environment


class SilentEndpoint:
    """Answers GET /v1/models; holds each generate call open until the caller goes away."""

    def __init__(self):
        self.called = threading.Event()
        self.dropped = threading.Event()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"data": []}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                endpoint.called.set()
                self.connection.settimeout(HANG_GUARD_S)
                with contextlib.suppress(OSError):
                    if self.connection.recv(1) == b"":  # the client closed the connection
                        endpoint.dropped.set()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def wait_until(condition, what: str, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"waited {timeout_s:g}s for {what}"
        await asyncio.sleep(0.05)


def test_a_cancelled_episode_leaves_no_harness_and_drops_its_call():
    from orchestrator.contracts import RolloutRequest
    from orchestrator.inference.client import InferenceClient
    from orchestrator.verifiers.component import VerifiersConfig
    from orchestrator.verifiers.env import VerifiersEnv

    endpoint = SilentEndpoint()
    model = str(tiny_model())
    section = VerifiersConfig(taskset="orch_reverse_text", path=[str(EXAMPLES / "verifiers_tasksets")], max_turns=1)

    async def main():
        env = VerifiersEnv(section, seed=0, temperature=1.0, max_tokens=8, model=model, renderer_model=model)
        async with InferenceClient([endpoint.url], weight_sync="none", timeout_s=HANG_GUARD_S) as client:
            async with env.serving():
                episode = asyncio.create_task(env.episode(RolloutRequest(1, 1, "verifiers", 0, 0, 0), client))
                await wait_until(endpoint.called.is_set, "the episode's model call", HANG_GUARD_S)
                harness = harness_processes()
                assert harness, "the harness subprocess should be running its turn"
                assert len(env.route._sessions) == 1
                episode.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await episode
                # Hang guards, not measurements: verifiers kills the harness's process group at once,
                # and the loop reaps it (no zombie left either).
                await wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in harness), "the harness", 30)
                await wait_until(endpoint.dropped.is_set, "the endpoint to see the call dropped", 30)
                assert env.route._sessions == {}

    try:
        asyncio.run(main())
    finally:
        endpoint.close()
