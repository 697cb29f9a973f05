"""``vllm run-batch -i INPUT -o OUTPUT --model MODEL``: an OpenAI batch file, run offline.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` or ``/v1/completions`` (images in chat bodies as in the server:
``data:`` URLs, ``file://`` under ``--allowed-local-media-path``, allowed hosts). Each output
line, in input order, is vLLM's ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``: the response body on success, else ``body`` null and the
error body in ``error``. Every body goes through the server's own app in-process (its
validation, limits and error messages), so a line answers as the server would; a line that is
not a request fails alone. A progress bar counts the lines done. Input and output are local
files (``-`` for standard input or output); nothing is fetched from or sent to URLs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, TextIO

import httpx

from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args

if TYPE_CHECKING:
    from vllm.engine.async_llm_engine import AsyncLLMEngine

# The engine and the app are imported when the batch runs: ``vllm chat`` and ``vllm --help``
# build this command's flags without loading the server.
SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The batch files, then every server and engine flag (``--model`` names the model)."""
    g = parser.add_argument_group("batch")
    g.add_argument(
        "-i", "--input-file", required=True, help="The batch file (JSON lines), or - for stdin."
    )
    g.add_argument(
        "-o", "--output-file", required=True, help="Where the results go, or - for stdout."
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Lines in flight at once (default: twice --max-num-seqs).",
    )
    g.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    return make_arg_parser(parser, positional_model=False)


def _random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _result(custom_id: Any, status: int, body: Any, error: Any) -> dict[str, Any]:
    return {
        "id": _random_id("vllm"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": _random_id("vllm-batch"), "body": body},
        "error": error,
    }


def _failed(custom_id: Any, message: str, status: int = 400) -> dict[str, Any]:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    error = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return _result(custom_id, status, None, error)


def check_line(number: int, line: str) -> tuple[Any, str, dict[str, Any]] | dict[str, Any]:
    """``(custom_id, url, body)`` of a request line, or the failed result of a bad one."""
    try:
        item = json.loads(line)
    except ValueError as e:
        return _failed(None, f"line {number}: not valid JSON ({e})")
    if not isinstance(item, dict):
        return _failed(None, f"line {number}: a request must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str):
        return _failed(custom_id, f"line {number}: custom_id must be a string")
    if item.get("method", "POST") != "POST":
        return _failed(custom_id, f"line {number}: method must be POST")
    url = item.get("url")
    if url not in SUPPORTED_URLS:
        return _failed(custom_id, f"line {number}: url must be one of {', '.join(SUPPORTED_URLS)}")
    body = item.get("body")
    if not isinstance(body, dict):
        return _failed(custom_id, f"line {number}: body must be a JSON object")
    if body.get("stream"):
        return _failed(custom_id, f"line {number}: stream is not supported in a batch")
    return custom_id, url, body


async def _run_line(
    client: httpx.AsyncClient, number: int, line: str, headers: dict[str, str]
) -> dict[str, Any]:
    parsed = check_line(number, line)
    if isinstance(parsed, dict):
        return parsed
    custom_id, url, body = parsed
    try:
        r = await client.post(url, json=body, headers=headers)
        answer = r.json()
    except (httpx.HTTPError, ValueError) as e:
        return _failed(custom_id, f"line {number}: {type(e).__name__}: {e}", 500)
    if r.status_code == 200:
        return _result(custom_id, 200, answer, None)
    return _result(custom_id, r.status_code, None, answer)


async def run_batch(args: argparse.Namespace, lines: list[str], engine: AsyncLLMEngine) -> list:
    """The results of ``lines`` (blank lines skipped), in order, run against ``engine``."""
    from vllm.entrypoints.openai.api_server import build_app

    app = build_app(args, engine)
    limit = args.max_concurrency or 2 * engine.config.scheduler_config.max_num_seqs
    gate = asyncio.Semaphore(max(1, limit))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    work = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    bar = None
    if not args.disable_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(work), desc="Running batch", unit="req", file=sys.stderr)
    transport = httpx.ASGITransport(app=app)
    timeout = httpx.Timeout(None)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://batch", timeout=timeout
    ) as c:

        async def one(number: int, line: str) -> dict[str, Any]:
            async with gate:
                result = await _run_line(c, number, line, headers)
            if bar is not None:
                bar.update(1)
            return result

        results = await asyncio.gather(*(one(n, line) for n, line in work))
    if bar is not None:
        bar.close()
    return list(results)


def _open(path: str, mode: str) -> Any:
    if path.startswith(("http://", "https://")):
        raise SystemExit(f"Error: {path}: run-batch reads and writes local files only.")
    if path == "-":
        return nullcontext(sys.stdin if "r" in mode else sys.stdout)
    try:
        return open(path, mode, encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"Error: cannot open {path}: {e.strerror}") from None


def main(args: argparse.Namespace) -> None:
    """Reads the input, runs every line, writes the output (a line per input line)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.async_llm_engine import AsyncLLMEngine

    try:
        validate_parsed_serve_args(args)
        engine_args = EngineArgs.from_cli_args(args)
    except ValueError as e:
        raise SystemExit(f"Error: {e}") from None
    with _open(args.input_file, "r") as f:
        lines = f.read().splitlines()
    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    except (ValueError, OSError) as e:
        raise SystemExit(f"Error: {e}") from None
    try:
        results = asyncio.run(run_batch(args, lines, engine))
    finally:
        engine.shutdown()
    with _open(args.output_file, "w") as out:
        write_results(out, results)
    failed = sum(1 for r in results if r["error"] is not None)
    print(
        f"{len(results)} requests, {failed} failed; results in {args.output_file}", file=sys.stderr
    )


def write_results(out: TextIO, results: list[dict[str, Any]]) -> None:
    for result in results:
        out.write(json.dumps(result, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    from vllm.engine.cli_args import FlexibleArgumentParser

    cli = add_cli_args(FlexibleArgumentParser(prog="python -m vllm.entrypoints.openai.run_batch"))
    main(cli.parse_args())
