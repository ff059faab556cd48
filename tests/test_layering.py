"""The import arrows run one way: every module of baby_sgl imports only from the packages below
its own in LAYERS (type-only and function-level imports included), so the shared types live in
core and no package reaches up into the one that uses it."""

from __future__ import annotations

import ast
import pathlib

import baby_sgl

ROOT = pathlib.Path(baby_sgl.__file__).parent

# Lowest first: a top-level module or a subpackage of baby_sgl may import only what comes before it.
LAYERS = [
    "native_env", "errors", "validation", "cache_dirs", "trace", "threads", "model_config", "server_args", "toolchain", "cpu_ops",
    "constrained", "core", "layers", "model_loader", "distributed", "mem_cache", "sampling", "speculative", "attention",
    "models",
    "model_executor", "managers", "engine", "demo", "entrypoints", "launch_server", "cli", "bench", "__init__",
]


def _unit(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: a relative import; name the module from baby_sgl")
        names = [node.module] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found += [(node.lineno, n) for n in names if n and n.startswith("baby_sgl.")]
    return found


def test_every_unit_is_placed():
    units = {_unit(p) for p in ROOT.rglob("*.py")}
    assert units <= set(LAYERS), f"place these in LAYERS: {sorted(units - set(LAYERS))}"


def test_imports_point_down():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        src = _unit(path)
        for line, module in _imports(path):
            dst = module.split(".")[1]
            if dst != src and rank[dst] > rank[src]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} imports {module}")
    assert not upward, "imports that reach up a layer:\n" + "\n".join(upward)
