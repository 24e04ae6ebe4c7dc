"""A fleet of stand-in vLLM 0.32 engines in one process, paced like GPUs: ``python -m
tests.inference.fleet_standin ENGINES SLOTS STEP_S`` prints one port per engine on a line, then serves
until killed (`fleet_process` starts and stops it). Raw HTTP/1.1 on asyncio, so that its own
cost stays well below the client's.

Each engine samples in decode steps of `STEP_S` seconds: at each step every running request (at
most `SLOTS` of them; the rest wait in arrival order, as vLLM's scheduler queues them) gains one
token, so an engine offers ``SLOTS / STEP_S`` tokens/s while it has enough requests. A request's
length is long-tailed and a function of its seed (`length_of`); its tokens name the weight
version that sampled them (`token_of`), so a client can check each token's version. Streams are
grouped as vLLM's ``stream_interval`` groups them: the first token alone, then a chunk whenever
the interval's tokens are buffered, the rest with the finish reason. vLLM's token-in, token-out
route (``/inference/v1/generate``, unstreamed, ``output_mode`` "text") answers at the end with
every token and the ``weight_versions`` spans of the labels that sampled them. The weight-sync
routes of `vllm_reload` are served: ``/pause?mode=abort`` ends every request, each with the
tokens it sampled since its last chunk (finish_reason "abort"), ``/pause?mode=keep`` freezes
them, and either admits none until ``/resume``; ``/collective_rpc`` (reload_weights of a
``step_N`` dir) moves the engine to version N; ``/update_weight_version`` labels its weights;
``/reset_prefix_cache``; ``/health``.

``GET /stats`` on any engine: every engine's counters summed (`Engine.stats`): tokens sampled,
slot-steps offered while not paused, and the bytes written but not yet read by the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import resource
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson

from tests.inference.stream_standin import ports_of_child

MODEL = "fleet-standin"
FIRST_TOKEN = 100  # token ids are FIRST_TOKEN + the sampling version


def token_of(version: int) -> int:
    return FIRST_TOKEN + version


def length_of(seed: int, max_tokens: int) -> int:
    """A completion's length: log-normal around an eighth of max_tokens (a long tail, some cut
    at max_tokens), the same for the same seed."""
    median = max(1, max_tokens // 8)
    return max(1, min(max_tokens, int(median * math.exp(1.2 * random.Random(seed).gauss(0.0, 1.0)))))


@dataclass(eq=False)
class Request:
    rid: bytes
    prompt: list[int]
    length: int
    interval: int
    writer: asyncio.StreamWriter
    done: asyncio.Event = field(default_factory=asyncio.Event)
    sampled: int = 0  # tokens sampled (each at the engine's version then)
    sent: int = 0  # tokens sent in chunks so far
    versions: list[int] = field(default_factory=list)  # the version of each token not yet sent
    cut_at_max: bool = False  # its length is max_tokens: it ends with "length", not "stop"
    streamed: bool = True  # else a generate request, answered whole at its end
    labels: list[str] = field(default_factory=list)  # generate: the weights' label at each token


class Engine:
    def __init__(self, slots: int, step_s: float):
        self.slots, self.step_s = slots, step_s
        self.version = 0
        self.label = "default"  # the weights' label (/update_weight_version), as vLLM's
        self.paused = False
        self.step = 0
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.sampled = 0  # tokens sampled in all
        self.offered = 0  # slot-steps while not paused
        self.writers: set[asyncio.StreamWriter] = set()

    async def clock(self) -> None:
        """One decode step every `step_s` (on the loop's clock, without drift)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            self.step += 1
            await asyncio.sleep(max(0.0, start + self.step * self.step_s - loop.time()))
            if not self.paused:
                self.decode_step()

    def decode_step(self) -> None:
        while len(self.running) < self.slots and self.waiting:
            self.running.append(self.waiting.popleft())
        self.offered += self.slots
        self.sampled += len(self.running)
        still = []
        for req in self.running:
            if req.writer.is_closing():  # its client is gone: vLLM aborts it
                req.done.set()
                continue
            req.sampled += 1
            req.versions.append(self.version)
            if not req.streamed:
                req.labels.append(self.label)
            if req.sampled == req.length:
                self.send(req, "length" if req.cut_at_max else "stop")
                req.done.set()
            else:
                if req.streamed and (req.sampled == 1 or req.sampled - req.sent >= req.interval):
                    self.send(req, None)
                still.append(req)
        self.running = still

    def abort_all(self) -> None:
        for req in [*self.running, *self.waiting]:
            self.send(req, "abort")
            req.done.set()
        self.running, self.waiting = [], deque()

    def send(self, req: Request, finish: str | None) -> None:
        if not req.streamed:
            self.send_generated(req, finish or "abort")
            return
        ids = [token_of(v) for v in req.versions]
        choice = {
            "index": 0,
            "text": "a" * len(ids),
            "logprobs": {
                "text_offset": list(range(req.sent, req.sent + len(ids))),
                "token_logprobs": [-0.5] * len(ids),
                "tokens": [f"token_id:{t}" for t in ids],
                "top_logprobs": None,
            },
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": req.prompt if req.sent == 0 else None,
            "token_ids": ids,
        }
        event = b'{"id":"%s","object":"text_completion","created":1,"model":"%s","choices":[%s]}' % (
            req.rid,
            MODEL.encode(),
            orjson.dumps(choice),
        )
        payload = b"data: " + event + b"\n\n"
        if finish is not None:
            payload += b"data: [DONE]\n\n"
        req.sent += len(ids)
        req.versions = []
        if not req.writer.is_closing():
            req.writer.write(b"%x\r\n%s\r\n" % (len(payload), payload) + (b"0\r\n\r\n" if finish else b""))

    def send_generated(self, req: Request, finish: str) -> None:
        """A generate request's answer, whole: its tokens and the spans of the labels that sampled them."""
        spans: list[dict] = []
        for at, label in enumerate(req.labels):
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = at + 1
            else:
                spans.append({"version": label, "start": at, "end": at + 1})
        content = [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}] * len(req.versions)
        choice = {
            "index": 0,
            "text": "a" * len(req.versions),
            "token_ids": [token_of(v) for v in req.versions],
            "logprobs": {"content": content},
            "finish_reason": finish,
            "weight_versions": spans,
        }
        answer = {"request_id": req.rid.decode(), "prompt_token_ids": req.prompt, "choices": [choice]}
        if not req.writer.is_closing():
            req.writer.write(_json(answer))

    def stats(self) -> dict:
        backlog = sum(w.transport.get_write_buffer_size() for w in self.writers if not w.is_closing())
        return {"sampled": self.sampled, "offered": self.offered, "backlog_bytes": backlog}


