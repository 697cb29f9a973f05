"""Flags that upstream vLLM launch scripts pass: each is parsed and honoured (or, for what this
engine does not have, refused or accepted with a warning that says why). In-process; the
end-to-end run of a launch script is in test_upstream_serve.py."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai_server_utils import start_server

from vllm.engine.arg_parsing import human_readable_int
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.engine.cli_args import FlexibleArgumentParser
from vllm.engine.llm_engine import load_generation_config
from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.openai.api_server import run_server
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.config import ConfigError


def serve_args(*flags: str) -> argparse.Namespace:
    args = make_parser().parse_args(["serve", "demo/mllama-tiny", *flags])
    validate_parsed_serve_args(args)
    return args


def engine_args(*flags: str) -> EngineArgs:
    return EngineArgs.from_cli_args(serve_args(*flags))


def argparse_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    with pytest.raises(SystemExit) as exc:
        make_parser().parse_args(["serve", "demo/mllama-tiny", *flags])
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def vllm_logs() -> Iterator[list[str]]:
    """Messages logged by the package (its logger does not propagate to pytest's)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm")
    level = logger.level  # another test may have raised it (demo_checkpoints.main does)
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_pipeline_parallel_size(capsys: pytest.CaptureFixture[str]) -> None:
    ea = engine_args("-pp", "1")
    assert ea.pipeline_parallel_size == 1
    assert ea.create_engine_config().parallel_config.pipeline_parallel_size == 1
    assert engine_args("--pipeline-parallel-size", "1").pipeline_parallel_size == 1
    with pytest.raises(SystemExit) as exc:
        run_server(serve_args("-pp", "2", "--host", "127.0.0.1", "--port", "0"))
    assert "pipeline_parallel_size > 1 is not supported" in str(exc.value.code)


def test_max_model_len_human_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_args("--max-model-len", "32k").max_model_len == 32_000
    assert engine_args("--max-model-len", "32K").max_model_len == 32_768
    assert engine_args("--max-model-len", "1m").max_model_len == 1_000_000
    assert human_readable_int("1M") == 2**20 and human_readable_int("25.6k") == 25_600
    assert human_readable_int("4096") == 4096
    for bad in ("1.5K", "12x", "1.5", "-3"):
        assert "argument --max-model-len" in argparse_error(capsys, "--max-model-len", bad)
    config = engine_args("--max-model-len", "1k").create_engine_config()
    assert config.model_config.max_model_len == 1000
    with pytest.raises(ValueError, match=r"max_model_len must be in 2\.\.131072"):
        engine_args("--max-model-len", "1m").create_engine_config()


def test_several_api_keys(engine: AsyncLLMEngine) -> None:
    args = serve_args("--api-key", "key-a", "key-b")
    assert args.api_key == ["key-a", "key-b"]
    server = start_server(engine, ["--api-key", "key-a", "key-b"])
    try:
        url = f"{server.url}/v1/models"
        for key, status in (("key-a", 200), ("key-b", 200), ("key-c", 401), ("", 401)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert httpx.get(url, headers=headers, timeout=10).status_code == status, key
    finally:
        server.stop()


def test_trust_remote_code_both_ways() -> None:
    assert engine_args("--no-trust-remote-code").trust_remote_code is False
    assert engine_args("--trust-remote-code").trust_remote_code is True
    assert engine_args().trust_remote_code is False
    engine_args("--no-trust-remote-code").create_engine_config()  # nothing to refuse


def test_limit_mm_per_prompt_dotted_and_other_modalities(
    capsys: pytest.CaptureFixture[str],
) -> None:
    dotted = engine_args(
        "--limit-mm-per-prompt.image", "2", "--limit-mm-per-prompt.video", "0",
        "--limit_mm_per_prompt.audio=0",
    )  # fmt: skip
    assert dotted.limit_mm_per_prompt == {"image": 2, "video": 0, "audio": 0}
    assert dotted.create_engine_config().model_config.limit_images_per_prompt == 2
    merged = engine_args("--limit-mm-per-prompt", '{"image": 3, "video": 0}')
    assert merged.limit_mm_per_prompt == {"image": 3, "video": 0}
    assert "takes images only" in argparse_error(
        capsys, "--limit-mm-per-prompt.video", "1"
    )  # fmt: skip
    assert "needs a value" in argparse_error(capsys, "--limit-mm-per-prompt.image")


def test_mm_processor_kwargs_forms_and_checks() -> None:
    as_json = engine_args("--mm-processor-kwargs", '{"max_image_tiles": 2}')
    dotted = engine_args("--mm-processor-kwargs.max_image_tiles", "2")
    assert as_json.mm_processor_kwargs == dotted.mm_processor_kwargs == {"max_image_tiles": 2}
    mc = dotted.create_engine_config().model_config
    assert mc.mm_processor_kwargs == {"max_image_tiles": 2}
    with pytest.raises(ValueError, match=r"max_image_tiles must be an integer in 1\.\.4"):
        engine_args("--mm-processor-kwargs.max_image_tiles", "5").create_engine_config()
    with pytest.raises(ValueError, match="unsupported option"):
        engine_args("--mm-processor-kwargs.size", "1").create_engine_config()


def test_hf_overrides_forms_and_effect() -> None:
    flags = ("--hf-overrides", '{"text_config": {"max_position_embeddings": 2048}}')
    as_json = engine_args(*flags)
    dotted = engine_args("--hf-overrides.text_config.max_position_embeddings", "2048")
    assert as_json.hf_overrides == dotted.hf_overrides
    mc = dotted.create_engine_config().model_config
    assert mc.spec.text.max_position_embeddings == 2048 and mc.max_model_len == 2048
    assert mc.spec.text.hidden_size == 64  # the rest of text_config is the checkpoint's
    assert mc.hf_config.text_config.max_position_embeddings == 2048
    with pytest.raises(ConfigError, match="divisible"):
        engine_args("--hf-overrides.text_config.hidden_size", "65").create_engine_config()


def test_override_generation_config() -> None:
    flags = ("--override-generation-config", '{"temperature": 0.25}')
    config = engine_args(*flags).create_engine_config()
    params = SamplingParams()
    params.update_from_generation_config(load_generation_config(config), [])
    assert params.temperature == 0.25 and params.top_p == 0.9  # top_p: the checkpoint's
    config = engine_args(*flags, "--generation-config", "vllm").create_engine_config()
    params = SamplingParams()
    params.update_from_generation_config(load_generation_config(config), [])
    assert params.temperature == 0.25 and params.top_p == 1.0  # only the override
    dotted = engine_args("--override-generation-config.top_k", "5")
    assert dotted.override_generation_config == {"top_k": 5}


def test_config_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: demo/mllama-tiny\n"
        "max-model-len: 2k\n"
        "max_num_seqs: 8\n"
        "served-model-name: [tiny, alias]\n"
        "enforce-eager: true\n"
        "trust-remote-code: false\n"
        "limit-mm-per-prompt: {image: 2}\n"
        "api-key: [k1, k2]\n"
        "port: 8123\n"
    )
    args = make_parser().parse_args(
        ["serve", "--config", str(config), "--max-num-seqs", "4", "--limit-mm-per-prompt.video",
         "0"]
    )  # fmt: skip
    validate_parsed_serve_args(args)
    ea = EngineArgs.from_cli_args(args)
    assert ea.model == "demo/mllama-tiny" and ea.max_model_len == 2000
    assert ea.max_num_seqs == 4  # the command line wins
    assert ea.served_model_name == ["tiny", "alias"] and ea.enforce_eager
    assert ea.limit_mm_per_prompt == {"image": 2, "video": 0}  # merged, key by key
    assert args.api_key == ["k1", "k2"] and args.port == 8123
    standalone = make_arg_parser(FlexibleArgumentParser()).parse_args([f"--config={config}"])
    assert standalone.max_num_seqs == 8 and standalone.model == "demo/mllama-tiny"
    config.write_text("max-modle-len: 4096\n")
    assert "unknown option 'max-modle-len'" in argparse_error(capsys, "--config", str(config))
    config.write_text("- a list\n")
    assert "expected a mapping" in argparse_error(capsys, "--config", str(config))
    assert "cannot read it" in argparse_error(capsys, "--config", str(tmp_path / "nope.yaml"))


def test_disable_frontend_multiprocessing_is_accepted(vllm_logs: list[str]) -> None:
    assert serve_args("--disable-frontend-multiprocessing").disable_frontend_multiprocessing
    assert any("already run in one process" in m for m in vllm_logs)


def test_unsupported_features_are_refused() -> None:
    for flags, message in (
        (("--enable-lora",), r"LoRA adapters \(enable_lora\) are not supported"),
        (("--speculative-config", '{"method": "ngram"}'), "speculative decoding"),
    ):
        with pytest.raises(ValueError, match=message):
            engine_args(*flags).create_engine_config()
    with pytest.raises(ValueError, match="--lora-modules: LoRA adapters are not supported"):
        serve_args("--lora-modules", "sql=/adapters/sql")


def test_ignored_options_warn(vllm_logs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    engine_args("--swap-space", "8", "--tokenizer-mode", "slow").create_engine_config()
    assert any("Ignoring swap_space=8.0: there is no CPU swap space" in m for m in vllm_logs)
    assert any("Ignoring tokenizer_mode='slow'" in m for m in vllm_logs)
    vllm_logs.clear()
    engine_args("--swap-space", "4").create_engine_config()  # the default: nothing to say
    assert not any("Ignoring" in m for m in vllm_logs)
    for backend in ("FLASH_ATTN", "XFORMERS"):
        monkeypatch.setenv("VLLM_ATTENTION_BACKEND", backend)
        engine_args().create_engine_config()
        assert any(f"VLLM_ATTENTION_BACKEND={backend}" in m and "Triton" in m for m in vllm_logs)


def test_help_shows_the_effective_defaults(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vllm serve --help`` shows what a flag left out means (256 sequences, not None)."""
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a flag's help
    with pytest.raises(SystemExit) as exc:
        make_parser().parse_args(["serve", "--help"])
    assert exc.value.code == 0
    entries: list[str] = []  # one per flag: its invocation and its help
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):
            entries.append(line.strip())
        elif entries and line.startswith("    "):
            entries[-1] += " " + line.strip()

    def help_of(flag: str) -> str:
        found = [e for e in entries if e.startswith(f"{flag} ") or f", {flag} " in e]
        assert found, flag
        return found[0]

    assert "(default: 256)" in help_of("--max-num-seqs")
    assert "(default: 512 with chunked prefill, else max(--max-model-len, 8192))" in help_of(
        "--max-num-batched-tokens"
    )
    assert "8192 on CPU" in help_of("--max-model-len")
    assert "(default: on; the offline LLM class: off)" in help_of("--no-enable-chunked-prefill")
    assert "(default: info)" in help_of("--uvicorn-log-level")
    assert "(default: assistant)" in help_of("--response-role")
    assert "(default: 0)" in help_of("--ssl-cert-reqs")
    assert "127.0.0.1 for this machine only" in help_of("--host")
    for flag in (
        "--max-num-seqs",
        "--max-model-len",
        "--tokenizer",
        "--served-model-name",
        "--cuda-graph-sizes",
        "--max-num-encoder-tiles",
        "--download-dir",
    ):
        assert "(default: None)" not in help_of(flag), flag


def test_tool_calling_and_guided_decoding_flags() -> None:
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        serve_args("--enable-auto-tool-choice")
    with pytest.raises(SystemExit):  # argparse: not one of the parsers
        serve_args("--tool-call-parser", "hermes")
    args = serve_args("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"
    config = engine_args("--guided-decoding-backend", "auto").create_engine_config()
    assert config.decoding_config.guided_decoding_backend == "xgrammar"
    with pytest.raises(ValueError, match="guided_decoding_backend='outlines' is not available"):
        engine_args("--guided-decoding-backend", "outlines").create_engine_config()
    compact = engine_args("--guided-decoding-disable-any-whitespace").create_engine_config()
    assert compact.decoding_config.disable_any_whitespace
    assert engine_args("--hf-token", "hf_abc").hf_token == "hf_abc"


def test_start_up_log_states_dtype_and_memory(vllm_logs: list[str]) -> None:
    engine_args("--dtype", "bfloat16", "--gpu-memory-utilization", "0.5").create_engine_config()
    assert any(
        "Model demo/mllama-tiny: bfloat16 weights and activations on cpu (--dtype bfloat16; "
        "checkpoint float32)" in m
        for m in vllm_logs
    )
    assert any("--gpu-memory-utilization (0.5) does not apply" in m for m in vllm_logs)
