"""A process's exit without the interpreter's teardown, for `orch` and its trainer processes.

With torch and transformers imported, Python's teardown (garbage collections over every module's
objects) takes about a second, after the process's work is done: the orchestrator's stop waits
for it in its trainer, and the user waits for it in `orch run`. It is skipped only when nothing
else runs: no thread but daemons (a busy worker thread is waited for, as Python's own exit waits);
the atexit handlers run first and the output is flushed, so what the process wrote is all there.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Exit with `code`: at once if nothing else runs, else as `sys.exit` does."""
    main = threading.main_thread()
    if any(thread is not main and not thread.daemon and thread.is_alive() for thread in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing to keep
            stream.flush()
    os._exit(code)
