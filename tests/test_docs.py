"""The README and the docs/ pages, checked against the code: every command line they show parses
with the real command-line parsers, the README's Engine and OpenAI-client examples run against a
tiny model, every relative link points to a file and heading that exist, and docs/server_args.md
is what scripts/gen_server_args_doc.py writes."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import runpy
import shlex
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from baby_sgl import cli
from baby_sgl.server_args import ServerArgs
from entrypoints.conftest import start_server, wait_idle

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerArgs)}


def blocks(page: Path, lang: str) -> list[str]:
    return [body for fence_lang, body in FENCE.findall(page.read_text()) if fence_lang == lang]


def is_command(argv: list[str]) -> bool:
    """Our own CLI: `baby-sgl ...` or `python -m baby_sgl...`."""
    return argv[:1] == ["baby-sgl"] or (len(argv) > 2 and argv[0].endswith("python") and argv[1] == "-m"
                                        and argv[2].startswith("baby_sgl"))


def commands(page: Path) -> Iterator[list[str]]:
    """Each of our command lines in the page's bash blocks (continuations joined, each side of
    `&&` on its own, comments dropped)."""
    for block in blocks(page, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if is_command(argv):
                    yield argv


def parser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser the command line reaches, and the arguments left for it, found the way the CLI
    dispatches (cli.main): a delegated subcommand's module, or a `python -m` module, has its own."""
    if argv[0] == "baby-sgl":
        rest = argv[1:]
        if rest[0] not in cli._DELEGATED:
            return cli.build_parser(), rest
        module = importlib.import_module(cli._DELEGATED[rest[0]][0])
        rest = rest[1:]
    else:
        module, rest = importlib.import_module(argv[2]), argv[3:]
    if not hasattr(module, "build_parser"):  # a dispatcher to subcommands of its own (bench offline|serving)
        module = importlib.import_module(module._COMMANDS[rest[0]])
        rest = rest[1:]
    return module.build_parser(), rest


COMMANDS = [(page, argv) for page in PAGES for argv in commands(page)]


@pytest.mark.parametrize("page, argv", COMMANDS, ids=[f"{p.name}: {' '.join(a)[:60]}" for p, a in COMMANDS])
def test_every_command_line_parses(page, argv):
    parser, rest = parser_for(argv)
    try:
        args = parser.parse_args(rest)
    except SystemExit:  # argparse said what was wrong on stderr
        pytest.fail(f"{page.name}: `{shlex.join(argv)}` does not parse")
    if SERVER_FIELDS <= vars(args).keys():  # the server's settings check their values too
        ServerArgs.from_cli_args(args)


def test_the_pages_show_commands():
    """The scan above finds what it should (a page's commands are not silently skipped)."""
    found = {page.name for page, _ in COMMANDS}
    assert {"README.md", "benchmarks.md", "server.md", "scaling_out.md", "offline_api.md"} <= found, found


def python_block(page: Path, needle: str) -> str:
    (code,) = [b for b in blocks(page, "python") if needle in b]
    return code


def test_readme_engine_example_runs(tiny_llama, capsys):
    code = python_block(README, "from baby_sgl import Engine")
    assert code.count("Engine(") == 1
    code = code.replace("Engine(", f"Engine(model_path={tiny_llama!r}, ")
    exec(compile(code, "README.md (Engine example)", "exec"), {})  # ends with engine.check_memory()
    assert "prompt_tokens" in capsys.readouterr().out


def test_readme_server_example_runs(tiny_llama):
    """The server as the README starts it (its flags, another port, the tiny model), then the
    README's OpenAI-client code against it; the server must end idle with its memory intact."""
    (serve,) = [argv for argv in commands(README) if argv[1:2] == ["serve"] and "--port" in argv]
    flags = serve[2:]
    port = flags.index("--port")
    proc, base = start_server(tiny_llama, *flags[:port], *flags[port + 2:])
    try:
        code = python_block(README, "import openai")
        assert "http://127.0.0.1:30000" in code
        exec(compile(code.replace("http://127.0.0.1:30000", base), "README.md (server example)", "exec"), {})
        wait_idle(base)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: Counter[str] = Counter()
    for heading in re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.M):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{page.name}: {broken}"


def test_server_args_page_is_generated():
    render = runpy.run_path(str(ROOT / "scripts" / "gen_server_args_doc.py"))["render"]
    assert (ROOT / "docs" / "server_args.md").read_text() == render(), \
        "docs/server_args.md is stale: run python scripts/gen_server_args_doc.py"
