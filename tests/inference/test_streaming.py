"""Streamed completions (update_mode interrupt) against a real HTTP server shaped like vLLM 0.32's
/v1/completions (`stream_standin`, in a process of its own): server-sent events split by their
own rules, the connection caps, and a stalled event loop that marks no endpoint down."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import httpx
import orjson
import pytest

from orchestrator.contracts import RunPlan
from orchestrator.inference.client import InferenceClient
from orchestrator.inference.component import OpenAIConfig
from orchestrator.inference.loop_lag import LoopLag
from orchestrator.inference.sse import EventStreamDecoder
from tests.inference.stream_standin import expected_choice, standin_process
from tests.inference.util import run

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def standin():
    with standin_process() as url:
        yield url


def streamed(url: str, **kw) -> InferenceClient:
    return InferenceClient([url], weight_sync="vllm_reload", update_mode="interrupt", **kw)


def unstreamed(url: str, **kw) -> InferenceClient:
    return InferenceClient([url], weight_sync="vllm_reload", update_mode="wait", **kw)


# -- the decoder alone ------------------------------------------------------------------------------
def feed_all(pieces: list[bytes]) -> list[bytes]:
    decoder = EventStreamDecoder()
    return [data for piece in pieces for data in decoder.feed(piece)]


def test_lines_end_at_cr_lf_and_crlf_only():
    text = '{"text":"a\u2028b\u2029c\u0085d\x0be\x1cf"}'.encode()
    for end in (b"\n", b"\r\n", b"\r"):
        stream = b"data: " + text + end + end + b"data: 2" + end + end
        assert feed_all([stream]) == [text, b"2"]
        # every byte a read of its own: multi-byte characters and CRLF split across reads
        assert feed_all([stream[i : i + 1] for i in range(len(stream))]) == [text, b"2"]


def test_events_follow_the_standard_fields_comments_and_bom():
    stream = (
        b"\xef\xbb\xbf: a comment\n"
        b"event: completion\nid: 7\nretry: 10\n"
        b"data:first\ndata: second\ndata\n\n"  # one event over three data lines; one space dropped
        b"\n\n"  # blank lines without data dispatch nothing
        b"data:  two spaces\n\n"
        b"data: never ended\n"  # no blank line before the end: dropped
    )
    expected = [b"first\nsecond\n", b" two spaces"]
    assert feed_all([stream]) == expected
    assert feed_all([stream[:1], stream[1:2], stream[2:]]) == expected  # a BOM split across reads


# -- against the stand-in server ------------------------------------------------------------------
@pytest.mark.parametrize(
    "knobs",
    [
        {},  # vLLM's own: LF line ends, one HTTP chunk per event
        {"standin_piece": 1},  # every byte its own read
        {"standin_piece": 5, "standin_line_end": "\r\n"},
        {"standin_piece": 3, "standin_line_end": "\r", "standin_data_lines": True},
        {"standin_data_lines": True, "standin_line_end": "\r\n"},
    ],
)
def test_streamed_and_unstreamed_give_the_same_choices_with_every_separator_character(standin, knobs):
    async def go():
        async with streamed(standin, stream_interval=3) as s, unstreamed(standin) as u:
            a = await s.complete(PROMPT, n=2, max_tokens=40, seed=11, extra=knobs)
            b = await u.complete(PROMPT, n=2, max_tokens=40, seed=11)
            assert s.status()[0]["failures"] == 0
            return a, b

    a, b = run(go())
    assert a.choices == b.choices
    for c, choice in enumerate(a.choices):
        ids, lps, text = expected_choice(11, c, 40)
        assert (choice.token_ids, choice.logprobs, choice.text) == (ids, lps, text)
        assert choice.prompt_ids == PROMPT and choice.finish_reason == "length"
    # the case the test is for: tokens whose text str.splitlines would break at were sampled
    sampled = "".join(choice.text for choice in a.choices)
    assert all(ch in sampled for ch in ("\u2028", "\u2029", "\u0085", "😀", "\r\n")), sampled


@pytest.mark.slow  # imports vLLM (tens of seconds)
def test_the_standin_chunks_are_vllms_own_models(standin):
    """The stand-in's chunks and answer parse as vLLM 0.32's own response models."""
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")

    async def go():
        async with httpx.AsyncClient(base_url=standin, timeout=30) as http:
            body = {"prompt": PROMPT, "n": 2, "max_tokens": 9, "seed": 3, "logprobs": 0, "return_token_ids": True}
            plain = await http.post("/v1/completions", json=body)
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True, "stream_interval": 4}) as r:
                raw = b"".join([part async for part in r.aiter_raw()])
            return plain.content, raw

    plain, raw = run(go())
    protocol.CompletionResponse.model_validate_json(plain)
    events = EventStreamDecoder().feed(raw)
    assert events[-1] == b"[DONE]"
    chunks = [protocol.CompletionStreamResponse.model_validate_json(e) for e in events[:-1]]
    # per choice: the first token alone, then 4 at a time, the rest with the finish reason
    sizes = [len(ch.choices[0].token_ids) for ch in chunks if ch.choices[0].index == 0]
    assert sizes == [1, 4, 4] and chunks[-1].choices[0].finish_reason == "length"


def test_stream_interval_is_sent_only_above_one(standin):
    async def go(interval: int) -> list:
        async with streamed(standin, stream_interval=interval) as client:
            await client._http.get(standin + "/stats")  # resets what it saw
            await client.complete([1], max_tokens=3)
            return orjson.loads((await client._http.get(standin + "/stats")).content)["intervals"]

    assert run(go(1)) == [None] and run(go(8)) == [8]


# -- connection caps --------------------------------------------------------------------------------
def test_512_streams_in_flight_reach_the_server_at_once(standin):
    """No cap set: the server sees all 512 open at once (it holds each until 512 are)."""

    async def go():
        async with streamed(standin) as client:
            got = await asyncio.gather(
                *(client.complete(PROMPT, max_tokens=4, seed=i, extra={"standin_barrier": 512}) for i in range(512))
            )
            stats = orjson.loads((await client._http.get(standin + "/stats")).content)
            return got, stats, client.status()[0]

    got, stats, status = run(go(), timeout=120)
    assert stats["most_open"] == 512
    assert [c.choices[0].token_ids for c in got] == [expected_choice(i, 0, 4)[0] for i in range(512)]
    assert status["failures"] == 0


def test_requests_cancelled_inside_the_pool_leave_no_connection_that_blocks_later_ones(standin):
    """A reload ends streams before their first token (and a drain cancels requests) wherever they
    are, inside the HTTP client's pool too (httpcore's could leave an assigned, never opened
    connection holding a slot for good, encode/httpcore#1093). Cancelled at every point of their way in, 64 at a time,
    40 times over: then 64 more all answer, none waiting for a slot until its pool timeout
    (with the leak they did: every endpoint down, a healthy one)."""

    async def go():
        async with streamed(standin, timeout_s=10) as client:
            for round_ in range(40):
                flight = [asyncio.ensure_future(client.complete(PROMPT, max_tokens=4, seed=i)) for i in range(64)]
                for _ in range(round_ % 20):  # where each is when cancelled: one more loop step each round
                    await asyncio.sleep(0)
                for request in flight:
                    request.cancel()
                await asyncio.gather(*flight, return_exceptions=True)
            got = await asyncio.gather(*(client.complete(PROMPT, max_tokens=4, seed=i) for i in range(64)))
            return got, client.status()[0], client.lag_retries

    got, status, lag_retries = run(go(), timeout=120)
    assert [c.choices[0].token_ids for c in got] == [expected_choice(i, 0, 4)[0] for i in range(64)]
    assert status["failures"] == 0 and lag_retries == 0


@pytest.mark.parametrize("cap", ["max_connections", "max_connections_per_endpoint"])
def test_a_connection_cap_holds_the_others_back_without_failing_them(standin, cap):
    async def go():
        async with streamed(standin, **{cap: 50}) as client:
            await client._http.get(standin + "/stats")  # resets its count
            got = await asyncio.gather(
                *(client.complete(PROMPT, max_tokens=30, seed=i, extra={"standin_token_s": 0.002}) for i in range(200))
            )
            stats = orjson.loads((await client._http.get(standin + "/stats")).content)
            return got, stats, client.status()[0]

    got, stats, status = run(go(), timeout=120)
    assert len(got) == 200 and status["failures"] == 0
    assert 1 <= stats["most_open"] <= 50


def test_a_cap_below_the_runs_requests_in_flight_is_warned_in_one_line(capsys):
    section = OpenAIConfig(endpoints=["http://127.0.0.1:9", "http://127.0.0.1:10"], max_connections_per_endpoint=64)
    section.check(RunPlan(envs=("e",), eval_envs=(), inference="openai", requests_in_flight=128))
    assert capsys.readouterr().err == ""
    section.check(RunPlan(envs=("e",), eval_envs=(), inference="openai", requests_in_flight=129))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "max_connections_per_endpoint allows 128" in err[0] and "129" in err[0]
    capped = OpenAIConfig(endpoints=["http://127.0.0.1:9"], max_connections=100)
    capped.check(RunPlan(envs=("e",), eval_envs=(), inference="openai", requests_in_flight=128))
    assert "inference.openai.max_connections allows 100" in capsys.readouterr().err


# -- a stalled event loop ---------------------------------------------------------------------------
def hog(seconds: float) -> None:
    """CPU-bound work on the event loop's own thread: nothing else of the loop runs meanwhile."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_loop_stalled_through_a_connect_marks_no_endpoint_down(standin, monkeypatch):
    """Each of the first connects is followed at once by 1.5 s of CPU-bound work on the loop:
    the connect finishes in the kernel within microseconds, but its 0.5 s timeout (in the loop's
    time) has run out by the time the loop looks, so the stream's HTTP client (aiohttp) raises
    its connect timeout. Those timeouts are orch's: the endpoint is not marked down, no attempt
    is spent (max_attempts 1), and every stream completes."""
    stalls = [1.5, 1.5, 1.5]
    connect = aiohttp.TCPConnector._wrap_create_connection

    async def connect_then_stall(self, *args, **kwargs):
        if stalls:
            asyncio.get_running_loop().call_soon(hog, stalls.pop())  # runs once the connect is under way
        return await connect(self, *args, **kwargs)

    monkeypatch.setattr(aiohttp.TCPConnector, "_wrap_create_connection", connect_then_stall)

    async def go():
        async with streamed(standin, connect_timeout_s=0.5, max_attempts=1) as client:
            got = await asyncio.gather(*(client.complete(PROMPT, max_tokens=50, seed=i) for i in range(16)))
            return got, client.status()[0], client.lag_retries

    got, status, lag_retries = run(go(), timeout=120)
    assert not stalls and lag_retries >= 1  # the precondition: the stalls did time connects out
    assert status["failures"] == 0 and status["up"]
    assert [c.choices[0].token_ids for c in got] == [expected_choice(i, 0, 50)[0] for i in range(16)]


