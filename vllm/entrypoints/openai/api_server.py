"""The OpenAI-compatible HTTP server: FastAPI routes over :class:`AsyncLLMEngine`, run by uvicorn.

``build_app(args, engine)`` builds an app around an existing engine (several apps may share one
engine; each has its own metrics registry); ``run_server(args)`` reserves the port, builds the
engine and serves until interrupted. Run it as ``vllm serve MODEL`` or
``python -m vllm.entrypoints.openai.api_server --model MODEL``.

Shutdown (SIGTERM or Ctrl-C): the listening socket closes at once; in-flight requests get
``--shutdown-timeout`` seconds (default 0) to finish, then the engine stops and the rest end
with a clean error (a 500 body, or an in-band SSE error followed by ``[DONE]``); the process
then exits with status 0. Every cost a request can cause is bounded (body size and time,
headers, connections, queue, templates, images, response size): see docs/security.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import socket
import sys
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from vllm.engine.cli_args import FlexibleArgumentParser
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.cli_args import (
    make_arg_parser,
    ssl_options,
    validate_parsed_serve_args,
)
from vllm.entrypoints.openai.http_limits import uvicorn_config
from vllm.entrypoints.openai.http_metrics import HTTPMetricsMiddleware
from vllm.entrypoints.openai.metrics import ServerMetrics
from vllm.entrypoints.openai.middleware import (
    PROTECTED_PREFIXES,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    RequestLimitsMiddleware,
)
from vllm.entrypoints.openai.openapi import (
    SchemaBounds,
    install_openapi,
)
from vllm.entrypoints.openai.request_checks import RequestLimits
from vllm.entrypoints.openai.routes import add_routes
from vllm.entrypoints.openai.server_limits import ServerLimits
from vllm.entrypoints.openai.serving_chat import internal_error
from vllm.entrypoints.openai.serving_engine import (
    ClientDisconnectedError,
    OpenAIServingError,
    ServerContext,
    error_body,
)
from vllm.logger import init_logger
from vllm.multimodal.image import ImageMediaConnector
from vllm.version import __version__

logger = init_logger("vllm.entrypoints.openai.api_server")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if loc and param is None:
            param = loc[0]
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts) or "Invalid request.", param


_HTTP_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError"}


def _add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)  # 400 like vLLM, not FastAPI's 422
        return JSONResponse(error_body(message, "BadRequestError", 400, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message, cause = str(exc.detail), exc.__cause__
        if isinstance(cause, UnicodeDecodeError):
            message = f"The request body is not valid UTF-8 ({cause})."
        elif cause is not None:
            message = f"{message}: {cause}"
        err_type = _HTTP_ERROR_TYPES.get(exc.status_code, "BadRequestError")
        body = error_body(message, err_type, exc.status_code)
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(OpenAIServingError)
    async def on_serving_error(_: Request, exc: OpenAIServingError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "InternalServerError", 500), 500)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Its message may name files, addresses or internals: the client gets its type only.
        logger.error("Unexpected error while serving a request: %r", exc)
        return JSONResponse(error_body(internal_error(exc), "InternalServerError", 500), 500)

    @app.exception_handler(ClientDisconnectedError)
    async def on_disconnect(_: Request, exc: ClientDisconnectedError) -> Response:
        return Response(status_code=499)  # nobody is listening any more


def media_connector(args: argparse.Namespace, limits: ServerLimits) -> ImageMediaConnector:
    return ImageMediaConnector(
        args.allowed_local_media_path,
        args.allowed_image_hosts,
        timeout=limits.image_fetch_timeout,
        max_pixels=limits.max_image_pixels,
        request_timeout=limits.image_fetch_request_timeout,
        decode_concurrency=limits.image_decode_concurrency,
    )


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token (its vocabulary form: a byte-level token has one
    character per byte, never fewer than its text)."""
    try:
        return max(1, max(map(len, tokenizer.get_vocab())))
    except (AttributeError, TypeError, ValueError):
        return 64


def build_server_context(args: argparse.Namespace, engine: AsyncLLMEngine) -> ServerContext:
    mc = engine.config.model_config
    names = args.served_model_name or [mc.served_model_name]
    names = [names] if isinstance(names, str) else list(names)
    limits = ServerLimits.from_args(args)
    return ServerContext(
        engine=engine,
        served_model_names=names,
        model_root=str(args.model or mc.model),
        media=media_connector(args, limits),
        metrics=ServerMetrics(engine, names[0]),
        chat_template=load_chat_template(args.chat_template),
        response_role=args.response_role,
        log_requests=bool(args.enable_log_requests),
        max_log_len=args.max_log_len,
        limits=limits,
        max_token_chars=longest_token_chars(engine.get_tokenizer()),
        enable_auto_tools=bool(args.enable_auto_tool_choice),
        tool_call_parser=args.tool_call_parser,
    )


