"""`baby-sgl bench offline ...` and `baby-sgl bench serving ...`."""

from __future__ import annotations

import importlib

_COMMANDS = {"offline": "baby_sgl.bench.offline_cli", "serving": "baby_sgl.bench.serving"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in _COMMANDS:
        print(f"usage: baby-sgl bench {{{','.join(_COMMANDS)}}} [options]")
        return 2
    return importlib.import_module(_COMMANDS[argv[0]]).main(argv[1:]) or 0
