"""An HTTP/1.1 server whose keep-alive timeout always lapses just as the next request arrives on
a connection: it answers the first request of each connection (kept alive) and closes the
connection, unanswered, at its second, as a real server does when its keep-alive timer fires
as a request comes in. Each answered request is one line on stdout. A fresh connection is
always answered, so a client that counts the unanswered request as the server down is wrong.

`python -m tests.inference.keepalive_race_server --port N` serves until killed."""

from __future__ import annotations

import argparse
import asyncio


async def _connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        for answered in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            if answered:  # the kept-alive connection's second request: closed on, unanswered
                break
            path = head.split(b" ", 2)[1].decode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\n{}")
            await writer.drain()
            print(f"answered {path}", flush=True)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(host: str, port: int) -> None:
    server = await asyncio.start_server(_connection, host, port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))
