"""MKL's strict reproducibility mode: importing splitproof asks for it before MKL's first product, and a run
on the CPU says when it is off (a value of the user's own, or a product that ran before the import)."""

import os
import subprocess
import sys

import pytest
import torch

from splitproof.devices import deterministic
from splitproof.mkl_mode import STRICT_BIT, STRICT_SETTING, VARIABLE, mkl_settings

pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="a torch build without MKL")

SCRIPT = """
import sys, torch
if sys.argv[1] == "product first":
    torch.ones(8, 8) @ torch.ones(8, 8)
import os
from splitproof.devices import deterministic
from splitproof.mkl_mode import mkl_settings
torch.ones(8, 8) @ torch.ones(8, 8)
print(os.environ.get("MKL_CBWR"), hex(mkl_settings()), deterministic("cpu"), sep="|")
"""


def _run(case: str, **env) -> list[str]:
    environment = {k: v for k, v in os.environ.items() if k != VARIABLE} | env
    run = subprocess.run([sys.executable, "-c", SCRIPT, case], env=environment, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().split("|")


def test_this_process_runs_mkl_in_strict_mode():
    assert os.environ[VARIABLE] == STRICT_SETTING
    assert mkl_settings() & STRICT_BIT
    assert deterministic("cpu") is None


def test_importing_splitproof_first_sets_the_mode_and_says_nothing():
    value, settings, notice = _run("import first")
    assert value == STRICT_SETTING and int(settings, 16) & STRICT_BIT and notice == "None"


def test_a_product_before_the_import_is_named_in_the_notice():
    value, settings, notice = _run("product first")
    assert not int(settings, 16) & STRICT_BIT
    assert "a matrix product ran before splitproof was imported" in notice and STRICT_SETTING in notice


def test_a_value_of_the_users_own_is_kept_and_named():
    value, settings, notice = _run("import first", MKL_CBWR="AVX2")
    assert value == "AVX2" and not int(settings, 16) & STRICT_BIT
    assert "MKL_CBWR=AVX2 (from your environment) does not ask for it" in notice
    assert _run("import first", MKL_CBWR="AVX2,STRICT")[2] == "None"  # the user's own strict mode is enough
