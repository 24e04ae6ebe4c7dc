"""InferenceClient against real `orch serve` apps on 127.0.0.1: routing, pinning, fallback, retries,
cancellation, health backoff, the weight-update contract."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest

from orchestrator.inference.client import (
    InferenceClient,
    InferenceError,
    InferenceRequestError,
    InferenceUnavailable,
)
from orchestrator.serve.tokenizer import encode_prompt
from tests.inference.util import SlowPolicyServer, publish, run, serving, vllm_like_app, weight_dirs

PROMPT = encode_prompt("abcd")


@pytest.fixture
def wdirs(tmp_path):
    return [str(publish(tmp_path, v)) for v in (0, 1)]


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range, so that no port-0 bind (another
    test server) and no outgoing connection can take it before a server binds it, or between a
    server's stop and its restart on the same port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except OSError:  # not Linux
        ephemeral_low = 32768
    for port in random.Random().sample(range(10_000, ephemeral_low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def ask(client, pin=None, **kw):
    return client.complete(PROMPT, max_tokens=kw.pop("max_tokens", 6), seed=kw.pop("seed", 1), pin=pin, **kw)


def test_least_loaded_routing_by_inflight_count(wdirs):
    with serving(SlowPolicyServer(0.0)) as slow, serving() as fast:

        async def main():
            async with InferenceClient([slow.base_url, fast.base_url]) as client:
                await client.load(0, wdirs[0])
                slow.policy.held.set()
                busy = asyncio.ensure_future(ask(client))  # tie -> the first endpoint, busy until released
                while client.endpoints[0].inflight < 1:
                    await asyncio.sleep(0.01)
                quick = [await ask(client, seed=s) for s in range(5)]  # each sees 1 vs 0 in flight
                assert {c.endpoint for c in quick} == {fast.base_url}
                slow.policy.held.clear()
                assert (await busy).endpoint == slow.base_url
                # idle again: equal load -> alternate by requests assigned so far
                spread = await asyncio.gather(*(ask(client, seed=s) for s in range(6)))
                return [c.endpoint for c in spread]

        ends = run(main())
        assert ends.count(slow.base_url) == 3 and ends.count(fast.base_url) == 3
        assert slow.policy.stats["completed"] == 4 and fast.policy.stats["completed"] == 8


def test_a_group_is_pinned_to_one_endpoint_and_groups_spread(wdirs):
    with serving() as a, serving() as b:

        async def main():
            async with InferenceClient([a.base_url, b.base_url]) as client:
                await client.load(0, wdirs[0])
                groups = {}
                for g in range(6):
                    done = await asyncio.gather(*(ask(client, pin=g, seed=k) for k in range(4)))
                    groups[g] = {c.endpoint for c in done}
                return groups

        groups = run(main())
        assert all(len(ends) == 1 for ends in groups.values()), groups
        assert set().union(*groups.values()) == {a.base_url, b.base_url}


def test_pinned_endpoint_down_falls_back_retries_and_repins(wdirs):
    with serving() as a, serving() as b:

        async def main():
            async with InferenceClient([a.base_url, b.base_url], backoff_s=30) as client:
                await client.load(0, wdirs[0])
                first = await ask(client, pin="g")
                dead, alive = (a, b) if first.endpoint == a.base_url else (b, a)
                dead.stop()
                moved = await ask(client, pin="g")  # same request re-sent to the other endpoint
                assert (moved.endpoint, moved.attempts, client.retries) == (alive.base_url, 2, 1)
                again = await ask(client, pin="g")  # re-pinned: no more failed attempts
                assert (again.endpoint, again.attempts, client.retries) == (alive.base_url, 1, 1)
                (status,) = [s for s in client.status() if s["url"] == dead.base_url]
                assert not status["up"] and status["failures"] == 1 and "ConnectError" in status["last_error"]
                # the same seed on the same weights gives the same sample wherever it runs
                assert moved.choices[0].token_ids == first.choices[0].token_ids

        run(main())


def test_retries_are_bounded_and_the_error_says_what_happened():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def main():
        async with InferenceClient(dead, max_attempts=3, backoff_s=0.05, connect_timeout_s=1) as client:
            with pytest.raises(InferenceUnavailable) as err:
                await ask(client)
            return str(err.value), client.retries, client.status()

    message, retries, status = run(main())
    assert message.startswith("completion failed after 3 attempt(s) on 2 endpoint(s)") and "ConnectError" in message
    # three attempts in all, then it gave up: both endpoints down, one of them probed again once
    assert retries == 2 and sorted(s["failures"] for s in status) == [1, 2] and not any(s["up"] for s in status)


def test_a_rejected_request_is_not_retried(wdirs):
    with serving() as a, serving() as b:

        async def main():
            async with InferenceClient([a.base_url, b.base_url], model="no-such-model") as client:
                await client.load(0, wdirs[0])
                with pytest.raises(InferenceRequestError, match="HTTP 404.*does not exist"):
                    await ask(client)
                assert client.retries == 0 and all(s["up"] for s in client.status())

        run(main())
        assert a.policy.stats["requests"] + b.policy.stats["requests"] == 1


def test_cancellation_propagates_drops_the_server_handler_and_is_never_retried(wdirs):
    with serving(SlowPolicyServer(30)) as slow, serving() as other:

        async def main():
            async with InferenceClient([slow.base_url, other.base_url]) as client:
                await client.load(0, wdirs[0])
                task = asyncio.ensure_future(ask(client))
                while slow.policy.stats["requests"] == 0:
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                deadline = time.monotonic() + 5
                while slow.policy.stats["disconnect_cancels"] == 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert client.retries == 0 and all(s["up"] and s["inflight"] == 0 for s in client.status())

        run(main())
        assert slow.policy.stats["disconnect_cancels"] == 1 and slow.policy.stats["completed"] == 0
        assert other.policy.stats["requests"] == 0


def test_a_down_endpoint_is_retried_after_its_backoff_and_catches_up_on_weights(wdirs):
    port = free_port()
    with serving() as b:
        a = serving(port=port)
        first = a.__enter__()
        try:

            async def phase1(client):
                await client.load(0, wdirs[0])
                first.stop()
                for s in range(3):
                    assert (await ask(client, seed=s)).endpoint == b.base_url
                assert not client.status()[0]["up"]

            async def phase2(client):
                await asyncio.sleep(0.5)  # backoff expired: the next pick probes it
                await client.load(1, wdirs[1])  # only b can confirm; a is brought up to date later
                done = [await ask(client, seed=s) for s in range(4)]
                return done

            async def main():
                async with InferenceClient([first.base_url, b.base_url], backoff_s=0.4) as client:
                    await phase1(client)
                    with serving(port=port) as restarted:  # a fresh process: no weights at all
                        done = await phase2(client)
                        assert {c.endpoint for c in done} == {first.base_url, b.base_url}
                        assert all(c.policy_start == c.policy_end == 1 for c in done)
                        assert client.status()[0]["up"] and client.status()[0]["version"] == 1
                        assert restarted.policy.stats["reloads"] == 1

            run(main())
        finally:
            a.__exit__(None, None, None)


def test_load_is_confirmed_by_every_endpoint_and_fails_only_if_none_confirms(wdirs, tmp_path):
    with serving() as a, serving() as b:

        async def main():
            async with InferenceClient([a.base_url, b.base_url, f"http://127.0.0.1:{free_port()}"]) as client:
                answers = await client.load(1, wdirs[1])
                assert answers[a.base_url] == answers[b.base_url] == 1
                assert "ConnectError" in answers[client.endpoints[2].url]
                assert (await ask(client)).policy_start == 1
                with pytest.raises(InferenceError, match="no inference endpoint confirmed weights version 5"):
                    await client.load(5, str(tmp_path / "weights" / "step_5"))

        run(main())
        assert a.policy.sampler.version == b.policy.sampler.version == 1


def test_weight_sync_none_reports_the_version_it_was_told(wdirs):
    with serving() as a:

        async def main():
            async with InferenceClient([a.base_url], weight_sync="none") as client:
                await client.load(7, "/elsewhere")  # nothing is sent
                a.policy.load_blocking(wdirs[0], 0)
                done = await ask(client)
                return done.policy_start  # orch serve still reports its own version: the truth wins

        assert run(main()) == 0
        assert a.policy.stats["reloads"] == 0


def test_sglang_weight_sync_reloads_from_disk_and_bounds_the_version():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from orchestrator.envs.server import running_server

    paths: list[str] = []

    async def update(request):
        body = await request.json()
        paths.append(body["model_path"])
        return JSONResponse({"success": not body["model_path"].endswith("bad"), "message": "ok"})

    async def completions(request):
        return JSONResponse(
            {
                "choices": [
                    {
                        "index": 0,
                        "text": "a",
                        "token_ids": [8, 2],
                        "prompt_token_ids": PROMPT,
                        "logprobs": {"token_logprobs": [-1.0, -0.5]},
                    }
                ]
            }
        )

    app = Starlette(
        routes=[
            Route("/update_weights_from_disk", update, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
    with running_server(app) as sglang:

        async def main():
            async with InferenceClient([sglang.base_url], weight_sync="sglang") as client:
                await client.load(2, "/ckpt/step_2")
                done = await ask(client)
                assert (done.policy_start, done.policy_end, done.choices[0].prompt_ids) == (2, 2, PROMPT)
                with pytest.raises(InferenceError, match="refused /ckpt/bad"):
                    await client.load(3, "/ckpt/bad")

        run(main())
    assert paths == ["/ckpt/step_2", "/ckpt/bad"]


def test_vllm_lora_an_endpoint_restarted_unseen_gets_its_adapter_again(tmp_path):
    """Found by review: it answered 404 to every request for the adapter it had lost, forever.
    (A stand-in: restarting a real vLLM server on the same port takes a minute.)"""
    from orchestrator.envs.server import running_server

    (adapter,) = weight_dirs(tmp_path, [1], lora=True)

    port, before, after = free_port(), [], []
    loop = asyncio.new_event_loop()  # one client across both server processes
    try:
        client = InferenceClient([f"http://127.0.0.1:{port}"], weight_sync="vllm_lora", backoff_s=0.05)
        with running_server(vllm_like_app(before), port=port):
            loop.run_until_complete(client.load(1, adapter))
            first = loop.run_until_complete(client.complete([1, 2], seed=1))
        with running_server(vllm_like_app(after), port=port):  # same endpoint, fresh process: no adapter
            second = loop.run_until_complete(client.complete([1, 2], seed=1))
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()
    assert (first.policy_start, first.attempts, before) == (1, 1, ["step_1"])
    assert (second.policy_start, second.attempts, client.retries) == (1, 2, 1)
    assert after == ["step_1"]  # loaded again on the restarted endpoint


def test_an_endpoint_serving_another_runs_weights_is_refused():
    """An endpoint that answers a load with another weights dir (an older `orch serve`, or one
    shared with another run) would sample from the wrong policy: the load fails at once."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def keeps_its_own(request):
        return JSONResponse({"version": 3, "requested": 0, "ignored": True, "path": "/runs/a/weights/step_3"})

    from orchestrator.envs.server import running_server

    with running_server(Starlette(routes=[Route("/update_weights", keeps_its_own, methods=["POST"])])) as server:

        async def main():
            async with InferenceClient([server.base_url]) as client:
                with pytest.raises(InferenceRequestError, match="serves /runs/a/weights/step_3, another run's weights"):
                    await client.load(0, "/runs/b/weights/step_0")

        run(main())