def build_app(args: argparse.Namespace, engine: AsyncLLMEngine) -> FastAPI:
    """The FastAPI app for ``engine`` configured by the server flags in ``args``."""
    docs: dict[str, Any] = {}
    if args.disable_fastapi_docs:
        docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="vLLM-compatible OpenAI API",
        version=__version__,
        root_path=args.root_path or "",
        **docs,
    )
    ctx = build_server_context(args, engine)
    app.state.ctx = ctx
    _add_exception_handlers(app)
    add_routes(app, ctx)
    mc = engine.config.model_config
    install_openapi(
        app,
        SchemaBounds(
            vocab_size=mc.spec.text.vocab_size,
            tokenizer_size=len(engine.get_tokenizer()),
            max_model_len=mc.max_model_len,
            max_prompts=ctx.limits.max_queued_requests,
            max_logprobs=mc.max_logprobs,
            max_num_seqs=engine.config.scheduler_config.max_num_seqs,
            trust_request_chat_template=ctx.limits.trust_request_chat_template,
            max_prompt_chars=mc.max_model_len * ctx.max_token_chars,
            served_model_names=tuple(ctx.served_model_names),
        ),
    )
    request_limits = RequestLimits(
        max_model_len=mc.max_model_len,
        max_prompts=ctx.limits.max_queued_requests,
        vocab_size=mc.spec.text.vocab_size,
    )
    app.add_middleware(RequestLimitsMiddleware, limits=request_limits)
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=ctx.limits.max_request_body_bytes,
        timeout=ctx.limits.body_timeout,
    )
    api_key = args.api_key
    if api_key:
        metrics = ("/metrics",) if getattr(args, "enable_metrics_auth", False) else ()
        app.add_middleware(
            APIKeyMiddleware, api_key=api_key, protected=(*PROTECTED_PREFIXES, *metrics)
        )
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )
    # Outermost: every answer counts, the 401s and 413s of the middleware above too.
    app.add_middleware(HTTPMetricsMiddleware, metrics=ctx.metrics.http, routes=app.routes)
    return app


def max_request_body_bytes(args: argparse.Namespace) -> int:
    """The flag, else env ``VLLM_MAX_REQUEST_BODY_BYTES``, else 32 MiB (raises ValueError)."""
    return ServerLimits.from_args(args).max_request_body_bytes


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown stops the engine after ``shutdown_timeout`` seconds so
    that requests still running then end with an error instead of holding up the exit."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        n = self.engine.engine.get_num_unfinished_requests()
        logger.info("Shutting down: %d request(s) get %g s to finish", n, self.shutdown_timeout)
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._stop_engine)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _stop_engine(self) -> None:
        """Stops the engine off the event loop (pending requests get EngineDeadError)."""
        n = self.engine.engine.get_num_unfinished_requests()
        logger.info("Stopping the engine; %d request(s) still running end with an error.", n)
        threading.Thread(target=self.engine.shutdown, name="vllm-shutdown", daemon=True).start()


def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    """Runs uvicorn; a SIGTERM ends it like Ctrl-C does, with exit status 0. (uvicorn re-raises
    the signal that stopped it; SIGTERM's default action would kill the process, status -15,
    before the engine is stopped, so a handler that only notes it is installed meanwhile.)"""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _note_sigterm) if in_main else None
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled: a clean stop
        logger.info("Server stopped.")
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _note_sigterm(signum: int, frame: Any) -> None:
    logger.info("Server stopped (SIGTERM).")


def create_server_socket(host: str | None, port: int) -> socket.socket:
    """Binds the listening address now, before the engine loads, so a busy port fails fast."""
    family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio then also sets TCP_NODELAY on each connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host or "0.0.0.0", port))
    except OSError as e:
        sock.close()
        raise SystemExit(
            f"Error: cannot listen on {host or '0.0.0.0'}:{port} ({e.strerror}); "
            "is the port already in use? Choose another one with --port."
        ) from None
    return sock


def freeze_startup_objects() -> int:
    """Moves every object alive after start-up (modules, tokenizer, graphs, the imported
    libraries: several hundred thousand) out of the cyclic garbage collector's reach and returns
    their count. A full collection scans every tracked object while holding the GIL, pausing
    the engine loop and so every stream: 190 ms with the tiny demo engine on a 2-core CPU
    (benchmarks/RESULTS.md); frozen, a collection scans only what requests created since.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_server(args: argparse.Namespace) -> None:
    """Validates the flags, reserves the port, builds the engine and serves until stopped."""
    try:
        validate_parsed_serve_args(args)
        load_chat_template(args.chat_template)
        limits = ServerLimits.from_args(args)
        media_connector(args, limits)
        shutdown_timeout = float(getattr(args, "shutdown_timeout", 0.0) or 0.0)
        if shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
        engine_args = EngineArgs.from_cli_args(args)
    except ValueError as e:
        raise SystemExit(f"Error: {e}") from None
    sock = create_server_socket(args.host, args.port)
    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    except (ValueError, OSError) as e:
        sock.close()
        raise SystemExit(f"Error: {e}") from None
    try:
        app = build_app(args, engine)
        config = uvicorn_config(
            app,
            limits,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            **ssl_options(args),
            # A backstop: after the engine stops, responses end within moments.
            timeout_graceful_shutdown=shutdown_timeout + 10,
        )
        scheme = "https" if args.ssl_certfile else "http"
        logger.info(
            "Serving %s on %s://%s:%d",
            ", ".join(app.state.ctx.served_model_names),
            scheme,
            args.host or "0.0.0.0",
            sock.getsockname()[1],
        )
        server = DrainingServer(config, engine, shutdown_timeout)
        # A dead engine (a failed GPU, say) cannot serve again: stop, so that a supervisor
        # restarts the process instead of it answering /health with 503 forever.
        engine.on_dead = lambda error: setattr(server, "should_exit", True)
        logger.debug("%d start-up objects frozen out of the garbage collector",
                     freeze_startup_objects())
        _serve(server, sock)
    finally:
        engine.shutdown()
        sock.close()
    if engine.dead_error is not None:  # logged by the engine loop as it died
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    parser = FlexibleArgumentParser(
        prog="python -m vllm.entrypoints.openai.api_server",
        description="vLLM-compatible OpenAI API server for Llama 3.2 Vision.",
    )
    make_arg_parser(parser, positional_model=False)
    run_server(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
