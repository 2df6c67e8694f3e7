"""The layer contract: folders import downwards only, never across a wall, never a private name.

The order, lowest first (``ARCHITECTURE.md`` draws it)::

    base < formats < store | epoch | batch < fetch | feed < catalog < datasets < write
         < integrations < api (streamdata/__init__.py) < testing < cli

``base`` is the package's own top-level modules (errors, config, redact, ...). Folders on one
level (``store | epoch | batch``) are walled off from each other. Function-level imports count;
``if TYPE_CHECKING:`` blocks do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_imports import PACKAGE, _is_type_checking, _module_name, import_graph

LEVELS: list[set[str]] = [
    {"base"},
    {"formats"},
    {"store", "epoch", "batch"},
    {"fetch", "feed"},
    {"catalog"},
    {"datasets"},
    {"write"},
    {"integrations"},
    {"api"},
    {"testing"},
    {"cli"},
]
LEVEL = {folder: n for n, level in enumerate(LEVELS) for folder in level}


def folder_of(module: str) -> str:
    """``streamdata.store.client`` -> ``store``; ``streamdata.errors`` -> ``base``; the package
    itself -> ``api``; its ``__main__`` -> ``cli``."""
    parts = module.split(".")
    if module == "streamdata":
        return "api"
    if module == "streamdata.__main__":  # ``python -m streamdata`` is the command line
        return "cli"
    if len(parts) == 2 and not (PACKAGE / parts[1]).is_dir():
        return "base"
    return parts[1]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        mine = folder_of(module)
        for target in sorted(targets):
            theirs = folder_of(target)
            if theirs == mine:
                continue
            if theirs not in LEVEL or mine not in LEVEL:
                missing = mine if mine not in LEVEL else theirs
                bad.append(f"{module} -> {target}: folder {missing!r} has no level")
            elif LEVEL[theirs] > LEVEL[mine]:
                bad.append(f"{module} ({mine}) imports upwards: {target} ({theirs})")
            elif LEVEL[theirs] == LEVEL[mine]:
                bad.append(f"{module} ({mine}) imports across a wall: {target} ({theirs})")
    return bad


def test_the_checker_finds_upward_and_sideways_imports():
    graph = {"streamdata.store.client": {"streamdata.fetch.budget", "streamdata.epoch.plan",
                                         "streamdata.errors", "streamdata.store.retry"},
             "streamdata.errors": set()}
    assert layer_violations(graph) == [
        "streamdata.store.client (store) imports across a wall: streamdata.epoch.plan (epoch)",
        "streamdata.store.client (store) imports upwards: streamdata.fetch.budget (fetch)",
    ]


def test_every_folder_has_a_level():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(LEVEL), f"give these folders a level in LEVELS: {folders - set(LEVEL)}"


def test_folders_import_downwards_only():
    bad = layer_violations(import_graph())
    assert bad == [], "layer contract broken:\n" + "\n".join(bad)


def _private_names(path: Path, name: str, modules: set[str]) -> list[str]:
    """``from X import _y`` and ``X._y`` where X is a package module in another folder."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> package module it is bound to
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            return
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    bound[alias.asname or alias.name] = sub
                elif (target in modules and alias.name.startswith("_") and not alias.name.startswith("__")
                      and folder_of(target) != folder_of(name)):
                    found.append(f"{name} imports {target}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    bound[alias.asname] = alias.name
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in bound and node.attr.startswith("_") and not node.attr.startswith("__")
              and folder_of(bound[node.value.id]) != folder_of(name)):
            found.append(f"{name} uses {bound[node.value.id]}.{node.attr}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_module_uses_another_folders_private_names():
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    found = [hit for name, path in sorted(paths.items()) for hit in _private_names(path, name, set(paths))]
    assert found == [], "private names used across folders:\n" + "\n".join(found)


def test_the_private_name_checker_sees_both_forms(tmp_path: Path):
    source = tmp_path / "client.py"
    source.write_text("from streamdata.epoch.plan import _steps\nfrom streamdata.epoch import plan\n"
                      "plan._sizes\nfrom streamdata.store.retry import _own\n")
    modules = {"streamdata.epoch.plan", "streamdata.epoch", "streamdata.store.retry"}
    assert _private_names(source, "streamdata.store.client", modules) == [
        "streamdata.store.client imports streamdata.epoch.plan._steps",
        "streamdata.store.client uses streamdata.epoch.plan._sizes",
    ]


def test_subpackage_init_files_are_empty():
    filled = [str(p.relative_to(PACKAGE)) for p in PACKAGE.glob("*/__init__.py")
              if p.parent.name not in ("cli", "testing") and p.read_text().strip()]
    assert filled == [], f"keep these empty (import streamdata stays light): {filled}"
