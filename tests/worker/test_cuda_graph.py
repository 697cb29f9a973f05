"""Decode graphs for every batch: family selection, padding, no host syncs, equality with eager.

On CPU the graph runner emulates capture (same padded buffers, same capture-time scalars); on
CUDA the same tests replay real graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.no_sync import NoHostSync
from PIL import Image

from vllm import LLM, SamplingParams

DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"
def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _prompt(i: int):
    if i % 2:
        return f"Text only prompt {i} is about"
    return {"prompt": f"<|image|><|begin_of_text|>Picture {i}:",
            "multi_modal_data": {"image": _image(40 + 16 * (i % 5), 56, i)}}


def _llm(eager: bool, **kw) -> LLM:
    args = dict(model="demo/mllama-tiny", dtype=DTYPE, max_model_len=256, max_num_seqs=16,
                enforce_eager=eager)
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    return _llm(False), _llm(True)


def test_buckets_cover_max_num_seqs(pair) -> None:
    graphs = pair[0].llm_engine.runner.graphs
    assert graphs is not None and pair[1].llm_engine.runner.graphs is None
    assert graphs.sizes == [1, 2, 4, 8, 16]
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    with pytest.raises(RuntimeError):
        graphs.bucket_for(17)


def _start_decoding(llm: LLM, n: int) -> None:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"d{i}", _prompt(i), params)
    while engine.scheduler.waiting:
        engine.step()
    engine.step()  # one decode step


def _finish(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.abort_request(list(engine.scheduler.requests))
    engine.check_integrity()


@pytest.mark.parametrize("family", ["text", "cross"])
def test_captured_forward_has_no_host_sync(pair, family: str) -> None:
    llm = pair[0]
    _start_decoding(llm, 3)
    graphs = llm.llm_engine.runner.graphs
    rows = [s.row for r in llm.llm_engine.scheduler.running for s in r.seqs]
    graphs.static_rows[:3] = torch.tensor(rows)
    graphs._uploaded_rows = None  # written behind run()'s back
    with torch.inference_mode(), NoHostSync():
        logits = graphs.forward(4, family)
    assert logits.shape[0] == 4 and torch.isfinite(logits[:3]).all()
    _finish(llm)


def test_no_host_sync_guard_works() -> None:
    with pytest.raises(AssertionError, match="host-device"), NoHostSync():
        x = torch.ones(3)
        if x.sum() > 0:  # a Python branch on tensor data
            pass
    x = torch.arange(4)
    for masked in (lambda: x[x > 1], lambda: x.masked_select(x > 1),  # data-dependent shapes
                   lambda: x.__setitem__(x > 1, 0)):
        with pytest.raises(AssertionError, match="host-device"), NoHostSync():
            masked()
    with NoHostSync():  # integer indices and where() are fine
        picked, kept = x[torch.tensor([0, 2])], torch.where(x > 1, x, 0)
    assert picked.tolist() == [0, 2] and kept.tolist() == [0, 0, 2, 3]


def test_graph_equals_eager_padded_to_same_bucket(pair) -> None:
    """Same shapes, same kernels: replay and an eager forward on the padded batch are bitwise
    equal (both families), the graph's in-graph argmax is the logits' argmax, and the graph
    advanced the real rows with it."""
    llm = pair[0]
    _start_decoding(llm, 3)
    runner = llm.llm_engine.runner
    graphs = runner.graphs
    rows = [s.row for r in llm.llm_engine.scheduler.running for s in r.seqs]
    padded = torch.tensor(rows + [graphs.null_row], device=runner.device)
    state = runner.rows
    with torch.inference_mode():
        for cross in (False, True):
            tokens, positions = state.tokens.clone(), state.positions.clone()
            logits, _, greedy, _ = graphs.run(rows, cross=cross)
            replayed, greedy = logits.clone(), greedy.clone()
            # The graph also advanced the rows with its greedy tokens (padding row untouched).
            advanced_tokens, advanced_positions = tokens.clone(), positions.clone()
            advanced_tokens[rows] = greedy
            advanced_positions[rows] += 1
            assert torch.equal(state.tokens, advanced_tokens)
            assert torch.equal(state.positions, advanced_positions)
            state.tokens.copy_(tokens)
            state.positions.copy_(positions)
            eager = runner.decode_forward(padded, graphs.shape(4, "cross" if cross
                                                               else "text"))[:3]
            assert torch.equal(replayed, eager)
            assert torch.equal(greedy, eager.argmax(dim=-1))
    _finish(llm)


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 11, 16])
def test_graph_matches_unpadded_eager(pair, batch: int) -> None:
    """Mixed text/image batches at every bucket, padding included (3 in 4, 5 in 8, ...)."""
    graph_llm, eager_llm = pair
    prompts = [_prompt(i) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    before = sum(graph_llm.llm_engine.runner.stats.graph_replays.values())
    g = graph_llm.generate(prompts, params, use_tqdm=False)
    e = eager_llm.generate(prompts, params, use_tqdm=False)
    check_logprobs_close(vllm_greedy(e), vllm_greedy(g), "eager", "graph")
    stats = graph_llm.llm_engine.runner.stats
    assert stats.eager_decode_steps == 0
    assert sum(stats.graph_replays.values()) - before >= 11  # every decode step replayed
    graph_llm.llm_engine.check_integrity()


def test_family_switches_as_image_requests_finish(pair) -> None:
    graph_llm, eager_llm = pair
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    long = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=5)
    prompts = [_prompt(0), _prompt(1), _prompt(2), _prompt(3)]
    params = [short, long, short, long]  # the image requests (even) finish first
    stats = graph_llm.llm_engine.runner.stats
    before = stats.graph_replays.copy()
    g = graph_llm.generate(prompts, params, use_tqdm=False)
    e = eager_llm.generate(prompts, params, use_tqdm=False)
    check_logprobs_close(vllm_greedy(e), vllm_greedy(g), "eager", "graph")
    delta = stats.graph_replays - before
    assert delta[("cross", 4)] >= 1 and delta[("text", 2)] >= 1


def test_text_family_skips_cross_layers(pair) -> None:
    """A text-only batch never runs a cross-attention layer."""
    llm = pair[0]
    model = llm.llm_engine.runner.model
    calls = []
    layers = [m for m in model.modules() if type(m).__name__ == "MllamaCrossAttentionDecoderLayer"]
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in layers]
    try:
        llm.generate(["Only text here", "More text"],
                     SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert calls == []
        llm.generate([_prompt(0)], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert calls
    finally:
        for h in hooks:
            h.remove()


def test_rows_uploaded_only_when_they_change(pair, monkeypatch) -> None:
    """Steady decode keeps its rows: the row buffer is written when they change, not per
    step, and always holds the padded rows of the last run."""
    llm = pair[0]
    _start_decoding(llm, 3)
    graphs = llm.llm_engine.runner.graphs
    rows = [s.row for r in llm.llm_engine.scheduler.running for s in r.seqs]
    uploads = []
    real_upload = graphs._upload_rows
    monkeypatch.setattr(graphs, "_upload_rows", lambda r: (uploads.append(r), real_upload(r)))
    null = graphs.null_row
    graphs._uploaded_rows = None
    with torch.inference_mode():
        for ids in (rows, rows, rows[:2], rows[:2], rows[::-1]):
            graphs.run(ids, cross=False)
            padded = ids + [null] * (graphs.bucket_for(len(ids)) - len(ids))
            assert graphs.static_rows[:len(padded)].tolist() == padded
    assert uploads == [rows + [null], rows[:2], rows[::-1] + [null]]
    _finish(llm)
