"""Writes docs/server_args.md from the settings' own help (baby_sgl/server_args.py), so the page
lists every flag `baby-sgl serve` takes, with its default, and never drifts from the code
(tests/test_docs.py checks the committed page against this output).

    python scripts/gen_server_args_doc.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from baby_sgl.server_args import SERVER_ONLY, EngineArgs, ServerArgs

PAGE = Path(__file__).resolve().parents[1] / "docs" / "server_args.md"

HEADER = """# Server arguments

Generated from `baby_sgl/server_args.py` by `python scripts/gen_server_args_doc.py`; do not edit by
hand. The names are SGLang's. `baby-sgl serve` takes every flag below; `baby-sgl generate`,
`baby-sgl demo` and `Engine(**kwargs)` take the engine's (the keyword is the flag's name with
underscores: `--page-size 16` is `Engine(page_size=16)`), and `Engine` refuses the server's own by
name. `--help` on each command prints the same text.
"""


def _default(f: dataclasses.Field) -> str:
    value: Any = f.default
    if f.type == "bool":
        return "off"
    if value is None or value == ():
        return "-"
    return f"`{value}`"


def _cell(text: str) -> str:
    """Help text as one table cell: pipes escaped, and angle brackets outside code spans, which
    Markdown would read as HTML tags (<think>)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def _table(fields: list[dataclasses.Field]) -> list[str]:
    rows = ["| flag | default | what it sets |", "|---|---|---|"]
    for f in fields:
        help_ = _cell(f.metadata["help"])
        aliases = ", ".join(f"`{a}`" for a in f.metadata.get("aliases", ()))
        aliases = f" (also {aliases})" if aliases else ""
        rows.append(f"| `--{f.name.replace('_', '-')}`{aliases} | {_default(f)} | {help_} |")
    return rows


def render() -> str:
    engine = list(dataclasses.fields(EngineArgs))
    server = [f for f in dataclasses.fields(ServerArgs) if f.name in SERVER_ONLY]
    lines = [HEADER, "## Engine (`EngineArgs`: the engine, its memory and its scheduling)", "",
             *_table(engine), "", "## Server only (`ServerArgs`: address, limits, key, dashboard, scaling out)", "",
             *_table(server)]
    return "\n".join(lines) + "\n"


def main() -> None:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
