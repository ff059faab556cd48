"""The import arrows run one way: every module of baby_sgl imports only from the packages below
its own in LAYERS (type-only and function-level imports included, and modules started as processes
of their own, `-m baby_sgl.x`: a lower layer is handed such a module as a reference instead), so
the shared types live in core and no package reaches up into the one that uses it. A module of a
package may have a layer of its own (named package.module) where it uses more than the rest of its
package: the one-call decode step runs the models that the package's ops serve, and a
tensor-parallel rank runs the model runner that the rest of distributed/ serves."""

from __future__ import annotations

import ast
import pathlib

import baby_sgl

ROOT = pathlib.Path(baby_sgl.__file__).parent

# Lowest first: a top-level module or a subpackage of baby_sgl may import only what comes before it.
LAYERS = [
    "native_env", "errors", "validation", "cache_dirs", "trace", "threads", "model_config", "server_args", "cpu",
    "constrained", "core", "layers", "lora", "model_loader", "distributed", "mem_cache", "sampling", "speculative", "attention",
    "models", "cpu.decode_step",
    "model_executor", "distributed.tp_worker", "managers", "engine", "demo", "entrypoints", "launch_server", "cli",
    "sglang_client",
    "bench", "__init__",
]


def _unit(parts: tuple[str, ...]) -> str:
    """The layer of the module at `parts` under baby_sgl: its own if LAYERS names it, else its
    package's (a name that is neither, such as baby_sgl.Engine, is the package's __init__)."""
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return "__init__"


def _path_unit(path: pathlib.Path) -> str:
    return _unit(path.relative_to(ROOT).with_suffix("").parts)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: a relative import; name the module from baby_sgl")
        names = [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        # A process started as [python, "-m", "baby_sgl.x", ...] runs x. Before, unseen:
        # entrypoints/data_parallel.py:worker_argv started "-m baby_sgl.launch_server", a layer up.
        if isinstance(node, ast.List):
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            names = [m for flag, m in zip(items, items[1:]) if flag == "-m" and isinstance(m, str)]
        found += [(node.lineno, n) for n in names if n.startswith("baby_sgl.")]
    return found


def test_every_unit_is_placed():
    units = {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in ROOT.rglob("*.py")}
    assert units <= set(LAYERS), f"place these in LAYERS: {sorted(units - set(LAYERS))}"


def test_imports_point_down():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        src = _path_unit(path)
        for line, module in _imports(path):
            dst = _unit(tuple(module.split(".")[1:]))
            if dst != src and rank[dst] > rank[src]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} imports {module}")
    assert not upward, "imports that reach up a layer:\n" + "\n".join(upward)
