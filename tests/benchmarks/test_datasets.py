"""``vllm bench serve --dataset-name``: the random / random-mm synthetic sets and ShareGPT
files read from local paths (selection, length filters, images, seeds), and the flag checks.
The runs against a live server are in tests/entrypoints/openai/test_cli_commands.py."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from vllm.engine.cli_args import FlexibleArgumentParser
from vllm.entrypoints.cli.benchmark import serve
from vllm.entrypoints.cli.benchmark.datasets import image_url, read_entries, sharegpt_requests

PNG_1PX = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c4944415408"
    "d763f8cfc0000003010100c9fe92ef0000000049454e44ae426082"
)


def conversation(prompt: str, answer: str, **extra: object) -> dict:
    turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
    return {"id": prompt[:8], "conversations": turns, **extra}


async def words(text: str) -> int:
    return len(text.split())


def write_sharegpt(tmp_path: Path) -> Path:
    (tmp_path / "pic.png").write_bytes(PNG_1PX)
    entries = [
        conversation("one two three four five", "a b c d e f"),
        conversation("too short", "a b c d e"),  # prompt under 4 tokens
        conversation("a fine prompt of words", "no"),  # answer under 4 tokens
        conversation(" ".join(["w"] * 1100), "a b c d"),  # prompt over 1024
        conversation("look at this picture please", "it is a pixel", image="pic.png"),
        {"id": "one-turn", "conversations": [{"from": "human", "value": "alone here now ok"}]},
        conversation("remote image here for you", "a b c d", image="https://example.com/x.png"),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt_selection_and_filters(tmp_path: Path) -> None:
    path = write_sharegpt(tmp_path)
    got = asyncio.run(sharegpt_requests(path, 10, 0, words))
    prompts = sorted(r.prompt for r in got)
    assert prompts == [
        "look at this picture please",
        "one two three four five",
        "remote image here for you",
    ]
    by_prompt = {r.prompt: r for r in got}
    assert by_prompt["one two three four five"].max_tokens == 6  # the answer's length
    (url,) = by_prompt["look at this picture please"].image_urls
    assert url.startswith("data:image/png;base64,")
    assert by_prompt["remote image here for you"].image_urls == ["https://example.com/x.png"]
    assert by_prompt["one two three four five"].image_urls == []


def test_sharegpt_is_seeded_and_bounded(tmp_path: Path) -> None:
    path = write_sharegpt(tmp_path)
    a = asyncio.run(sharegpt_requests(path, 2, 7, words, fixed_output_len=9))
    b = asyncio.run(sharegpt_requests(path, 2, 7, words, fixed_output_len=9))
    assert [r.prompt for r in a] == [r.prompt for r in b] and len(a) == 2
    assert all(r.max_tokens == 9 for r in a)
    # The context bounds prompt + answer: 5-word prompts and 9 tokens fit in 14, not in 13
    # (with a fixed length, the short answer no longer counts against its entry).
    small = asyncio.run(sharegpt_requests(path, 5, 7, words, fixed_output_len=9, max_model_len=14))
    assert len(small) == 4 and all(len(r.prompt.split()) == 5 for r in small)
    assert "a fine prompt of words" in {r.prompt for r in small}
    with pytest.raises(ValueError, match="no conversation fits"):
        asyncio.run(sharegpt_requests(path, 5, 7, words, fixed_output_len=9, max_model_len=13))


def test_json_lines_and_missing_images(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(conversation(f"p{i} a b c", "x y z w")) for i in range(3)))
    assert len(read_entries(path)) == 3
    with pytest.raises(ValueError, match="image nope.png"):
        image_url("nope.png", tmp_path)


def _args(argv: str) -> argparse.Namespace:
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(argv.split())


@pytest.mark.parametrize(
    ("argv", "ratio"),
    [("", 0.5), ("--dataset-name random", 0.0), ("--dataset-name random-mm", 1.0)],
)
def test_dataset_image_ratios(argv: str, ratio: float) -> None:
    args = _args(argv)
    serve._check_dataset(args)
    assert args.image_ratio == ratio


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--dataset-name sharegpt", "needs --dataset-path"),
        ("--dataset-name sharegpt --dataset-path org/hub-dataset", "no such local file"),
        ("--dataset-name random --image-ratio 0.5", "text only"),
        ("--dataset-name random-mm --dataset-path x.json", "--dataset-path is for"),
    ],
)
def test_dataset_flag_errors(argv: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        serve._check_dataset(_args(argv))


def test_upstream_alias_for_images_per_request() -> None:
    args = _args("--dataset-name random-mm --random-mm-base-items-per-request 2")
    assert args.num_images == 2
