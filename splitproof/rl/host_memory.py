"""glibc's malloc during a CPU run: freed memory kept in the process for the next allocation.

glibc serves a request above its mmap threshold (which adapts, up to 32 MiB) with pages mapped for it
alone and unmaps them when the block is freed. So each large tensor is paged in again every time it is
allocated: one page fault per 4 KiB, and the kernel zeroes every page. On a model with a large vocabulary
that happens in every micro-batch: the logits, and the tied embedding's two gradients (113 MB each for
SmolLM2-135M). Measured on SmolLM2-135M's update (32 sequences in 4 micro-batches, one thread, an Intel
Xeon): 0.8 M page faults and 15.2-15.4 s per update; with the settings below, 0-4 faults and 13.1-13.5 s
once the heap has grown to the run's peak (docs/train.md).

``M_MMAP_MAX=0`` serves every block from the heap and ``M_TRIM_THRESHOLD=-1`` keeps the freed heap mapped,
so the next micro-batch reuses pages that are already there. The process holds on to its peak memory for
the run; after the run the defaults come back and the free memory is returned (``malloc_trim``).
Allocation never changes a computed bit.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager

KEY = "trainer.cpu_keep_freed_memory"
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)
KEEP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: -1}  # -1: never trim (mallopt(3))
GLIBC_DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}
USER_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def users_malloc_setting(environ=os.environ) -> str | None:
    """The first of glibc's malloc settings that the environment sets, as NAME=value (None: none)."""
    for name in USER_VARIABLES:
        if name in environ:
            return f"{name}={environ[name]}"
    tunables = environ.get("GLIBC_TUNABLES", "")
    return f"GLIBC_TUNABLES={tunables}" if "glibc.malloc." in tunables else None


def glibc():
    """This process's C library when it is glibc with ``mallopt`` and ``malloc_trim`` (else None)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@contextmanager
def kept_freed_memory(enabled: bool, say: Callable[[str], None] | None) -> Iterator[bool]:
    """glibc's malloc keeps freed memory for the run when ``enabled`` (yields whether it does); a setting of
    the user's own in the environment wins, with a notice to ``say``."""
    libc = glibc() if enabled else None
    own = users_malloc_setting() if libc else None
    if own:
        if say is not None:
            say(f"notice: {KEY}=true is not applied: your environment sets {own}, which glibc's malloc follows")
        libc = None
    if libc is not None:
        for parameter, value in KEEP.items():
            libc.mallopt(parameter, value)
    try:
        yield libc is not None
    finally:
        if libc is not None:
            for parameter, value in GLIBC_DEFAULTS.items():
                libc.mallopt(parameter, value)
            libc.malloc_trim(0)
