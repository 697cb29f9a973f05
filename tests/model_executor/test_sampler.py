"""The on-device sampler: greedy, filters, penalties, seeds, logprobs, and no host syncs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm.model_executor.layers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    compute_prompt_logprobs,
    make_generator,
)
from vllm.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NUM_DRAWS = 20_000
TOLERANCE = 0.01


def row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    device: str = "cpu",
    stop_ids: Sequence[int] = (),
) -> SamplingRow:
    generator = None if params.seed is None else make_generator(params.seed, device)
    return SamplingRow(params, list(prompt), list(output), generator, tuple(stop_ids))


def run(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    metadata = SamplingMetadata.build(rows, logits.shape[1], logits.device)
    return Sampler()(logits, metadata)


# ---------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_with_lowest_index_on_ties(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50, device=device)
    logits[3, 7] = logits[3, 30] = logits[3].max() + 1.0  # a tie: index 7 wins
    out = run(logits, [row(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[3].item() == 7
    assert out.logprobs is None and out.sampled_ranks is None


def test_precomputed_greedy_ids_used_only_without_logit_edits() -> None:
    """The decode graphs hand the sampler their argmax: taken as is for plain greedy rows,
    recomputed when a logit edit (here a bias) changes the logits."""
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    marker = torch.tensor([11, 12])  # deliberately not the argmax: shows which one is used
    plain = [row(SamplingParams(temperature=0.0))] * 2
    md = SamplingMetadata.build(plain, 30, logits.device)
    assert torch.equal(Sampler()(logits, md, greedy_ids=marker).sampled_token_ids, marker)
    biased = [row(SamplingParams(temperature=0.0, logit_bias={3: 100.0}))] * 2
    md = SamplingMetadata.build(biased, 30, logits.device)
    assert Sampler()(logits, md, greedy_ids=marker).sampled_token_ids.tolist() == [3, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch(device: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 40, device=device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=2, seed=11),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2),
        SamplingParams(temperature=1.2, top_p=0.3, min_p=0.1, frequency_penalty=0.5),
    ]
    rows = [row(p, prompt=[1, 2], output=[3], device=device) for p in params]
    out = run(logits, rows)
    ids = out.sampled_token_ids.tolist()
    assert ids[0] == logits[0].argmax().item()
    assert ids[1] in logits[1].topk(2).indices.tolist()
    assert ids[2] == logits[2].argmax().item()
    penalised = logits[3].clone()
    for t in (1, 2, 3):
        penalised[t] = penalised[t] / 1.5 if penalised[t] > 0 else penalised[t] * 1.5
    assert ids[3] == penalised.argmax().item()
    assert out.logprobs is not None and out.logprobs.shape == (5, 3)


# ---------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_do_not_depend_on_the_batch(device: str) -> None:
    torch.manual_seed(2)
    target = torch.randn(64, device=device)  # a fairly flat distribution: draws differ
    other = torch.randn(3, 64, device=device)

    def tokens(batch: str, seed: int, steps: int = 8) -> list[int]:
        generator = make_generator(seed, device)
        seeded = SamplingRow(SamplingParams(seed=seed), [], [], generator)
        result = []
        for _ in range(steps):
            if batch == "alone":
                rows, logits, index = [seeded], target[None], 0
            else:  # unseeded, greedy and another seeded row around it, different position
                around = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=7)]
                rows = [*(row(p, device=device) for p in around), seeded]
                logits, index = torch.cat([other, target[None]]), 3
            result.append(run(logits, rows).sampled_token_ids[index].item())
        return result

    alone = tokens("alone", 1234)
    assert tokens("mixed", 1234) == alone
    assert tokens("alone", 1234) == alone
    assert tokens("alone", 4321) != alone


# ---------------------------------------------------------------------------------- distributions
def renormalised(probs: list[float], keep: list[bool]) -> list[float]:
    total = sum(p for p, k in zip(probs, keep, strict=True) if k)
    return [p / total if k else 0.0 for p, k in zip(probs, keep, strict=True)]


def softmax(values: list[float], temperature: float = 1.0) -> list[float]:
    exps = [math.exp(v / temperature) for v in values]
    return [e / sum(exps) for e in exps]


def frequencies(
    logits_row: list[float], params: SamplingParams, seeded: bool = False
) -> list[float]:
    vocab = len(logits_row)
    rows = []
    for i in range(NUM_DRAWS):
        generator = make_generator(i, "cpu") if seeded else None
        rows.append(SamplingRow(params, [], [], generator))
    torch.manual_seed(1234)
    logits = torch.tensor(logits_row).expand(NUM_DRAWS, vocab)
    ids = run(logits, rows).sampled_token_ids
    return (torch.bincount(ids, minlength=vocab).double() / NUM_DRAWS).tolist()


BASE = [math.log(p) for p in (0.05, 0.3, 0.02, 0.18, 0.25, 0.08, 0.12)]  # sums to 1


def expected_top_k(probs: list[float], k: int) -> list[float]:
    kth = sorted(probs, reverse=True)[k - 1]
    return renormalised(probs, [p >= kth for p in probs])


def expected_top_p(probs: list[float], top_p: float) -> list[float]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = [False] * len(probs), 0.0
    for i in order:
        if mass >= top_p:
            break
        keep[i], mass = True, mass + probs[i]
    return renormalised(probs, keep)


def expected_min_p(probs: list[float], min_p: float) -> list[float]:
    return renormalised(probs, [p >= min_p * max(probs) for p in probs])


CASES = {
    "plain": (SamplingParams(), softmax(BASE)),
    "temperature": (SamplingParams(temperature=0.5), softmax(BASE, 0.5)),
    "top_k": (SamplingParams(top_k=3), expected_top_k(softmax(BASE), 3)),
    "top_p": (SamplingParams(top_p=0.6), expected_top_p(softmax(BASE), 0.6)),
    "min_p": (SamplingParams(min_p=0.3), expected_min_p(softmax(BASE), 0.3)),
    "top_k_top_p": (
        SamplingParams(temperature=1.5, top_k=4, top_p=0.7),
        expected_top_p(expected_top_k(softmax(BASE, 1.5), 4), 0.7),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_distribution(case: str) -> None:
    params, expected = CASES[case]
    observed = frequencies(BASE, params)
    for token, (got, want) in enumerate(zip(observed, expected, strict=True)):
        if want == 0.0:
            assert got == 0.0, (token, observed)
        assert abs(got - want) < TOLERANCE, (token, observed, expected)


def test_distribution_of_seeded_rows() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=0)
    observed = frequencies(BASE, params, seeded=True)
    expected = expected_top_p(softmax(BASE, 0.8), 0.9)
    assert all(abs(g - w) < TOLERANCE for g, w in zip(observed, expected, strict=True))


def test_top_k_only_path_with_unlimited_rows() -> None:
    """A large vocabulary takes the ``topk`` path; rows without top-k must stay unfiltered."""
    vocab = 256
    probs = [0.3, 0.25, 0.2] + [0.25 / (vocab - 3)] * (vocab - 3)
    logits_row = [math.log(p) for p in probs]
    limited = frequencies(logits_row, SamplingParams(top_k=2))
    assert abs(limited[0] - 0.3 / 0.55) < TOLERANCE and abs(limited[1] - 0.25 / 0.55) < TOLERANCE
    assert sum(limited[2:]) == 0.0
    logits = torch.tensor(logits_row).expand(4000, vocab)
    rows = [row(SamplingParams(top_k=2 if i % 2 else 0)) for i in range(4000)]
    ids = run(logits, rows).sampled_token_ids
    assert (ids[1::2] < 2).all()
    assert abs((ids[0::2] >= 3).double().mean().item() - 0.25) < 0.03


# ---------------------------------------------------------------------------------- logit edits
def test_penalties_match_a_hand_computed_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    # prompt [0, 4]; output [1, 3, 3]. Repetition over {0, 1, 3, 4}:
    #   [2/2, -1*2, 0.5, 3/2, -2*2] = [1, -2, 0.5, 1.5, -4]
    # frequency/presence over output counts {1: 1, 3: 2}:
    #   token 1: -2 - 0.5*1 - 0.25 = -2.75;  token 3: 1.5 - 0.5*2 - 0.25 = 0.25
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.25, -4.0]])
    params.logprobs = 0
    out = run(logits, [row(params, prompt=[0, 4], output=[1, 3, 3])])
    assert out.sampled_token_ids.item() == 0
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs[0, 0], expected.log_softmax(-1)[0, 0])
    # Random rows see the same penalties: a low temperature then picks the penalised argmax.
    rows = [row(SamplingParams(temperature=0.01, frequency_penalty=2.0), output=[3])]
    assert run(torch.tensor([[5.0, 0.0, 0.0, 5.2, 0.0]]), rows).sampled_token_ids.item() == 0


def test_penalties_ignore_out_of_vocab_prompt_ids() -> None:
    """An image token id (>= vocab) in the prompt must not leak into the next row's counts."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [3.0, 1.0, 2.9]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0)
    rows = [row(params, prompt=[3, 1, 7], output=[3]), row(params, prompt=[2], output=[])]
    # Row 0: token 1 seen -> 1.5, token 2 not seen -> 2 wins. Row 1: token 0 untouched -> wins.
    assert run(logits, rows).sampled_token_ids.tolist() == [2, 0]