def test_a_failed_weight_sync_before_a_request_is_counted_once():
    async def main():
        async with InferenceClient([f"http://127.0.0.1:{free_port()}"], max_attempts=1) as client:
            client.target = (0, "/runs/a/weights/step_0")
            with pytest.raises(InferenceError):
                await ask(client)
            (status,) = client.status()
            assert status["failures"] == 1 and status["error_kinds"] == {"ConnectError /update_weights": 1}, status

    run(main())


def test_a_down_endpoint_is_probed_by_one_request_while_the_others_wait():
    """When its backoff runs out, one request probes a down endpoint; the others wait for that
    probe instead of each spending an attempt on it (which failed every waiting request)."""

    async def main():
        async with InferenceClient(
            [f"http://127.0.0.1:{free_port()}"], backoff_s=0.2, max_backoff_s=0.4, max_attempts=3
        ) as client:
            requests = [asyncio.ensure_future(ask(client)) for _ in range(20)]
            await asyncio.sleep(1.5)
            failed = sum(1 for r in requests if r.done())
            for r in requests:
                r.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
            (status,) = client.status()
            return failed, status["failures"]

    failed, attempts = run(main())
    # 20 at once, then one probe per backoff (0.2, 0.4, 0.4, ...): about 24 attempts in 1.5 s;
    # each request probing on its own would spend its 3 attempts and fail within ~0.6 s (60)
    assert attempts <= 28, attempts
    assert failed <= 3, failed  # only probers spend attempts, one at a time


