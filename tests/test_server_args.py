"""The settings: the engine's and the server's apart, frozen, every flag explained."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from baby_sgl import Engine, EngineArgs, ServerArgs
from baby_sgl.launch_server import build_parser
from baby_sgl.server_args import SERVER_ONLY, engine_kwargs


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from baby_sgl import cli, launch_server
    from baby_sgl.bench import offline_cli, serving
    from baby_sgl.entrypoints import chat_cli, tree_cli

    top = cli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"baby-sgl": top, "generate": sub.choices["generate"], "demo": sub.choices["demo"],
            "serve": launch_server.build_parser(), "chat": chat_cli.build_parser(), "tree": tree_cli.build_parser(),
            "bench offline": offline_cli.build_parser(), "bench serving": serving.build_parser()}


def test_every_cli_flag_has_help():
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in _parsers().items()
               for a in p._actions if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, f"flags without a help string: {missing}"


def test_engine_commands_take_engine_settings_only():
    parsers = _parsers()
    for name in ("generate", "demo", "chat", "bench offline"):
        flags = {s for a in parsers[name]._actions for s in a.option_strings}
        for setting in SERVER_ONLY:
            if setting == "log_level":  # the commands' own logging flag
                continue
            assert "--" + setting.replace("_", "-") not in flags, f"{name} takes the server's --{setting}"
    serve = {s for a in parsers["serve"]._actions for s in a.option_strings}
    assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ServerArgs)} <= serve


@pytest.mark.parametrize("argv, setting, value", [
    (["--tp", "2"], "tp_size", 2), (["--tensor-parallel-size", "2"], "tp_size", 2),
    (["--dp", "2"], "dp_size", 2), (["--data-parallel-size", "3"], "dp_size", 3),
    (["--served-model-name", "m"], "served_model_name", "m")])
def test_sglang_command_lines_parse(argv, setting, value):
    """The flags of SGLang's own launch commands (`--tp 2`, `--dp 2` from its docs) and its long
    aliases set the same settings."""
    args = ServerArgs.from_cli_args(build_parser().parse_args(argv))
    assert getattr(args, setting) == value


def test_an_empty_served_model_name_is_refused():
    with pytest.raises(ValueError, match="--served-model-name is empty"):
        ServerArgs(served_model_name=" ")


def test_generate_refuses_a_server_flag(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "baby_sgl.cli", "generate", "hi", "--model-path", tiny_llama,
                           "--dp-size", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unrecognized arguments: --dp-size 2" in proc.stderr


@pytest.mark.parametrize("setting", ["api_key", "dp_size", "host"])
def test_engine_refuses_server_settings_by_name(setting):
    with pytest.raises(TypeError, match=f"{setting}: settings of the HTTP server"):
        Engine(**{setting: {"api_key": "k", "dp_size": 2, "host": "0.0.0.0"}[setting]})


def test_engine_refuses_unknown_settings_by_name():
    with pytest.raises(TypeError, match="page_sise"):
        Engine(page_sise=4)


def test_settings_are_frozen_and_split():
    args = ServerArgs(api_key="k", page_size=4, max_queued_requests=0)
    assert args.max_queued_requests is None  # SGLang: 0 or less is no limit
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.page_size = 8  # type: ignore[misc]
    engine_args = args.engine_args()
    assert type(engine_args) is EngineArgs and engine_args.page_size == 4
    assert not set(engine_kwargs(args)) & set(SERVER_ONLY)
    assert set(SERVER_ONLY) == {"host", "port", "log_level", "served_model_name", "api_key", "allowed_hosts", "graceful_shutdown_timeout",
                                "max_request_bytes", "request_body_timeout", "stream_send_timeout",
                                "max_queued_requests", "disable_dashboard", "incremental_streaming_output",
                                "reasoning_parser", "tool_call_parser", "dp_size", "router_policy", "dp_rank"}


def test_engine_keeps_its_settings_as_resolved(tiny_llama):
    with Engine(tiny_llama, dtype="float32", chunked_prefill_size=-1) as engine:
        assert engine.engine_args.chunked_prefill_size == -1 and engine.engine_args.dtype == "float32"
        info = engine.get_server_info()
        assert info["chunked_prefill_size"] == -1 and "api_key" not in info
