"""The HTTP app over one Engine: its middleware (request_guard.py, send_deadline.py), its errors in one JSON shape
(OpenAI's; Anthropic's on its routes), and its routes: SGLang's native API (native_api.py),
OpenAI's (openai_api.py), Anthropic's Messages API (anthropic_api.py) and the dashboard.
The process that serves it is launch_server.py's."""

from __future__ import annotations

import logging
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from baby_sgl.engine import Engine
from baby_sgl.entrypoints.anthropic_api import add_anthropic_routes
from baby_sgl.entrypoints.async_bridge import AsyncEngine
from baby_sgl.entrypoints.dashboard import add_dashboard_routes
from baby_sgl.entrypoints.graceful_stop import StopGuard, StopState
from baby_sgl.entrypoints.metrics import Metrics
from baby_sgl.entrypoints.lora_api import add_lora_routes
from baby_sgl.entrypoints.native_api import add_native_routes
from baby_sgl.entrypoints.openai_api import add_openai_routes
from baby_sgl.entrypoints.prompt_bound import PromptBoundRoute
from baby_sgl.entrypoints.request_guard import RequestGuard, allowed_host_names
from baby_sgl.entrypoints.send_deadline import SendDeadline
from baby_sgl.entrypoints.responses import error_response
from baby_sgl.errors import EngineDeadError, ServerBusyError
from baby_sgl.server_args import SERVER_ONLY, ServerArgs
from baby_sgl.validation import describe_error, field_path

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a client told "busy" (503) should wait before trying again


def create_app(engine: Engine, server_args: ServerArgs | None = None) -> FastAPI:
    """The app over a running engine; server_args gives the server's limits and API key
    (the defaults when None)."""
    args = server_args or ServerArgs()
    app = FastAPI(title="baby-sgl")
    app.router.route_class = PromptBoundRoute
    app.state.engine = engine
    # What /get_server_info reports of the server's own settings (never the key).
    app.state.server_settings = {name: getattr(args, name) for name in SERVER_ONLY if name != "api_key"}
    app.state.model_name = args.served_model_name or os.path.basename(engine.model_path.rstrip("/"))
    app.state.metrics = Metrics(app.state.model_name)
    app.state.async_engine = AsyncEngine(engine, app.state.metrics, args.max_queued_requests)
    app.add_middleware(RequestGuard, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                       body_timeout=args.request_body_timeout,
                       host_names=allowed_host_names(args.host, args.allowed_hosts))
    app.add_middleware(SendDeadline, timeout=args.stream_send_timeout)
    app.state.stop = StopState()
    app.add_middleware(StopGuard, state=app.state.stop)  # added last: the outermost
    _install_error_handlers(app)
    add_native_routes(app, args.incremental_streaming_output)
    add_openai_routes(app)
    add_anthropic_routes(app)
    add_lora_routes(app)
    if not args.disable_dashboard:
        add_dashboard_routes(app, full_rids=bool(args.api_key))
    return app


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    where = field_path(tuple(first.get("loc", ()))) or None
    kind = first.get("type")
    if kind == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse the body')}", None
    if where is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "the body must be a JSON object", None
    return describe_error(first), where


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param, path=request.url.path)

    @app.exception_handler(ValueError)  # the engine's word for bad input
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), 400, path=request.url.path)

    @app.exception_handler(ServerBusyError)
    async def busy(request: Request, exc: ServerBusyError) -> JSONResponse:
        return error_response(str(exc), 503, headers={"Retry-After": str(RETRY_AFTER_S)}, path=request.url.path)

    @app.exception_handler(EngineDeadError)
    async def dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(str(exc), 503, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code, path=request.url.path)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return error_response(f"internal error: {exc!r}", 500, path=request.url.path)