def test_logit_bias_and_allowed_token_ids() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 20)
    bias = SamplingParams(temperature=0.0, logit_bias={17: 100.0, 2: -5.0}, logprobs=3)
    allowed = SamplingParams(allowed_token_ids=[4, 9], top_p=0.99)
    both = SamplingParams(temperature=0.0, allowed_token_ids=[1, 5], logit_bias={1: -50.0})
    out = run(logits, [row(bias), row(allowed), row(both)])
    assert out.sampled_token_ids[0].item() == 17
    assert out.sampled_token_ids[1].item() in (4, 9)
    assert out.sampled_token_ids[2].item() == 5
    edited = logits[0].clone()
    edited[17] += 100.0
    edited[2] -= 5.0
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs[0, 0], edited.log_softmax(-1)[17])
    # Only two tokens are allowed: the third-best logprob is -inf.
    assert out.logprobs[1, :3].isfinite().all() and out.logprobs[1, 3] == -math.inf
    # Many draws: only allowed ids ever appear.
    many = run(logits[1:2].expand(2000, 20), [row(allowed)] * 2000).sampled_token_ids
    assert set(many.tolist()) == {4, 9}


def test_out_of_vocab_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingMetadata.build([row(SamplingParams(logit_bias={20: 1.0}))], 20, "cpu")
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingMetadata.build([row(SamplingParams(allowed_token_ids=[3, 25]))], 20, "cpu")


