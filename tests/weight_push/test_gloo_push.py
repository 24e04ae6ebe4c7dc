"""The push between two CPU processes over gloo, without a vLLM server: the trainer's sender and
push service in this process, vLLM's ``orch_gloo`` engine (its receive, with a stand-in model
that records what it is given) in another. Every dtype arrives bit for bit, in several buckets;
each side whose peer never comes gives up within the group's timeout."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from orchestrator.weight_push import PUSH_INFO
from orchestrator.weight_push.sender import PushError, PushService, WeightPushSender
from orchestrator.weight_push.transport import GlooTransport

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
pytestmark = needs_vllm


def receive(ready, inbox, update_info: dict | None, out: str) -> None:
    """A vLLM worker's engine, as the server's routes drive it: once its imports are done (it
    sets ``ready``), join with the init info ``inbox`` then gives it, and receive one push (None:
    wait for one that never comes, as ``/update_weights`` would)."""
    from types import SimpleNamespace

    from orchestrator.weight_push.vllm_engine import OrchGlooWeightTransferEngine

    torch.set_num_threads(1)
    ready.set()
    init_info = inbox.get(timeout=60)
    got: list = []
    model = SimpleNamespace(load_weights=lambda weights: got.extend((n, t.clone()) for n, t in weights))
    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
    engine = OrchGlooWeightTransferEngine(None, vllm_config, "cpu", model)
    engine.init_transfer_engine(engine.parse_init_info(init_info))
    started = time.monotonic()
    try:
        names = update_info or {"names": ["x"], "dtype_names": ["float32"], "shapes": [[4]]}
        engine.update_weights(names)
        torch.save(dict(got), out)
    except Exception as exc:  # noqa: BLE001 - what the test reads
        Path(out).write_text(json.dumps({"error": str(exc).splitlines()[0], "after_s": time.monotonic() - started}))
    finally:
        engine.shutdown()


def started_worker(update_info: dict | None, out: Path):
    """The receiving process, its imports (vLLM's) done: a channel's rendezvous is timed from
    its opening, as a server's is (a server's workers are up long before)."""
    spawn = multiprocessing.get_context("spawn")
    ready, inbox = spawn.Event(), spawn.Queue()
    worker = spawn.Process(target=receive, args=(ready, inbox, update_info, str(out)))
    worker.start()
    deadline = time.monotonic() + 600  # vLLM's imports, on a busy machine
    while not ready.wait(0.1):
        assert worker.is_alive() and time.monotonic() < deadline, "the receiving process did not start"
    return worker, inbox


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g),
        "model.norm.weight": torch.randn(31, generator=g).to(torch.bfloat16),  # odd: misaligns what follows
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


def call(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as err:  # the service's one-line error, in the test's failure
        raise AssertionError(f"{path}: {err.code} {err.read().decode()}") from None


@pytest.mark.parametrize("wire_dtype", [None, torch.bfloat16])
def test_a_version_pushed_through_the_service_arrives_bit_for_bit(tmp_path, wire_dtype):
    # Bounds far above what a push of these tensors takes: this test is about the bytes.
    # 8 KiB buckets: the tensors travel in two (plan_buckets: [[0, 1], [2, 3, 4]])
    sender = WeightPushSender(GlooTransport(8192), timeout_s=120, push_timeout_s=240, wire_dtype=wire_dtype)
    service = PushService(sender, tmp_path / PUSH_INFO)
    try:
        assert json.loads((tmp_path / PUSH_INFO).read_text())["url"] == service.url
        sender.set_version(2, tensors().items())
        sender.set_version(1, tensors().items())  # an older version never replaces a newer one
        meta = call(service.url, "/metadata")
        assert meta["version"] == 2 and meta["names"] == list(tensors())
        update_info = {k: meta[k] for k in ("names", "dtype_names", "shapes")}
        worker, inbox = started_worker(update_info, tmp_path / "got.pt")
        inbox.put(call(service.url, "/channel", {"key": "server-0", "world_size": 2}))
        assert call(service.url, "/push", {"key": "server-0", "version": 1}) == {"version": 2}  # the newest
        worker.join(60)
        assert worker.exitcode == 0
    finally:
        service.close()
        if "worker" in locals() and worker.is_alive():
            worker.kill()
    assert not (tmp_path / PUSH_INFO).exists()
    got = torch.load(tmp_path / "got.pt")
    assert list(got) == list(tensors())
    for name, want in tensors().items():
        want = want.to(wire_dtype) if wire_dtype else want
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_a_push_to_a_server_that_never_joins_gives_up_within_the_groups_timeout():
    sender = WeightPushSender(GlooTransport(1 << 20), timeout_s=2, push_timeout_s=20)
    sender.set_version(0, tensors().items())
    sender.open_channel("server-0", 2)
    started = time.monotonic()
    with pytest.raises(torch.distributed.DistStoreError, match="wait timeout after 2000ms"):  # the rendezvous
        sender.push("server-0", 0)
    assert time.monotonic() - started < 15  # the group's timeout, not the push's
    with pytest.raises(PushError, match="no push channel"):  # dropped: the next load opens a fresh one
        sender.push("server-0", 0)
    sender.close()


def test_a_receive_whose_trainer_never_sends_gives_up_within_the_groups_timeout(tmp_path):
    sender = WeightPushSender(GlooTransport(1 << 20), timeout_s=3, push_timeout_s=20)
    sender.set_version(0, tensors().items())
    worker, inbox = started_worker(None, tmp_path / "r")
    try:
        inbox.put(sender.open_channel("server-0", 2))
        sender._channels["server-0"].group.result(timeout=60)  # joined; then nothing is sent
        worker.join(60)
        assert worker.exitcode == 0
        outcome = json.loads((tmp_path / "r").read_text())
        # gloo's own bound, not the join's: its timeout, plus the receive's imports on a busy machine
        assert "Timed out waiting 3000ms" in outcome["error"] and outcome["after_s"] < 40, outcome
    finally:
        sender.close()
        if worker.is_alive():
            worker.kill()
