"""Each episode's environment seed, a function of (rollout seed, stream, step, uid, sample index) alone.

``episode_seed`` is 63 bits of BLAKE2b of those five numbers: the same episode gets the same seed on any
rank, in any chunk and after a resume. ``seeded_globals`` seeds Python's ``random`` and NumPy's global
generator from it for the duration of a call, under one lock, so that an environment drawing from the
module-level generators (TRL's documented example does) is reset the same way every time; calls that
must be reproducible run inside it one at a time, in canonical order.
"""

from __future__ import annotations

import hashlib
import random
import threading
from contextlib import contextmanager

_GLOBALS = threading.Lock()


def episode_seed(seed: int, stream: int, step: int, uid: int, sample_index: int, purpose: str = "reset") -> int:
    """63 bits of BLAKE2b of ``"purpose:seed:stream:step:uid:sample_index"``."""
    key = f"splitproof-environment:{purpose}:{seed}:{stream}:{step}:{uid}:{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@contextmanager
def seeded_globals(seed: int):
    """``random.seed(seed)`` and ``numpy.random.seed(seed mod 2**32)`` inside the block (one block at a time
    in the process); the generators' previous states are restored after it."""
    with _GLOBALS:
        state = random.getstate()
        numpy_random = _numpy_random()
        numpy_state = numpy_random.get_state() if numpy_random is not None else None
        random.seed(seed)
        if numpy_random is not None:
            numpy_random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(state)
            if numpy_random is not None:
                numpy_random.set_state(numpy_state)


def _numpy_random():
    try:
        import numpy
    except ImportError:  # numpy is optional
        return None
    return numpy.random