def test_min_tokens_suppresses_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 2] = 10.0  # EOS (id 2) dominates
    logits[:, 7] = 9.0  # a stop token id
    params = SamplingParams(temperature=0.0, min_tokens=3)
    rows = [
        row(params, output=[1], stop_ids=[2, 7]),  # 1 < 3: suppress 2 and 7
        row(params, output=[1, 1, 1], stop_ids=[2, 7]),  # reached
        row(SamplingParams(min_tokens=3, temperature=0.5), output=[], stop_ids=[2, 7, 99]),
    ]
    ids = run(logits, rows).sampled_token_ids.tolist()
    assert ids[0] not in (2, 7)
    assert ids[1] == 2
    assert ids[2] not in (2, 7)


# ---------------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_values_order_and_rank(device: str) -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 30, device=device)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=2.0, top_k=10, logprobs=2, seed=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = run(logits, [row(p, device=device) for p in params])
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.sampled_ranks is not None
    assert out.logprobs.shape == (4, 6) and out.logprob_token_ids.dtype == torch.int64
    reference = logits.float().log_softmax(-1)  # before temperature and top-k
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs[:, 0], reference.gather(1, sampled[:, None])[:, 0])
    top_values, top_ids = reference.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    assert torch.allclose(out.logprobs[:, 1:], top_values)
    assert (out.logprobs[:, 1:-1] >= out.logprobs[:, 2:]).all()
    order = reference.argsort(dim=-1, descending=True)
    for i in range(4):
        rank = order[i].tolist().index(sampled[i].item()) + 1
        assert out.sampled_ranks[i].item() == rank
    assert out.sampled_ranks[0].item() == 1 and out.sampled_ranks[3].item() == 1


