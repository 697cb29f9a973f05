"""``vllm chat`` and ``vllm complete``: talk to a running server from the terminal.

``vllm chat`` keeps a conversation (an optional ``--system-prompt``, then each line you type
and each answer); ``vllm complete`` sends each line as a prompt. Both stream the answer as it
is generated; ``-q/--quick TEXT`` sends one message and exits. The server is
``--url`` (default ``http://localhost:8000/v1``); the model is ``--model-name`` or the first
one the server lists; the key is ``--api-key`` or ``OPENAI_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import httpx

DEFAULT_URL = "http://localhost:8000/v1"


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"The server (default {DEFAULT_URL}).")
    parser.add_argument(
        "--model-name", default=None, help="Model to ask (default: the server's first)."
    )
    parser.add_argument(
        "--api-key", default=None, help="API key (default: env OPENAI_API_KEY, if set)."
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="Most tokens per answer (default: the server's).",
    )
    parser.add_argument(
        "-q", "--quick", default=None, metavar="TEXT", help="Send this one message and exit."
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    chat = subparsers.add_parser(
        "chat",
        help="Chat with a running server.",
        description="Chat with a running OpenAI-compatible server (one line per message).",
    )
    _add_common(chat)
    chat.add_argument("--system-prompt", default=None, help="A system message to start with.")
    chat.set_defaults(dispatch=lambda args: run(args, chat=True))
    complete = subparsers.add_parser(
        "complete",
        help="Complete prompts with a running server.",
        description="Complete prompts with a running OpenAI-compatible server (one line per "
        "prompt).",
    )
    _add_common(complete)
    complete.set_defaults(dispatch=lambda args: run(args, chat=False))


class Client:
    """The server's API, streamed over httpx (no proxy from the environment)."""

    def __init__(self, url: str, api_key: str | None, model: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(600, connect=10),
            trust_env=False,
        )
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        r = self.http.get("/models")
        _raise_for(r)
        return str(r.json()["data"][0]["id"])

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[str]:
        """The text of each chunk of a streamed request."""
        body = {"model": self.model, **body, "stream": True}
        with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                _raise_for(r)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "the server failed"))
                for choice in chunk.get("choices", []):
                    yield (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def _raise_for(r: httpx.Response) -> None:
    if r.status_code == 200:
        return
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text
    raise RuntimeError(f"HTTP {r.status_code}: {message}")


class Session:
    """One conversation (chat) or a series of prompts (complete)."""

    def __init__(self, client: Client, chat: bool, system: str | None, max_tokens: int | None):
        self.client, self.chat = client, chat
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.extra = {"max_tokens": max_tokens} if max_tokens is not None else {}

    def send(self, text: str, out: TextIO) -> str:
        """Sends one message, writes the answer as it streams in, and returns it."""
        if self.chat:
            self.messages.append({"role": "user", "content": text})
            pieces = self.client.stream(
                "/chat/completions", {"messages": self.messages, **self.extra}
            )
        else:
            pieces = self.client.stream("/completions", {"prompt": text, **self.extra})
        answer = []
        for piece in pieces:
            out.write(piece)
            out.flush()
            answer.append(piece)
        out.write("\n")
        reply = "".join(answer)
        if self.chat:
            self.messages.append({"role": "assistant", "content": reply})
        return reply


def run(
    args: argparse.Namespace, chat: bool, stdin: TextIO | None = None, stdout: TextIO | None = None
) -> None:
    """The command: one message with ``--quick``, else a line at a time until end of input
    (or ``exit``)."""
    from vllm import envs

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        client = Client(args.url, args.api_key or envs.OPENAI_API_KEY, args.model_name)
        session = Session(client, chat, getattr(args, "system_prompt", None), args.max_tokens)
        if args.quick is not None:
            session.send(args.quick, stdout)
            return
        stdout.write(f"Using model {client.model} at {args.url} (end with Ctrl-D or 'exit').\n")
        while True:
            stdout.write("> ")
            stdout.flush()
            line = stdin.readline()
            if not line or line.strip() in ("exit", "quit"):
                return
            if line.strip():
                session.send(line.rstrip("\n"), stdout)
    except (httpx.HTTPError, RuntimeError) as e:
        raise SystemExit(f"Error: {e}") from None
    except KeyboardInterrupt:
        stdout.write("\n")
