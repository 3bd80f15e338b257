"""The one-way data flow, checked: every import in runtime/ and kernels/ goes to the same or a lower
layer. The layer order is written once, in docs/architecture.md (the ```layers block); this test reads
it from there. Imports under `if TYPE_CHECKING:` are annotations, not dependencies, and are skipped."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def read_layers() -> list[tuple[str, list[str]]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    layers = []
    for line in block.group(1).splitlines():
        if m := re.match(r"\s*\d+\.\s+([\w-]+):\s+(.*)$", line):
            layers.append((m.group(1), [p.strip() for p in m.group(2).split(",") if p.strip()]))
    return layers


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of runtime or kernels outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m.split(".")[0] in ("runtime", "kernels")]


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The layer whose most specific prefix matches the module."""
    best, best_len = None, -1
    for i, (_name, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def sources() -> list[Path]:
    return sorted([*(ROOT / "runtime").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def test_every_module_has_a_layer():
    layers = read_layers()
    missing = [module_name(p) for p in sources() if layer_of(module_name(p), layers) is None]
    assert not missing, f"modules with no layer in docs/architecture.md: {missing}"


def test_no_import_goes_up_a_layer():
    layers = read_layers()
    bad = []
    for path in sources():
        mine = layer_of(module_name(path), layers)
        for line, target in runtime_imports(path):
            theirs = layer_of(target, layers)
            if theirs is not None and theirs < mine:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({layers[mine][0]}) imports {target} "
                           f"({layers[theirs][0]})")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_the_gateway_knows_only_the_engine_client():
    """The gateway is handed an EngineClient; it never picks or builds one."""
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in (ROOT / "runtime" / "gateway").rglob("*.py")
           for line, m in runtime_imports(p)
           if m.startswith(("runtime.cluster", "runtime.engine.", "runtime.entrypoints")) or m == "runtime.engine"]
    assert not bad, bad


def test_the_checker_sees_an_upward_import(tmp_path):
    """The parse itself: a plain import counts, one under TYPE_CHECKING does not."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom runtime.engine import Engine\n"
                   "if TYPE_CHECKING:\n    from runtime.cluster import x\n")
    assert [m for _line, m in runtime_imports(src)] == ["runtime.engine"]
