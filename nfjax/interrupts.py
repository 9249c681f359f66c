"""Process-level helpers shared by the commands that write files (conversion, the offload disk tier): SIGTERM
raised like Ctrl-C, removal that a second signal cannot cut short, and whether a leftover's writer still runs."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that every `finally` (temp folders, disk tiers) runs."""


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside: SIGTERM raises `Terminated` in the main thread (elsewhere: unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def rmtree_quietly(path: Path) -> None:
    """Remove `path`, with further SIGINT/SIGTERM held off (a second Ctrl-C would leave it half removed);
    retried, since a writer thread (Orbax) may still be adding files while it is removed."""
    main = threading.current_thread() is threading.main_thread()
    old = [(s, signal.signal(s, signal.SIG_IGN)) for s in (signal.SIGINT, signal.SIGTERM)] if main else []
    try:
        for _ in range(3):
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                break
            time.sleep(0.2)
    finally:
        for s, h in old:
            signal.signal(s, h)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
