"""An HTTP/1.1 server whose keep-alive timeout (`keep_alive_s`) always lapses just as the next
request arrives on an idle connection: a request that comes on a kept-alive connection
`keep_alive_s` or more after its previous answer is closed on, unanswered, as a real server
does when its keep-alive timer fires as a request comes in (0: at every request after a
connection's first). Every answer is `{}` with status 200, one line on stdout. A fresh
connection is always answered, so a client that counts the unanswered request as the server
down is wrong.

`python -m tests.inference.keepalive_race_server --port N` serves until killed."""

from __future__ import annotations

import argparse
import asyncio
import time


def handler(keep_alive_s: float):
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered_at: float | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if answered_at is not None and time.monotonic() - answered_at >= keep_alive_s:
                    break  # its keep-alive timer fired as this request came in
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
                answered_at = time.monotonic()
                print(f"answered {head.split(b' ', 2)[1].decode()}", flush=True)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return connection


async def serve(host: str, port: int, keep_alive_s: float) -> None:
    server = await asyncio.start_server(handler(keep_alive_s), host, port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--keep-alive-s", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.keep_alive_s))
