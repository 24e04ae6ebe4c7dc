"""Subprocess helpers for the lock and crash tests (run as a script, not collected).

python _child.py hold PATH            open PATH as writer, print READY, sleep
python _child.py writer PATH SEED DUR append batches forever, printing ACK lines
"""

from __future__ import annotations

import os
import random
import sys
import time

from eventlog import EventLog

# Batch sizes span one event to several pages' worth, so kills land inside
# small and large commits alike.
BATCH_SIZES = (1, 1, 2, 3, 5, 8, 13, 40, 100, 300, 1000)


def hold(path: str) -> None:
    log = EventLog.open(path)
    print("READY", flush=True)
    time.sleep(3600)
    log.close()


def next_batch_id(log: EventLog) -> int:
    """Resume numbering after the last committed batch."""
    if log.last_seq == 0:
        return 0
    last = next(log.read(log.last_seq, log.last_seq))
    return last.data["b"] + 1


def writer(path: str, seed: int, durability: str) -> None:
    """Append numbered batches forever; print ACK only after commit() returned."""
    rng = random.Random(seed)
    if os.path.exists(path):
        log = EventLog.open(path, durability=durability)
    else:
        log = EventLog.create(path, meta={"seed": str(seed)}, durability=durability)
    b = next_batch_id(log)
    print("READY", flush=True)
    while True:
        n = rng.choice(BATCH_SIZES)
        for i in range(n):
            log.append("ev", {"b": b, "i": i, "n": n, "pad": "x" * rng.randint(0, 300)})
        last = log.commit()
        print(f"ACK {b} {last - n + 1} {last}", flush=True)
        if rng.random() < 0.1:
            log.save_snapshot(last, "crash-v1", os.urandom(rng.randint(1, 5000)))
        if rng.random() < 0.05:
            log.checkpoint("TRUNCATE")
        b += 1


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "hold":
        hold(sys.argv[2])
    elif cmd == "writer":
        writer(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown command {cmd}")
