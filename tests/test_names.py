"""Names across the package: no private name imported from another module, and every module the docs and the
package's docstrings and comments name exists.

Read from the files (``ast`` and text), nothing imported: a name resolves when a file of the tree has that path,
or a module of the package has that dotted name, or that module defines (or imports) the attribute named."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "splitproof"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TREE_FILES = {
    p.relative_to(ROOT).as_posix()
    for d in ("splitproof", "tests", "benchmarks", "scripts", "examples", "docs", ".ci")
    for p in (ROOT / d).rglob("*")
    if p.is_file()
}
TREE_FILES |= {p.name for p in ROOT.iterdir() if p.is_file()}


def _module_name(path: Path) -> str:
    parts = ["splitproof", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _top_level_names(path: Path) -> set[str]:
    """What ``from module import X`` can take: definitions, assignments, imports, submodules."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if "__all__" in names and isinstance(node.value, (ast.List, ast.Tuple)):  # lazy exports (__getattr__)
                names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


NAMES = {name: _top_level_names(path) for name, path in MODULES.items()}


# ---------------------------------------------------------------------------------------- private imports


def _private_imports(name: str, path: Path) -> list[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != "splitproof":
            continue
        found += [
            f"{path.relative_to(ROOT)}:{node.lineno}: from {source} import {a.name}"
            for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")
        ]
    return found


def test_no_private_name_is_imported_from_another_module():
    """``from .x import _y`` / ``from splitproof.x import _y``: make ``_y`` public where it lives instead
    (``import x as _y``, a private alias of a public name, is fine)."""
    found = [line for name, path in sorted(MODULES.items()) for line in _private_imports(name, path)]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_the_private_import_check_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    path = PACKAGE / "engine" / "x.py"  # never written: the check reads the source given below
    source = "from .logprobs import _a, b\nfrom splitproof.loss_config import _c\nimport torch as _t\n"
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: source)
    assert [line.split(": ", 1)[1] for line in _private_imports("splitproof.engine.x", path)] == [
        "from splitproof.engine.logprobs import _a",
        "from splitproof.loss_config import _c",
    ]


# ---------------------------------------------------------------------------------------- names in the docs

# a path with at least one folder (``rl/x.py``, ``splitproof/x/y.py``, ``docs/x.md``); bare file names are often
# the user's own (``my_reward.py``), placeholders (``path/to/file.py``, ``benchmarks/NAME.py``) are left out
PATH = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)+[A-Za-z_][\w-]*\.(?:py|md|yaml|sh|toml))\b")
PLACEHOLDER = re.compile(r"(^|/)path/to/|(^|/)[A-Z_]+\.\w+$")
DOTTED = re.compile(r"(?<![\w./-])(splitproof(?:\.[A-Za-z_]\w*)+)")
URL = re.compile(r"\w+://\S+")


def _path_exists(path: str) -> bool:
    """A path names a file of the tree: from the repository's root, or as the tail of a file's path (``rl/x.py``
    relative to the package, ``x.py`` beside the text that names it)."""
    path = path.removeprefix("./")
    return path in TREE_FILES or any(f.endswith("/" + path) for f in TREE_FILES)


def _dotted_exists(dotted: str) -> bool:
    """``splitproof.a.b.C.d``: the longest prefix that is a module, then an attribute it defines; further
    parts (a class's members) are not followed."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in MODULES:
            return cut == len(parts) or parts[cut] in NAMES[module] or f"{module}.{parts[cut]}" in MODULES
    return False


def _code_names() -> set[str]:
    """Every identifier the code of the tree uses or defines (variables, arguments, attributes, imports)."""
    names: set[str] = set()
    for tree in ("splitproof", "tests", "benchmarks", "scripts", "examples"):
        for path in (ROOT / tree).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Name):
                    names.add(node.id)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.alias):
                    names |= set(node.name.split(".")) | ({node.asname} if node.asname else set())
    return names


CODE_NAMES = _code_names()
# names the docs quote from verl and OmegaConf, not modules of this package
EXTERNAL = {"ray_trainer", "core_algos", "overlong_buffer_cfg", "oc"}
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "txt", "sh", "toml", "pt", "png", "parquet", "safetensors"}
STEMS: dict[str, list[str]] = {}
for _name in MODULES:
    STEMS.setdefault(_name.rsplit(".", 1)[-1], []).append(_name)
# ``module.attribute`` in backticks, the module named by its own name (``engine.compute_log_probs``)
QUALIFIED = re.compile(r"`+([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)[(`]")
# ... and, outside backticks, ``snake_case_module.name`` (a first part with an underscore, as module names have)
SNAKE_QUALIFIED = re.compile(r"(?<![\w.`/])([a-z]\w*_\w*\.[a-z_]\w*)\b")


def _qualified_exists(dotted: str) -> bool:
    """``a.b``: ``a`` a module of the package, or a name the code knows (a variable, an import, an attribute,
    a config section). Only the first part is checked: ``data.train_batch_size`` is a config key, not a module's
    attribute."""
    first = dotted.split(".")[0]
    return first in STEMS or first in CODE_NAMES or first in EXTERNAL or dotted.rsplit(".", 1)[-1] in FILE_SUFFIXES


def _texts() -> list[tuple[str, str]]:
    """(where, text): every doc page, and the docstrings and comments of every module of the package."""
    out = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in DOCS]
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        where = str(path.relative_to(ROOT))
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    out.append((f"{where}:{node.body[0].lineno}", doc))
        for number, line in enumerate(source.splitlines(), 1):
            if "#" in line:
                out.append((f"{where}:{number}", line[line.index("#") :]))
    return out


def _missing_names(where: str, text: str) -> list[str]:
    text = URL.sub(" ", text)
    missing = [f"{where}: {m}" for m in PATH.findall(text) if not PLACEHOLDER.search(m) and not _path_exists(m)]
    missing += [f"{where}: {m}" for m in DOTTED.findall(text) if not _dotted_exists(m.rstrip("."))]
    missing += [
        f"{where}: {m}" for m in QUALIFIED.findall(text) + SNAKE_QUALIFIED.findall(text) if not _qualified_exists(m)
    ]
    return missing


def test_the_docs_and_docstrings_name_only_modules_that_exist():
    missing = [line for where, text in _texts() for line in _missing_names(where, text)]
    assert not missing, "names of modules or files that do not exist:\n" + "\n".join(missing)


def test_the_name_check_resolves_and_refuses():
    assert _path_exists("splitproof/engine/update.py") and _path_exists("engine/update.py")
    assert _path_exists("tests/test_names.py") and _path_exists("pyproject.toml")
    assert not _path_exists("rl/config_load.py") and not _path_exists("splitproof/reference.py")
    assert _dotted_exists("splitproof.engine") and _dotted_exists("splitproof.oracle.oracle_objective")
    assert _dotted_exists("splitproof.loss_config.LossConfig.replace")
    assert not _dotted_exists("splitproof.reference") and not _dotted_exists("splitproof.oracle.no_such_name")
    assert _missing_names(
        "x", "see `splitproof.nope.f` and `rl/nope.py`, not https://a.b/c.py, `my_reward.py` or `path/to/file.py`"
    ) == ["x: rl/nope.py", "x: splitproof.nope.f"]
    assert _missing_names(
        "x",
        "``engine.compute_log_probs``, `data.train_batch_size`, ``config_verl.NO_EFFECT``, "
        "see config_check.combine_grad_clip",
    ) == ["x: config_verl.NO_EFFECT", "x: config_check.combine_grad_clip"]
