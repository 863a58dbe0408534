"""The Python examples of the README and docs/ run as printed, without a warning; the README's test command
is what CI runs."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import splitproof.loss_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS_VERL = re.compile(
    r"^\s*(from|import) verl\b", re.M
)  # run by hand in a scratch environment (verl is no dependency)


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


EXAMPLES = [
    (path, i, block) for path in DOCS for i, block in enumerate(_python_blocks(path)) if not NEEDS_VERL.search(block)
]


def test_the_examples_are_found():
    readme = [e for e in EXAMPLES if e[0].name == "README.md"]
    assert len(readme) >= 2
    skipped = [(p.name, i) for p in DOCS for i, b in enumerate(_python_blocks(p)) if NEEDS_VERL.search(b)]
    assert [name for name, _ in skipped] == ["audit-verl.md"]  # the only example that needs verl installed


@pytest.mark.parametrize("path, index, block", EXAMPLES, ids=[f"{p.name}:{i}" for p, i, _ in EXAMPLES])
def test_example_runs_clean(path, index, block, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # examples may write files (a reward file, outputs)
    monkeypatch.setattr(splitproof.loss_config, "_warned_forced", set())  # warnings said once per process: reset
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(block, f"{path.name} example {index}", "exec"), {"__name__": f"example_{index}"})
    assert [str(w.message) for w in caught] == []
    capsys.readouterr()


def test_readme_test_command_is_what_ci_runs():
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert command in (ROOT / "README.md").read_text()


def test_geo_mean_warns_only_where_the_mode_is_not_its_own(monkeypatch):
    """GMPO is a sequence mean: seq-mean-token-mean says just that; a token-level mode gets a warning."""
    monkeypatch.setattr(splitproof.loss_config, "_warned_forced", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        splitproof.LossConfig(loss_mode="geo_mean", loss_agg_mode="seq-mean-token-mean")
        assert caught == []
        splitproof.LossConfig(loss_mode="geo_mean", loss_agg_mode="token-mean")
        splitproof.LossConfig(loss_mode="geo_mean", loss_agg_mode="token-mean")  # once per (mode, aggregation)
    assert len(caught) == 1 and "applies only to the entropy and KL terms" in str(caught[0].message)
