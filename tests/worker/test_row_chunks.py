"""Short prefill chunks run as rows of the decode graph (``ModelRunner._row_chunks``; CPU:
the graphs' emulation): outputs equal to an engine that prefills every chunk eagerly
(``check_logprobs_close``), for text, for turns over a cached image, and for the last chunk of
a chunked image prompt; which chunks qualify follows the image-visibility rules."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.spies import PrefillTokens
from PIL import Image

from vllm import LLM, SamplingParams
from vllm.multimodal.cross_attention import image_runs, last_group
from vllm.multimodal.processing import ProcessedInputs

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8))


def _llm(rows: bool, **kw) -> LLM:
    args = dict(
        model="demo/mllama-tiny",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=64,
        limit_mm_per_prompt={"image": 2},
        block_size=16,
    )
    args.update(kw)
    llm = LLM(**args)
    if not rows:
        llm.llm_engine.runner.row_chunk_tokens = 0
    return llm


def _close(ref: list, got: list, name: str) -> None:
    check_logprobs_close(vllm_greedy(ref), vllm_greedy(got), "eager chunks", name)
    for a, b in zip(vllm_greedy(ref), vllm_greedy(got), strict=True):
        if a[0][0] == b[0][0]:  # the first token is sampled from the chunk's last row
            assert abs(a[1][0][a[0][0]] - b[1][0][b[0][0]]) < 1e-3


def test_short_text_prompts_next_to_running_decodes() -> None:
    """Prompts arriving while others decode join their decode graph as rows."""
    rng = random.Random(0)
    prompts = [
        " ".join(
            rng.choice(["red", "blue", "a cat", "the sea", "why"]) for _ in range(rng.randint(1, 3))
        )
        for _ in range(10)
    ]
    outs = {}
    for rows in (False, True):
        llm = _llm(rows)
        engine = llm.llm_engine
        pending, done = list(enumerate(prompts)), {}
        while pending or engine.has_unfinished_requests():
            if pending:  # one new request per step: the others are decoding
                i, p = pending.pop(0)
                engine.add_request(str(i), p, GREEDY)
            for out in engine.step():
                if out.finished:
                    done[int(out.request_id)] = out
        outs[rows] = [done[i] for i in range(len(prompts))]
        stats = engine.runner.stats
        assert (stats.row_chunks == len(prompts)) == rows, stats.row_chunks
        assert stats.eager_decode_steps == 0
        engine.check_integrity()
        assert len(engine.runner.rows.free_rows) == engine.runner.rows.max_rows
    _close(outs[False], outs[True], "row chunks")


def test_turn_over_a_cached_image_runs_as_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second chat turn: its new tokens (past the cached pages) see the image's cached
    cross group, so they run as rows; no eager prefill token is computed."""
    first = [
        {
            "prompt": "<|image|><|begin_of_text|>The image shows " + "a cat " * 9,
            "multi_modal_data": {"image": _image(1)},
        },
        {
            "prompt": "<|image|><|begin_of_text|>Left " + "word " * 9 + "<|image|> and right",
            "multi_modal_data": {"image": [_image(2), _image(3)]},
        },
        {"prompt": "A text chat " + "about many things " * 5},
    ]
    ref_llm, llm = _llm(False), _llm(True, enable_prefix_caching=True)
    out1 = llm.generate(first, GREEDY, use_tqdm=False)
    new = llm.llm_engine.process_inputs("and then?").prompt_token_ids[1:]
    second = []
    for p, o in zip(first, out1, strict=True):
        ids = llm.llm_engine.process_inputs(p).prompt_token_ids
        turn = {k: v for k, v in p.items() if k != "prompt"}
        turn["prompt_token_ids"] = ids + list(o.outputs[0].token_ids) + new
        second.append(turn)
    spy = PrefillTokens(llm, monkeypatch)
    before = llm.llm_engine.runner.stats.row_chunks
    out2 = [llm.generate([t], GREEDY, use_tqdm=False)[0] for t in second]
    assert spy.tokens == 0
    assert llm.llm_engine.runner.stats.row_chunks - before == len(second)
    _close(ref_llm.generate(second, GREEDY, use_tqdm=False), out2, "turn 2")
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("budget", [16, 24])
def test_last_chunk_of_an_image_prompt(budget: int) -> None:
    """Chunked prefill: the chunks after the image (its cross group written by an earlier,
    eager chunk) run as rows; the outputs equal eager chunks'."""
    prompts = [
        {
            "prompt": "<|image|><|begin_of_text|>Describe " + "this picture " * 6,
            "multi_modal_data": {"image": _image(4)},
        },
        {
            "prompt": "<|begin_of_text|>" + "Context words " * 8 + "<|image|>now describe",
            "multi_modal_data": {"image": _image(5)},
        },
        "Plain text " * 7,
    ]
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=budget)
    outs, stats = {}, {}
    for rows in (False, True):
        llm = _llm(rows, **kw)
        outs[rows] = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats[rows] = llm.llm_engine.runner.stats
    assert stats[False].row_chunks == 0 and stats[True].row_chunks > 0
    _close(outs[False], outs[True], f"budget {budget}")


def _sees(ids: list[int], image: int) -> list[tuple[int, int]]:
    """Per token, the images it sees, from the rules directly: the k-th image token of a
    group sees the group's first k images, later tokens the whole group up to the next group;
    tokens before the first image see none."""
    seen, n, group_first, prev = [], 0, None, -2
    for pos, tok in enumerate(ids):
        if tok == image:
            if pos != prev + 1:
                group_first = n
            n += 1
            prev = pos
        seen.append((group_first, n) if group_first is not None else (0, 0))
    return seen


@pytest.mark.parametrize("seed", range(200))
def test_sees_last_group_matches_the_visibility_rules(seed: int) -> None:
    rng = random.Random(seed)
    image = 9
    ids = [rng.choice([1, 2, image]) for _ in range(rng.randint(1, 14))]
    group = last_group(ids, image)
    inputs = ProcessedInputs(
        ids, runs=image_runs(ids, image), last_group=group, image_token_id=image
    )
    seen = _sees(ids, image)
    for start in range(len(ids) + 2):
        expected = group is not None and all(s == group for s in seen[start:])
        assert inputs.sees_last_group(start) == expected, (ids, start)


def test_long_chunks_and_long_contexts_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks over the token limit, or whose rows would read too many keys, stay eager."""
    from vllm.worker import model_runner

    llm = _llm(True)
    stats = llm.llm_engine.runner.stats
    llm.generate(["short " * 2], GREEDY, use_tqdm=False)
    assert stats.row_chunks == 1
    monkeypatch.setattr(model_runner, "ROW_CHUNK_KEYS", 8)
    llm.generate(["short " * 2], GREEDY, use_tqdm=False)
    assert stats.row_chunks == 1
    monkeypatch.setattr(model_runner, "ROW_CHUNK_KEYS", 256 * 1024)
    llm.llm_engine.runner.row_chunk_tokens = 2
    llm.generate(["short " * 2], GREEDY, use_tqdm=False)
    assert stats.row_chunks == 1
