"""`baby-sgl serve` / `python -m baby_sgl.launch_server`: the HTTP server with every Engine flag."""

from __future__ import annotations

import argparse
import logging

from baby_sgl.server_args import ServerArgs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baby-sgl serve", description="the HTTP server: SGLang's native API and "
                                                                        "OpenAI's, with every engine setting")
    ServerArgs.add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = ServerArgs.from_cli_args(build_parser().parse_args(argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.dp_size > 1:
        from baby_sgl.entrypoints.data_parallel import launch_data_parallel

        return launch_data_parallel(args)
    from baby_sgl.entrypoints.http_server import launch_server

    return launch_server(args)
