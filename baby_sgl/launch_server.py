"""`baby-sgl serve` / `python -m baby_sgl.launch_server`: the server process. It parses the flags,
starts the engine (or, with --dp-size, one such process per rank behind the router), serves the
app until SIGTERM/SIGINT or the engine's failure, and shuts the engine down."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from baby_sgl.distributed.processes import end_without_collecting
from baby_sgl.entrypoints.request_guard import is_loopback
from baby_sgl.server_args import ServerArgs, engine_kwargs

logger = logging.getLogger(__name__)

# Once the graceful stop is done, connections still open (a body that never arrives) get this
# long before uvicorn closes them.
CLOSE_CONNECTIONS_S = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baby-sgl serve", description="the HTTP server: SGLang's native API and "
                                                                        "OpenAI's, with every engine setting")
    ServerArgs.add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    end_without_collecting()
    parser = build_parser()
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
    except ValueError as e:  # a setting out of its range: said as argparse says a bad flag
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.dp_size > 1:
            # This module by its import name: under `python -m` it runs as __main__.
            from baby_sgl import launch_server as server_process
            from baby_sgl.entrypoints.data_parallel import launch_data_parallel

            return launch_data_parallel(args, server_process)
        return launch_server(args)
    except FileNotFoundError as e:  # a missing model: said plainly (anything else keeps its traceback)
        print(f"baby-sgl serve: error: {e}", file=sys.stderr)
        return 2


def launch_server(server_args: ServerArgs) -> int:
    """Serves until SIGTERM/SIGINT (exit code 0) or until the engine fails beyond recovery
    (exit code 1, so that a supervisor restarts it)."""
    from baby_sgl.engine import Engine
    from baby_sgl.entrypoints.graceful_stop import stop_gracefully
    from baby_sgl.entrypoints.http_server import create_app

    if server_args.api_key is None and not is_loopback(server_args.host):
        logger.warning("serving on %s without --api-key: anyone who can reach this address can use the server",
                       server_args.host)
    engine = Engine(**engine_kwargs(server_args))
    app = create_app(engine, server_args)
    app.state.listen = {"host": server_args.host, "port": server_args.port}
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                            timeout_keep_alive=5, timeout_graceful_shutdown=CLOSE_CONNECTIONS_S)
    server = _GracefulServer(config, lambda: stop_gracefully(app.state.stop, app.state.async_engine,
                                                             server_args.graceful_shutdown_timeout))
    engine.on_death(lambda _: setattr(server, "should_exit", True))
    # A second SIGTERM/SIGINT is uvicorn's: it raises the signal again once it has stopped,
    # under the handlers found before it started: these let the engine shut down (and stop its
    # tensor-parallel ranks) instead of the process dying there.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"baby-sgl: serving {app.state.model_name} at http://{server_args.host}:{server_args.port}",
          file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        engine.shutdown()
    if engine.failure() is not None:
        logger.critical("exiting: the engine stopped (%r)", engine.failure())
        return 1
    return 0


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM/SIGINT runs the app's graceful stop before the
    server exits; a second one stops it at once (uvicorn's own handling)."""

    def __init__(self, config: uvicorn.Config, stop: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._stop, self._stopping = stop, False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._stopping or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._stopping = True
        asyncio.get_running_loop().call_soon_threadsafe(asyncio.ensure_future, self._stop_then_exit())

    async def _stop_then_exit(self) -> None:
        try:
            await self._stop()
        finally:
            self.should_exit = True


if __name__ == "__main__":
    raise SystemExit(main())