def test_a_dead_endpoint_on_a_starved_loop_is_left_for_a_healthy_one(standin):
    """A pinned request's endpoint accepts connections and never answers (a listening socket no
    one accepts on: the kernel completes the handshake); the loop is starved all along (0.2 s of
    CPU-bound work every 0.3 s), so each of its 1 s timeouts held a stall and reads as orch's. The
    first is retried there, as orch's; the second counts as the endpoint's: marked down, the
    request goes to the healthy endpoint and completes, instead of failing after the bound."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead.listen(64)
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"

    async def go():
        loop = asyncio.get_running_loop()
        starving = True

        def starve():
            if starving:
                hog(0.2)
                loop.call_later(0.1, starve)

        client = InferenceClient(
            [dead_url, standin], weight_sync="vllm_reload", update_mode="interrupt", timeout_s=1.0, max_attempts=2
        )
        async with client:
            loop.call_soon(starve)
            try:
                got = await client.complete(PROMPT, max_tokens=20, seed=3, pin="group")
            finally:
                starving = False
            return got, client.status()[0], client.lag_retries

    try:
        got, status, lag_retries = run(go(), timeout=60)
    finally:
        dead.close()
    assert lag_retries == 1  # the precondition: the dead endpoint's first timeout was put down to the stall
    assert got.endpoint == standin and got.choices[0].token_ids == expected_choice(3, 0, 20)[0]
    assert status["failures"] == 1


def test_a_timeout_is_orchs_when_the_loop_stalled_through_its_window():
    async def go():
        lag = LoopLag(keep_s=10.0)
        lag.watch()
        await asyncio.sleep(0.2)
        calm = lag.caused(1.0)
        hog(0.3)
        await asyncio.sleep(0.1)  # the tick notes the stall
        stalled = lag.stalled_s(1.0), lag.caused(1.0), lag.caused(10.0)
        lag.stop()
        return calm, stalled

    calm, (stalled_s, within_1s, within_10s) = run(go())
    assert not calm
    assert 0.25 <= stalled_s <= 0.6 and within_1s and not within_10s
