"""Fixtures for the OpenAI server tests: one tiny CPU engine per session (servers share it),
one uvicorn server per test module."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai_server_utils import RunningServer, parse_server_args, start_server

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine


@pytest.fixture(scope="session")
def engine() -> Iterator[AsyncLLMEngine]:
    args = parse_server_args()
    eng = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    srv = start_server(engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()
