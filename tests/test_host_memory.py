"""glibc's malloc keeps freed memory during a CPU run (`rl.host_memory`): a large tensor allocated again maps
no new pages, the user's own malloc setting wins with a notice, and the defaults come back after the run."""

import resource

import pytest
import torch

from splitproof.rl.host_memory import KEY, glibc, kept_freed_memory, users_malloc_setting

needs_glibc = pytest.mark.skipif(glibc() is None, reason="mallopt is glibc's; other C libraries are left alone")
MIB_64 = 16 * 1024 * 1024  # float32 elements: 64 MiB, above glibc's largest mmap threshold (32 MiB)


def faults_of_second_allocation() -> int:
    """Page faults while a freshly allocated 64 MiB tensor is written, after one of that size was freed."""
    torch.ones(MIB_64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(MIB_64)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@needs_glibc
def test_kept_memory_is_reused_and_the_defaults_return(monkeypatch):
    for name in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    said = []
    with kept_freed_memory(True, said.append) as kept:
        assert kept and not said
        reused = faults_of_second_allocation()
    mapped_again = faults_of_second_allocation()
    assert reused < 100  # 64 MiB is 16,384 pages of 4 KiB
    assert mapped_again > 1000


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
