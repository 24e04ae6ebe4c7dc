"""A stand-in for vLLM 0.32's ``/v1/completions`` that streams as fast as it can, in a process of
its own: ``python -m tests.inference.stream_standin`` prints its port, then serves until killed
(`standin_process` starts and stops it). Raw HTTP/1.1 on asyncio (keep-alive, chunked bodies),
so that its own cost stays far below the client's.

Its chunks are shaped as vLLM 0.32 serializes its ``CompletionStreamResponse`` (``exclude_unset``;
UTF-8 as it is: U+2028, U+2029 and U+0085 unescaped), its unstreamed answer as its
``CompletionResponse``, and it groups tokens per chunk as vLLM's ``stream_interval`` does (the
first token alone, then groups of the interval, the rest with the finish reason). Its tokens are
a function of the seed, choice and position (`token_of`): a test knows each choice in advance.
Its vocabulary holds U+2028, U+2029, U+0085, multi-byte characters and an emoji.

Knobs a request may carry besides vLLM's fields (a test's own, never sent by orch):
``standin_piece`` (send each event as HTTP chunks of this many bytes, so that a character or a
CRLF is split across reads), ``standin_line_end`` ("\\n", "\\r\\n" or "\\r"),
``standin_data_lines`` (each event's JSON over several ``data:`` lines), ``standin_token_s`` (a
pause before each chunk), ``standin_barrier`` (hold every such request until this many are open
at once, at most 60 s). ``GET /stats``: the most requests it had open at once and each streamed
request's ``stream_interval`` field since the last ``/stats``, and resets both.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator

import orjson

VOCAB = ["a", " the", "\u2028", "é", "\u2029", "中文", "\u0085", "😀", "x\r\ny", " word", "\n", "ß"]
MODEL = "standin"
BARRIER_S = 60.0


def token_of(seed: int, choice: int, position: int) -> int:
    return (seed * 7919 + choice * 104729 + position * 31) % len(VOCAB)


def logprob_of(token: int) -> float:
    return -0.125 * (token + 1)


def expected_choice(seed: int, choice: int, length: int) -> tuple[list[int], list[float], str]:
    """The token ids, logprobs and text of a choice the stand-in samples."""
    ids = [token_of(seed, choice, i) for i in range(length)]
    return ids, [logprob_of(t) for t in ids], "".join(VOCAB[t] for t in ids)


def _logprobs(ids: list[int], offset: int) -> dict:
    offsets, tokens, lps = [], [], []
    for token in ids:
        offsets.append(offset)
        offset += len(VOCAB[token])
        tokens.append(f"token_id:{token}")
        lps.append(logprob_of(token))
    return {
        "text_offset": offsets,
        "token_logprobs": lps,
        "tokens": tokens,
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)],
    }


class Standin:
    def __init__(self) -> None:
        self.open = 0
        self.most_open = 0
        self.enough = asyncio.Event()  # standin_barrier: set once that many requests are open
        self.serial = 0
        self.intervals: list[int | None] = []  # each streamed request's stream_interval field (None: absent)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if path == "/stats" and method == "GET":
                    answer = orjson.dumps({"most_open": self.most_open, "intervals": self.intervals})
                    self.most_open, self.intervals = self.open, []
                    writer.write(_response_head(len(answer)) + answer)
                elif path == "/v1/completions" and method == "POST":
                    await self.completions(orjson.loads(body), writer)
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def completions(self, body: dict, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            barrier = body.get("standin_barrier")
            if barrier:
                if self.open >= barrier:
                    self.enough.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.enough.wait(), BARRIER_S)
            self.serial += 1
            seed, n, length = body.get("seed", 0), body.get("n", 1), body["max_tokens"]
            prompt, rid = body["prompt"], f"cmpl-standin{self.serial}"
            if not body.get("stream"):
                choices = []
                for c in range(n):
                    ids, _lps, text = expected_choice(seed, c, length)
                    choices.append(
                        {
                            "index": c,
                            "text": text,
                            "logprobs": _logprobs(ids, 0),
                            "finish_reason": "length",
                            "stop_reason": None,
                            "token_ids": ids,
                            "prompt_logprobs": None,
                            "prompt_token_ids": prompt,
                        }
                    )
                answer = orjson.dumps(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": 1,
                        "model": MODEL,
                        "choices": choices,
                        "service_tier": None,
                        "system_fingerprint": None,
                        "usage": {
                            "prompt_tokens": len(prompt),
                            "total_tokens": len(prompt) + n * length,
                            "completion_tokens": n * length,
                            "prompt_tokens_details": None,
                        },
                        "kv_transfer_params": None,
                    }
                )
                writer.write(_response_head(len(answer)) + answer)
                return
            await self.stream(body, rid, seed, n, length, prompt, writer)
        finally:
            self.open -= 1
            if self.open == 0:
                self.enough.clear()

    async def stream(self, body: dict, rid: str, seed: int, n: int, length: int, prompt: list, writer) -> None:
        self.intervals.append(body.get("stream_interval"))
        interval = max(1, body.get("stream_interval") or 1)
        piece, pause = body.get("standin_piece"), body.get("standin_token_s")
        line_end = body.get("standin_line_end", "\n").encode()
        data_lines = body.get("standin_data_lines", False)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        head = b'{"id":"%s","object":"text_completion","created":1,"model":"%s","choices":[' % (
            rid.encode(),
            MODEL.encode(),
        )
        # vLLM's groups: the first token alone, then `interval` at a time, the rest with the end
        bounds = [0, 1, *range(1 + interval, length, interval), length] if length > 1 else [0, length]
        texts = [0] * n
        for g in range(len(bounds) - 1):
            for c in range(n):
                ids = [token_of(seed, c, i) for i in range(bounds[g], bounds[g + 1])]
                text = "".join(VOCAB[t] for t in ids)
                choice = {
                    "index": c,
                    "text": text,
                    "logprobs": _logprobs(ids, texts[c]),
                    "finish_reason": "length" if bounds[g + 1] == length else None,
                    "stop_reason": None,
                    "prompt_token_ids": prompt if g == 0 else None,
                    "token_ids": ids,
                }
                texts[c] += len(text)
                event = head + orjson.dumps(choice) + b"]}"
                if pause:
                    await asyncio.sleep(pause)
                self.send_event(writer, event, line_end, data_lines, piece)
            await writer.drain()
        self.send_event(writer, b"[DONE]", line_end, False, piece)
        writer.write(b"0\r\n\r\n")

    @staticmethod
    def send_event(writer, data: bytes, line_end: bytes, data_lines: bool, piece: int | None) -> None:
        if data_lines and data != b"[DONE]":
            lines = orjson.dumps(orjson.loads(data), option=orjson.OPT_INDENT_2).split(b"\n")
        else:
            lines = [data]
        event = b"".join(b"data: " + line + line_end for line in lines) + line_end
        step = piece or len(event)
        for at in range(0, len(event), step):
            part = event[at : at + step]
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))


def _response_head(length: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % length


async def serve() -> None:
    standin = Standin()
    server = await asyncio.start_server(standin.handle, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def ports_of_child(module_args: list[str], cpu: int | None = None) -> Iterator[list[str]]:
    """``python -m MODULE ARGS`` in a child process (pinned to CPU `cpu` where given) that prints
    the ports it serves on one line first; yields them. Killed and waited for at the end."""
    command = [sys.executable, "-m", *module_args]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        ports = process.stdout.readline().split()  # bounded: the child prints them or dies (EOF)
        if not ports or not all(port.isdigit() for port in ports):
            raise RuntimeError(f"{module_args[0]} did not start (exit {process.poll()})")
        yield ports
    finally:
        process.kill()
        process.wait(10)


@contextlib.contextmanager
def standin_process(cpu: int | None = None) -> Iterator[str]:
    """The stand-in in a child process (pinned to CPU `cpu` where given); yields its base URL."""
    with ports_of_child(["tests.inference.stream_standin"], cpu) as ports:
        yield f"http://127.0.0.1:{ports[0]}"


if __name__ == "__main__":
    asyncio.run(serve())
