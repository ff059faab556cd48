"""`baby-sgl chat`, in-process with scripted input, against our server and a local engine."""

from __future__ import annotations

import io

from baby_sgl.entrypoints.chat_cli import main


def run_chat(monkeypatch, capsys, argv: list[str], lines: str) -> str:
    """Everything the chat printed, stdout then stderr."""
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(argv) == 0
    captured = capsys.readouterr()
    return captured.out + captured.err


def test_chat_against_our_server(server, monkeypatch, capsys):
    out = run_chat(monkeypatch, capsys, ["--base-url", server, "--max-new-tokens", "4", "--temperature", "0"],
                   "hello\n/reset\nagain\n/exit\n")
    assert out.count("assistant> ") == 2


def test_chat_with_a_local_engine(tiny_llama, monkeypatch, capsys):
    out = run_chat(monkeypatch, capsys, ["--model-path", tiny_llama, "--max-new-tokens", "4", "--temperature", "0",
                                         "--system", "be brief"], "hello\nmore\n")
    assert out.count("assistant> ") == 2


def test_chat_survives_a_failed_turn(server, monkeypatch, capsys):
    out = run_chat(monkeypatch, capsys, ["--base-url", server, "--max-new-tokens", "4"], "x" * 3000 + "\nhi\n")
    assert out.count("assistant> ") == 2 and "prompt is too long" in out