class Fleet:
    def __init__(self, engines: int, slots: int, step_s: float):
        self.engines = [Engine(slots, step_s) for _ in range(engines)]
        self.serial = 0

    def stats(self) -> dict:
        each = [e.stats() for e in self.engines]
        return {key: sum(s[key] for s in each) for key in each[0]}

    def handler(self, engine: Engine):
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            engine.writers.add(writer)
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    request_line, *header_lines = head.decode("latin-1").split("\r\n")
                    method, path, _ = request_line.split(" ", 2)
                    length = 0
                    for line in header_lines:
                        name, _, value = line.partition(":")
                        if name.strip().lower() == "content-length":
                            length = int(value)
                    body = await reader.readexactly(length)
                    await self.route(engine, method, path, body, writer)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                engine.writers.discard(writer)
                writer.close()

        return handle

    async def route(self, engine: Engine, method: str, path: str, body: bytes, writer) -> None:
        if path == "/v1/completions" and method == "POST":
            await self.completions(engine, orjson.loads(body), writer)
            return
        if path == "/inference/v1/generate" and method == "POST":
            await self.generate(engine, orjson.loads(body), writer)
            return
        if path.startswith("/pause"):
            engine.paused = True
            if "mode=keep" not in path:
                engine.abort_all()
        elif path == "/resume":
            engine.paused = False
        elif path == "/collective_rpc":  # reload_weights of a step_N dir: version N
            engine.version = int(orjson.loads(body)["kwargs"]["weights_path"].rsplit("_", 1)[1])
        elif path == "/update_weight_version":
            engine.label = orjson.loads(body)["new_version"]
        elif path == "/stats":
            writer.write(_json(self.stats()))
            return
        elif path.startswith("/reset_prefix_cache"):
            writer.write(_json({"success": True}))
            return
        elif path not in ("/health",):
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        writer.write(_json({}))

    async def completions(self, engine: Engine, body: dict, writer: asyncio.StreamWriter) -> None:
        assert body.get("stream") is True and body.get("n", 1) == 1, "streamed, one choice: update_mode interrupt"
        self.serial += 1
        max_tokens = body["max_tokens"]
        length = length_of(body.get("seed") or 0, max_tokens)
        interval = max(1, body.get("stream_interval") or 1)
        req = Request(
            b"cmpl-%d" % self.serial, body["prompt"], length, interval, writer, cut_at_max=length == max_tokens
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        engine.waiting.append(req)
        await req.done.wait()

    async def generate(self, engine: Engine, body: dict, writer: asyncio.StreamWriter) -> None:
        params = body["sampling_params"]
        assert params.get("n", 1) == 1, "one choice"
        self.serial += 1
        max_tokens = params["max_tokens"]
        length = length_of(params.get("seed") or 0, max_tokens)
        req = Request(
            b"gen-%d" % self.serial,
            body["token_ids"],
            length,
            1,
            writer,
            cut_at_max=length == max_tokens,
            streamed=False,
        )
        engine.waiting.append(req)
        await req.done.wait()


def _json(value: dict) -> bytes:
    answer = orjson.dumps(value)
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(answer),
        answer,
    )


def raise_open_files_limit(wanted: int = 65536) -> None:
    """A socket per request in flight: the soft limit raised as far as this process may."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):  # above the hard limit, unprivileged: keep it
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), max(hard, wanted)))
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def serve(engines: int, slots: int, step_s: float) -> None:
    fleet = Fleet(engines, slots, step_s)
    servers = [await asyncio.start_server(fleet.handler(e), "127.0.0.1", 0, backlog=4096) for e in fleet.engines]
    print(" ".join(str(s.sockets[0].getsockname()[1]) for s in servers), flush=True)
    async with asyncio.TaskGroup() as group:
        for engine in fleet.engines:
            group.create_task(engine.clock())
        for server in servers:
            group.create_task(server.serve_forever())


@contextlib.contextmanager
def fleet_process(engines: int, slots: int, step_s: float, cpu: int | None = None) -> Iterator[list[str]]:
    """The fleet in a child process (pinned to CPU `cpu` where given); yields each engine's base
    URL. Killed and waited for at the end."""
    with ports_of_child(["tests.inference.fleet_standin", str(engines), str(slots), str(step_s)], cpu) as ports:
        if len(ports) != engines:
            raise RuntimeError(f"the stand-in fleet served {len(ports)} engines, not {engines}")
        yield [f"http://127.0.0.1:{port}" for port in ports]


if __name__ == "__main__":
    raise_open_files_limit()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
