"""MKL's strict reproducibility mode: asked for when splitproof is imported, checked when a run starts.

PyTorch's x86 CPU build computes its float32 and float64 matrix products in Intel's MKL, and MKL picks a
kernel by the product's shape and by the CPU's vendor. Measured with torch 2.13 (MKL 2024.2) on MKL's
Intel code path with its AVX2 kernels (``scripts/test.sh`` runs that path on AMD CPUs too):

- a row of a plain product moved in its last bits with the number of rows in the product below 56 rows,
  at most row counts for products of fewer than 64 output columns, and at most row counts on 2 threads;
- a query row of PyTorch's CPU attention kernel moved with the padding before it (float32), so a sampled
  token's log-prob changed with the generation batch.

In MKL's strict conditional-numerical-reproducibility mode (``MKL_CBWR=AUTO,STRICT``, MKL's documented
switch for results that do not depend on the thread count) every row count from 1 to 2,048 gave each row
the same bits there, on 1 and on 2 threads, and the attention rows kept theirs. On MKL's AMD code path the
mode changes nothing of that: products keep their tile of 4 rows (``engine.row_invariant`` handles it), and
it changed no bit of the built-in model's products. Product timings with and without the mode were within
run-to-run noise on both paths.

MKL reads ``MKL_CBWR`` once, at its first call. So importing splitproof sets ``MKL_CBWR=AUTO,STRICT``
unless the environment already sets it, and :func:`strict_mode_notice` says when the mode is off: a value of
your own, or a matrix product that ran before splitproof was imported.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

VARIABLE = "MKL_CBWR"
STRICT_SETTING = "AUTO,STRICT"
STRICT_BIT = 0x10000  # MKL_CBWR_STRICT in mkl_cbwr_get's answer
ALL_SETTINGS = -1  # MKL_CBWR_ALL: the branch and the mode together
_set_here = False


def request_strict_mode() -> None:
    """``MKL_CBWR=AUTO,STRICT`` in the environment unless it holds a value already (it reaches the
    processes this one starts, torchrun's and the spawned ranks included)."""
    global _set_here
    if VARIABLE not in os.environ:
        os.environ[VARIABLE] = STRICT_SETTING
        _set_here = True


def mkl_settings() -> int | None:
    """MKL's reproducibility settings in force (``mkl_cbwr_get(MKL_CBWR_ALL)``); None without MKL."""
    import torch

    if not torch.backends.mkl.is_available():
        return None
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        mkl = ctypes.CDLL(str(library))
    except OSError:
        return None
    for name in ("mkl_cbwr_get", "mkl_serv_cbwr_get"):  # the public name, or the one torch's static MKL exports
        get = getattr(mkl, name, None)
        if get is not None:
            get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
            return int(get(ALL_SETTINGS))
    return None


def strict_mode_notice() -> str | None:
    """Why MKL's strict mode is off, or None when it is on (or there is no MKL)."""
    settings = mkl_settings()
    if settings is None or settings & STRICT_BIT:
        return None
    value = os.environ.get(VARIABLE)
    if value is not None and not _set_here and "STRICT" not in value.upper():
        cause = f"{VARIABLE}={value} (from your environment) does not ask for it"
    else:
        cause = "a matrix product ran before splitproof was imported, and MKL reads the mode at its first call"
    return (
        f"MKL's strict reproducibility mode ({VARIABLE}={STRICT_SETTING}) is off: {cause}. On CPUs where MKL "
        "takes its Intel code path, a no-grad row's bits (log-probs, values, sampled tokens) can then depend on "
        f"the micro-batch and the generation batch; set {VARIABLE}={STRICT_SETTING} before the run, or import "
        "splitproof before anything computes"
    )
