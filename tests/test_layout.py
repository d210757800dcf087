"""The package's import graph: subpackages import only from their own level or below, and no module
imports a private name of another module (README "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_tree"
LEVELS = {"utils": 0, "core": 1, "models": 2, "decoding": 3, "data": 3, "training": 4, "bench": 4, "reference": 4,
          "commands": 5, "cli": 6, "__init__": 6}


def _imports(path: Path):
    """(line, module, names) of every eagle_tree import in a file, lazy ones included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle_tree"):
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("eagle_tree."):
                    yield node.lineno, alias.name, []


def _level(module_parts: list[str]) -> int:
    return LEVELS[module_parts[0] if module_parts else "__init__"]


def _files():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_file_belongs_to_a_known_level():
    for path in _files():
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        assert parts[0] in LEVELS, f"{path}: put new modules in one of {sorted(LEVELS)}"


def test_imports_go_downwards_only():
    bad = []
    for path in _files():
        here = _level(list(path.relative_to(PACKAGE).with_suffix("").parts))
        for line, module, _ in _imports(path):
            parts = module.split(".")[1:]
            if parts and _level(parts) > here:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not bad, "imports that go up the layout:\n" + "\n".join(bad)


def _folder_imports(path: Path, here: tuple[str, ...] | None = None) -> list[tuple[int, str]]:
    """(line, folder) of every import of another folder at the same level (lazy ones included); ``here``:
    the module's place in the package (default: from ``path``)."""
    here = here or path.relative_to(PACKAGE).with_suffix("").parts
    out = []
    for line, module, _ in _imports(path):
        parts = module.split(".")[1:]
        if parts and parts[0] != here[0] and len(here) > 1 and _level(parts) == _level(list(here)):
            out.append((line, parts[0]))
    return out


def test_folders_of_one_level_do_not_import_each_other():
    """training, bench and reference (level 4), decoding and data (level 3) are siblings: what two of them
    share lives a level lower (the toy target, the corpus and the row reader in data/)."""
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports eagle_tree.{folder}"
           for path in _files() for line, folder in _folder_imports(path)]
    assert not bad, "imports between sibling folders:\n" + "\n".join(bad)


def test_the_checker_sees_a_sibling_import(tmp_path):
    """Negative control: a lazy import of reference from a training module is found, one of data is not."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from eagle_tree.reference.builder import x\n    from eagle_tree.data.toy import y\n")
    assert _folder_imports(f, here=("training", "m")) == [(2, "reference")]


def test_no_private_names_imported_across_modules():
    bad = []
    for path in _files():
        for line, module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {private} from {module}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_an_upward_import(tmp_path):
    """Negative control: the walker finds lazy (function-level) imports."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from eagle_tree.commands.bench import main\n")
    assert [m for _, m, _ in _imports(f)] == ["eagle_tree.commands.bench"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _files()}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for _, module, names in _imports(path):
            for candidate in [f"{module}.{n}" for n in names] + [module]:
                if candidate in modules and candidate != name and not candidate.endswith("__init__"):
                    targets.add(candidate)
                    break
        graph[name] = {t for t in targets if modules[t].name != "__init__.py"}
    return graph


def test_no_import_cycles_between_modules():
    """Lazy (function-level) imports count too: a cycle hidden in a function is still a cycle."""
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
