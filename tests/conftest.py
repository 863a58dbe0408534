import importlib.util
import os

import pytest
import torch
from hypothesis import settings

from splitproof.loss_config import AGG_MODES, LOSS_MODES

settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)  # tiny models: one thread is fastest and keeps runs bitwise repeatable

# Fixtures whose setup is slow: every benchmark script in --quick mode (tests/test_benchmarks_smoke.py).
SLOW_FIXTURES = {"results"}


def on_the_diagonal(loss_mode: str, agg_mode: str) -> bool:
    """One aggregation mode per loss mode, cycling through them: every loss and every aggregation is kept."""
    return AGG_MODES.index(agg_mode) == LOSS_MODES.index(loss_mode) % len(AGG_MODES)


VLLM_REQUIRED = "SPLITPROOF_REQUIRE_VLLM"  # set by .ci/run's vLLM lane: a missing vLLM fails the run there


def skip_or_fail_without_vllm(items) -> None:
    """Tests marked ``vllm`` are skipped where vLLM is not installed (the main environment), unless
    $SPLITPROOF_REQUIRE_VLLM is 1 (the vLLM lane): then a missing vLLM stops the run."""
    wanted = [item for item in items if item.get_closest_marker("vllm")]
    if not wanted or importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get(VLLM_REQUIRED) == "1":
        raise pytest.UsageError(f"{len(wanted)} tests marked vllm, and vLLM is not installed ({VLLM_REQUIRED}=1)")
    for item in wanted:
        item.add_marker(pytest.mark.skip(reason="vLLM is not installed: .ci/run's vLLM lane runs these"))


def pytest_collection_modifyitems(config, items):
    """``slow`` (left out by ``-m "not slow"``, run by the plain ``pytest`` of CI): every multi-process test
    (``dist``), the cases of a loss-mode x aggregation-mode sweep off the diagonal, and the tests that need
    a slow fixture."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        sweep_case = "loss_mode" in params and "agg_mode" in params
        if (
            item.get_closest_marker("dist")
            or (sweep_case and not on_the_diagonal(params["loss_mode"], params["agg_mode"]))
            or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.slow)
    skip_or_fail_without_vllm(items)