def test_requests_waiting_for_a_down_endpoint_give_up_after_their_timeout():
    """The requests that wait for another's probe (not spending attempts) wait at most the
    request timeout, then fail naming each endpoint and its last error: with the only endpoint
    gone for good, a run's episodes end instead of waiting for ever."""
    url = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with InferenceClient([url], timeout_s=1.0, backoff_s=0.2, max_backoff_s=0.4, max_attempts=1000) as client:
            requests = [asyncio.ensure_future(ask(client)) for _ in range(20)]
            await asyncio.wait(requests, timeout=5)  # the prober of the moment may still be probing
            for r in requests:
                r.cancel()
            return await asyncio.gather(*requests, return_exceptions=True)

    errors = run(main())
    waited = [
        e for e in errors if isinstance(e, InferenceUnavailable) and "every inference endpoint down for" in str(e)
    ]
    assert len(waited) >= 15, errors
    assert all(f"{url}: POST {url}/v1/completions: ConnectError" in str(e) for e in waited), waited[0]


def _failing_app(bodies):
    """A real HTTP app whose completions answer HTTP 500 with the next of `bodies`."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    answers = iter(bodies)

    async def completions(request):
        return PlainTextResponse(next(answers), status_code=500)

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_the_same_http_500_twice_is_permanent_and_not_retried():
    from orchestrator.envs.server import running_server

    with running_server(_failing_app(["engine is dead"] * 20)) as server:

        async def main():
            async with InferenceClient([server.base_url], weight_sync="none", max_attempts=10, backoff_s=0.01) as c:
                await c.load(0, "/elsewhere")
                with pytest.raises(InferenceRequestError) as err:
                    await ask(c)
                return str(err.value), c.retries

        message, retries = run(main())
    assert message.endswith("HTTP 500: engine is dead (the same server error twice in a row: not retried)")
    assert retries == 1


def test_two_requests_meeting_one_transient_http_500_at_once_are_both_retried():
    """The same-error-twice rule counts per request: two requests in flight when an endpoint
    answers both with one transient 500 are each retried (one shared count failed the second)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    from orchestrator.envs.server import running_server

    arrived = 0

    async def completions(request):
        nonlocal arrived
        arrived += 1
        if arrived > 2:
            return JSONResponse(
                {"choices": [{"index": 0, "text": "x", "token_ids": [5], "logprobs": {"token_logprobs": [-0.1]}}]}
            )
        for _ in range(500):  # both in flight before either is answered (bounded: 5 s)
            if arrived >= 2:
                break
            await asyncio.sleep(0.01)
        return PlainTextResponse("engine restarting", status_code=500)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    with running_server(app) as server:

        async def main():
            async with InferenceClient([server.base_url], weight_sync="none", max_attempts=4, backoff_s=0.01) as c:
                await c.load(0, "/elsewhere")
                done = await asyncio.gather(ask(c, seed=1), ask(c, seed=2))
                return [d.attempts for d in done], c.retries

        attempts, retries = run(main())
    assert (attempts, retries) == ([2, 2], 2)


