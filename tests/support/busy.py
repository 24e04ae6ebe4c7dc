"""`make test-busy`: runs a command (`make test`) with two busy processes beside it, as a
machine that other jobs keep busy. `python3 tests/support/busy.py COMMAND...`; the exit status
is the command's (128 + N if signal N ended it).

The busy processes are killed when the command ends, however it ends (its failure, ^C); they
run in a session of their own, so ^C reaches only the command (whose own cleanup is waited
for), and each ends by itself if this process dies without its cleanup (SIGKILL)."""

from __future__ import annotations

import signal
import subprocess
import sys

BUSY_PROCESSES = 2
# at the nice level of the caller (0 from a plain shell); busy until its parent is gone
BUSY_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: busy.py COMMAND [ARG...]", file=sys.stderr)
        return 2
    # ^C reaches the command too: this process waits for its cleanup, not interrupted (a handler,
    # not SIG_IGN, which the command would inherit)
    signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True) for _ in range(BUSY_PROCESSES)]
    try:
        pids = " ".join(str(process.pid) for process in busy)
        print(
            f"busy.py: {len(busy)} busy processes (pids {pids}) beside: {' '.join(argv)}", file=sys.stderr, flush=True
        )
        status = subprocess.call(argv)
        return 128 - status if status < 0 else status  # killed by signal N: 128 + N, as a shell says
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
