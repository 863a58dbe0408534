"""Named points where a training process can be told to stop and wait, so that a test can kill it there.

Off unless ``SPLITPROOF_PAUSE_AT`` is set. When a process reaches the point it names (``step3:trained``,
``step4:checkpoint:actor``, ...; ``SPLITPROOF_PAUSE_RANK`` picks one rank under torchrun, default 0), it
writes ``"<pid> <point>"`` to the file ``SPLITPROOF_PAUSE_FILE`` and sleeps until it is killed. The
points the loop offers are listed in ``splitproof/rl/loop.py``.
"""

from __future__ import annotations

import os
import time

PAUSE_AT = "SPLITPROOF_PAUSE_AT"
PAUSE_FILE = "SPLITPROOF_PAUSE_FILE"
PAUSE_RANK = "SPLITPROOF_PAUSE_RANK"


def enabled() -> bool:
    return bool(os.environ.get(PAUSE_AT))


def pause_point(name: str) -> None:
    """Wait here forever when ``SPLITPROOF_PAUSE_AT`` names this point on this rank; otherwise return."""
    if os.environ.get(PAUSE_AT) != name or os.environ.get("RANK", "0") != os.environ.get(PAUSE_RANK, "0"):
        return
    marker = os.environ.get(PAUSE_FILE)
    if marker:
        tmp = f"{marker}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()} {name}\n")
        os.replace(tmp, marker)
    while True:
        time.sleep(3600)
