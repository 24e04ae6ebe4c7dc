"""A stand-in for the trainer's push side, as a process of its own: the sender and its push
service for RUN_DIR (``RUN_DIR/weights/push.json``), holding each version published there
(``weights/step_N`` with STABLE, read from its safetensors: the tensors the trainer would hand the
sender). Prints ``ready`` once the service listens; exits when its stdin closes (its test is done,
or gone).

    python -m tests.weight_push.push_trainer RUN_DIR [--transport gloo|nccl] [--dtype bfloat16]
        [--bucket-mb MB] [--timeout-s S] [--die-mid-push]

``--die-mid-push``: the process exits (as if SIGKILLed) once the first bucket of its first push
is sent, the rest never coming.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from orchestrator import rundir
from orchestrator.weight_push import PUSH_INFO
from orchestrator.weight_push.sender import PushService, WeightPushSender
from orchestrator.weight_push.transport import GlooTransport, transport_named


class DyingTransport(GlooTransport):
    def send(self, group, held) -> None:
        group.broadcast(held[0], src=0)
        os._exit(9)  # no cleanup, as under SIGKILL: push.json stays, its service is gone


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--transport", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--die-mid-push", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    sender = WeightPushSender(
        transport=DyingTransport(bucket_bytes) if args.die_mid_push else transport_named(args.transport, bucket_bytes),
        timeout_s=args.timeout_s,
        push_timeout_s=4 * args.timeout_s,
        wire_dtype=getattr(torch, args.dtype) if args.dtype else None,
    )
    root = rundir.weights_root(args.run_dir)
    root.mkdir(parents=True, exist_ok=True)
    service = PushService(sender, root / PUSH_INFO)
    stop = threading.Event()

    def watch() -> None:  # each new stable version, as the trainer would hand it over
        held = -1
        while not stop.is_set():
            for version in rundir.stable_versions(args.run_dir):
                if version > held:
                    wdir = rundir.weights_dir(args.run_dir, version)
                    tensors = {}
                    for f in sorted(wdir.glob("*.safetensors")):
                        tensors.update(load_file(f))
                    sender.set_version(version, tensors.items())
                    held = version
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    print("ready", flush=True)
    try:
        sys.stdin.read()  # until the test closes it (or dies)
    finally:
        stop.set()
        service.close()


if __name__ == "__main__":
    main()
