"""The package's import graph: no cycle, and each layer imports only the layers below it.

Every import counts, a function-level one included: a lazy import is still a dependency."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "splitproof"

# a module's layer is its first-level name under splitproof/ (a core module is its own name)
CORE = {
    "batch",
    "batch_error",
    "sequences",
    "flat_rows",
    "stats",
    "aggregation",
    "losses",
    "selection",
    "policy_objective",
    "value_objective",
    "oracle",
    "collective",
    "devices",
    "loss_config",
    "hf_models",
    "value_model",
    "builtin",
    "lora",
    "lora_settings",
    "mkl_mode",
}
LOWER = {"engine": CORE | {"engine"}, "advantages": CORE | {"advantages"}}
LOWER["rl"] = CORE | {"engine", "advantages", "rl"}
LOWER["diagnose"] = CORE | {"engine", "advantages", "diagnose"}
LOWER["cli"] = CORE | {"engine", "advantages", "rl", "diagnose", "cli"}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["splitproof", *path.relative_to(PACKAGE).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    path, is_package = MODULES[name]
    package = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> str:
    return name.split(".")[1] if name != "splitproof" else "splitproof"


def test_no_import_cycle():
    """Depth-first search over module → imported module (a package importing its own submodule is not a cycle)."""
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if MODULES[name][1] and dep.startswith(name + "."):
                continue
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep] if dep in path else [name, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("layer", sorted(LOWER) + ["core"])
def test_layers_import_only_downwards(layer):
    allowed = CORE if layer == "core" else LOWER[layer]
    members = [m for m in GRAPH if _layer(m) in (CORE if layer == "core" else {layer})]
    assert members
    wrong = sorted(f"{m} -> {d}" for m in members for d in GRAPH[m] if _layer(d) not in allowed and d != "splitproof")
    assert not wrong, f"{layer} imports a layer above it: {wrong}"


def test_no_module_name_means_two_things():
    """A module's file name is unique in the package, apart from ``__init__`` and ``__main__``, and the
    command's modules named after the subcommand they parse (``cli/train.py`` starts ``rl/train.py``'s run)."""
    seen: dict[str, list[str]] = {}
    for name, (path, is_package) in MODULES.items():
        subcommand = name.startswith("splitproof.cli.") and path.stem in ("train", "diagnose")
        if not is_package and path.stem != "__main__" and not subcommand:
            seen.setdefault(path.stem, []).append(name)
    clashes = {stem: names for stem, names in seen.items() if len(names) > 1}
    assert not clashes
