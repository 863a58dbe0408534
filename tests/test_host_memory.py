"""glibc's malloc keeps freed memory during a CPU run (`rl.host_memory`): a large tensor allocated again maps
no new pages, the user's own malloc setting wins with a notice, and the defaults come back after the run."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitproof.rl.host_memory import KEY, glibc, kept_freed_memory, users_malloc_setting

needs_glibc = pytest.mark.skipif(glibc() is None, reason="mallopt is glibc's; other C libraries are left alone")
MIB = 256 * 1024  # float32 elements per MiB


def faults_of_second_allocation() -> int:
    """Page faults while a new 60 MiB tensor is written, after a 64 MiB one was freed (both above glibc's
    largest mmap threshold, 32 MiB). The second is smaller: glibc's aligned allocation (torch's) asks for a
    little more than the tensor, so a freed block of the same size would not serve it."""
    torch.ones(64 * MIB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(60 * MIB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@needs_glibc
def test_kept_memory_is_reused_and_the_defaults_return():
    """In a fresh process: a heap that earlier tests fragmented (and ``malloc_trim`` emptied of pages) could
    hand the second tensor another free block whose pages are gone."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from test_host_memory import faults_of_second_allocation\n"
        "from splitproof.rl.host_memory import kept_freed_memory\n"
        "with kept_freed_memory(True, print) as kept:\n"
        "    reused = faults_of_second_allocation()\n"
        "print(kept, reused, faults_of_second_allocation())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True, text=True, env=env, check=True
    )
    kept, reused, mapped_again = done.stdout.split()
    assert kept == "True"
    assert int(reused) < 100  # 60 MiB is 15,360 pages of 4 KiB
    assert int(mapped_again) > 1000


@needs_glibc
def test_the_users_malloc_setting_wins_with_a_notice(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    said = []
    with kept_freed_memory(True, said.append) as kept:
        assert not kept
        assert faults_of_second_allocation() > 1000
    assert said == [
        f"notice: {KEY}=true is not applied: your environment sets MALLOC_MMAP_MAX_=65536, which glibc's malloc follows"
    ]


def test_off_does_nothing():
    said = []
    with kept_freed_memory(False, said.append) as kept:
        assert not kept
    assert not said


@pytest.mark.parametrize(
    "environ, found",
    [
        ({}, None),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_=0"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, "GLIBC_TUNABLES=glibc.malloc.mmap_max=0"),
        ({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, None),
    ],
)
def test_users_malloc_setting(environ, found):
    assert users_malloc_setting(environ) == found


@needs_glibc
def test_train_says_so_before_its_first_error(monkeypatch, tmp_path):
    """`splitproof train`'s entry applies the setting on a CPU run (the notice comes first, even from a run
    that stops at its input check)."""
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.train import SetupError, train

    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")
    cfg = load_train_config(None, [f"data.train_files={tmp_path / 'missing.jsonl'}"])
    said = []
    with pytest.raises(SetupError, match="missing.jsonl"):
        train(cfg, on_message=said.append)
    assert said == [
        f"notice: {KEY}=true is not applied: your environment sets MALLOC_TOP_PAD_=0, which glibc's malloc follows"
    ]
