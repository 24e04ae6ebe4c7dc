"""`orch serve` as a process: starts on given weights, answers, stops on SIGTERM."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.inference.util import ServeProcess, publish

pytestmark = pytest.mark.slow


def test_serve_process_starts_on_weights_and_stops_on_sigterm(tmp_path):
    wdir = publish(tmp_path, 3)
    serve = ServeProcess("--weights", str(wdir), "--model-name", "tiny")
    try:
        url = serve.wait_ready()
        assert httpx.get(url + "/version").json() == {"version": 3, "path": str(wdir)}
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
        out = httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 4, "logprobs": 0}, timeout=30
        ).json()
        assert out["policy_version"] == 3 and len(out["choices"][0]["token_ids"]) <= 4
        serve.proc.terminate()  # graceful shutdown, then uvicorn re-raises the signal (exit -SIGTERM)
        assert serve.proc.wait(15) in (0, -signal.SIGTERM)
    finally:
        serve.stop()


def test_serve_refuses_weights_without_a_version(tmp_path):
    wdir = publish(tmp_path, 0)
    odd = wdir.rename(tmp_path / "odd-name")
    serve = ServeProcess("--weights", str(odd))
    try:
        assert serve.proc.wait(60) == 2
        assert b"pass --version" in serve.proc.stdout.read()
    finally:
        serve.stop()