def test_server_errors_that_change_are_retried_as_before():
    from orchestrator.envs.server import running_server

    with running_server(_failing_app([f"busy {i}" for i in range(20)])) as server:

        async def main():
            async with InferenceClient([server.base_url], weight_sync="none", max_attempts=4, backoff_s=0.01) as c:
                await c.load(0, "/elsewhere")
                with pytest.raises(InferenceUnavailable, match="failed after 4 attempt"):
                    await ask(c)
                return c.retries

        assert run(main()) == 3


def _reload_standin(reloads: list[tuple[str, bool]], pause_s: float):
    """vLLM's full-weight reload routes (answers as recorded from vLLM 0.32), each
    `/collective_rpc` recorded with whether its weights dir was there when it arrived (vLLM's
    engine dies on a dir that is not); `/pause` takes `pause_s` (a slow server)."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from orchestrator.rundir import is_stable
    from tests.inference.util import recorded

    steps = {step["request"]["path"]: step for step in recorded("reload_sequence").values()}

    async def handle(request):
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if path == "/collective_rpc":
            weights = (await request.json())["kwargs"]["weights_path"]
            reloads.append((weights, is_stable(weights)))
        elif path.startswith("/pause"):
            await asyncio.sleep(pause_s)
        return Response(steps[path]["text"], status_code=steps[path]["status"], media_type="application/json")

    return Starlette(routes=[Route("/{path:path}", handle, methods=["GET", "POST"])])


def test_a_slow_servers_queued_reload_goes_to_the_newest_version_and_no_dir_is_pruned_under_a_reload(tmp_path):
    """Versions published faster than a slow server reloads, the trainer keeping 2: the slow
    server's queued loads skip to the newest version, and no reload ever reaches a server after
    its dir was pruned (the prune waits for the next publish while a load holds the versions)."""
    from orchestrator.envs.server import running_server
    from orchestrator.hf.publish import prune
    from orchestrator.rundir import is_stable, mark_stable, weights_dir

    def publish_version(version: int) -> str:
        wdir = weights_dir(tmp_path, version)
        wdir.mkdir(parents=True)
        (wdir / "config.json").write_text("{}")
        (wdir / "model.safetensors").write_bytes(b"")
        mark_stable(wdir)
        return str(wdir)

    fast, slow = [], []
    with (
        running_server(_reload_standin(fast, 0.0)) as a,
        running_server(_reload_standin(slow, 0.4)) as b,
    ):

        async def go():
            pruned = []
            async with InferenceClient([a.base_url, b.base_url], weight_sync="vllm_reload") as c:
                loads = []
                for version in range(1, 9):
                    path = publish_version(version)
                    pruned.append(prune(tmp_path, version, keep=2))
                    loads.append(asyncio.create_task(c.load(version, path)))
                    await asyncio.sleep(0.1)
                answers = await asyncio.gather(*loads)
                return pruned, answers, [e.version for e in c.endpoints]

        pruned, answers, versions = run(go())
    assert versions == [8, 8]  # both brought to the newest
    assert all(isinstance(answer[b.base_url], int) and answer[b.base_url] >= v for v, answer in enumerate(answers, 1))
    assert all(there for _path, there in fast + slow), "a reload reached a server after its dir was pruned"
    slow_versions = [int(path.rsplit("_", 1)[1]) for path, _there in slow]
    assert slow_versions == sorted(slow_versions) and slow_versions[-1] == 8 and len(slow_versions) < 8
    assert not all(pruned) and any(pruned)  # a prune waited for a reload, a later one ran
    assert prune(tmp_path, 8, keep=2) and [v for v in range(9) if is_stable(weights_dir(tmp_path, v))] == [7, 8]


def test_a_failed_episode_blames_inference_for_the_clients_errors_and_the_env_for_the_rest():
    from orchestrator.contracts import episode_error

    assert episode_error(InferenceUnavailable("all down")) == "inference: InferenceUnavailable: all down"
    assert episode_error(InferenceRequestError("HTTP 400", 400)) == "inference: InferenceRequestError: HTTP 400"
    assert episode_error(ValueError("bad grade")) == "env: ValueError: bad grade"


def test_an_eval_call_is_sampled_by_its_pinned_versions_adapter_while_the_endpoint_holds_it(tmp_path):
    """vllm_lora keeps older adapters loaded: an eval episode's request (`at_version`, through
    `complete` and through `generate`, an agent env's route) asks for its eval's version, a train
    request for the newest; a version no longer held is sampled by the newest and says so."""
    from orchestrator.envs.server import running_server

    dirs = weight_dirs(tmp_path, [1, 2, 3], lora=True)
    body = {"prompt": [1, 2], "max_tokens": 3, "logprobs": 1}
    with running_server(vllm_like_app([])) as server:

        async def main():
            async with InferenceClient([server.base_url], weight_sync="vllm_lora", max_loras=2) as client:
                await client.load(1, dirs[0])
                await client.load(2, dirs[1])
                pinned = await client.complete([1, 2], seed=1, at_version=1)
                routed = await client.generate("/v1/completions", body, at_version=1)
                newest = await client.generate("/v1/completions", body)
                await client.load(3, dirs[2])  # max_loras 2: version 1's adapter is unloaded
                gone = await client.generate("/v1/completions", body, at_version=1)
                return pinned, routed, newest, gone

        pinned, routed, newest, gone = run(main())
    assert (pinned.policy_start, pinned.policy_end) == (1, 1)
    assert (routed.policy_start, routed.answer["model"]) == (1, "step_1")
    assert (newest.policy_start, newest.answer["model"]) == (2, "step_2")
    assert (gone.policy_start, gone.answer["model"]) == (3, "step_3")