def test_prompt_logprobs() -> None:
    torch.manual_seed(5)
    logits = torch.randn(6, 12, dtype=torch.bfloat16)
    targets = torch.tensor([3, 0, 11, 5, 5, 1])
    values, ids, ranks = compute_prompt_logprobs(logits, targets, 3)
    reference = logits.float().log_softmax(-1)
    assert values.dtype == torch.float32 and values.shape == (6, 4) and ids.shape == (6, 4)
    assert torch.equal(ids[:, 0], targets)
    assert torch.allclose(values[:, 0], reference[torch.arange(6), targets])
    assert torch.equal(ids[:, 1:], reference.topk(3, dim=-1).indices)
    expected_ranks = (reference > reference[torch.arange(6), targets][:, None]).sum(-1) + 1
    assert torch.equal(ranks, expected_ranks)
    no_top = compute_prompt_logprobs(logits, targets, 0)
    assert no_top[0].shape == (6, 1)


# ---------------------------------------------------------------------------------- no host sync
_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense,
    torch.ops.aten.nonzero,
    torch.ops.aten.is_nonzero,
    torch.ops.aten.item,
}


# Boolean-mask indexing runs ``nonzero`` inside the kernel on CPU (invisible to the mode) but
# syncs on CUDA, so these ops are refused when an index is a mask.
_MASK_INDEX_OPS = {torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_}


class ForbidHostSync(TorchDispatchMode):
    """Raises on every aten op that copies a tensor value to the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        packet = func.overloadpacket
        if packet in _SYNC_OPS or packet is torch.ops.aten.masked_select:
            raise AssertionError(f"host synchronisation: {func}")
        if packet in _MASK_INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            raise AssertionError(f"host synchronisation (boolean-mask index): {func}")
        return func(*args, **(kwargs or {}))


def test_the_guard_catches_syncs() -> None:
    x = torch.ones(3)
    syncing = [lambda: x.sum().item(), lambda: x[x > 0], lambda: x.nonzero()]
    for op in [*syncing, lambda: x.__setitem__(x > 0, 2.0)]:
        with pytest.raises(AssertionError, match="host synchronisation"), ForbidHostSync():
            op()
    with ForbidHostSync():  # integer-tensor indexing is fine
        assert x[torch.tensor([0, 2])].shape == (2,)


SYNC_BATCHES = {
    "all_greedy": [SamplingParams(temperature=0.0)] * 3,
    "mixed_seeded": [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=1, top_k=3),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(seed=2, min_p=0.05),
    ],
    "penalties": [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, min_tokens=4),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, logit_bias={3: 2.0}),
        SamplingParams(allowed_token_ids=[1, 2, 3], top_k=2),
    ],
    "logprobs": [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(seed=9, logprobs=0, top_p=0.5, top_k=20),
        SamplingParams(logprobs=5, repetition_penalty=0.8),
    ],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", SYNC_BATCHES)
def test_forward_never_syncs(batch: str, device: str) -> None:
    torch.manual_seed(6)
    rows = [row(p, [1, 2, 3], [4, 5], device, stop_ids=[0]) for p in SYNC_BATCHES[batch]]
    vocab = 200
    logits = torch.randn(len(rows), vocab, device=device)
    metadata = SamplingMetadata.build(rows, vocab, device)
    if device == "cuda":  # CUDA also reports synchronising calls the dispatch mode cannot see
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with ForbidHostSync():
            out = Sampler()(logits, metadata)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (len(rows),)
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < vocab)).all()
    if batch == "logprobs":
        assert out.logprobs is not None and out.logprobs.shape == (3, 6)
