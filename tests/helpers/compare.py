"""Comparison of greedy outputs with logprobs (vLLM's ``check_logprobs_close`` semantics).

Two greedy runs agree if their token sequences are identical up to the first divergence and,
at that position, each side's token is among the other's top-k logprobs (near-ties may flip
under any reordering of float sums). Comparison stops at the first divergence.
"""

from __future__ import annotations

from collections.abc import Sequence

TokensAndLogprobs = tuple[list[int], list[dict[int, float]]]


def check_logprobs_close(outputs_0: Sequence[TokensAndLogprobs],
                         outputs_1: Sequence[TokensAndLogprobs],
                         name_0: str = "ref", name_1: str = "test") -> None:
    assert len(outputs_0) == len(outputs_1), (len(outputs_0), len(outputs_1))
    for i, ((ids_0, lps_0), (ids_1, lps_1)) in enumerate(zip(outputs_0, outputs_1,
                                                             strict=True)):
        assert ids_0 and ids_1, f"prompt {i}: empty output"
        for pos, (t0, t1) in enumerate(zip(ids_0, ids_1, strict=False)):
            if t0 == t1:
                continue
            assert t0 in lps_1[pos], (
                f"prompt {i}, position {pos}: {name_0} token {t0} not in {name_1}'s top "
                f"logprobs {lps_1[pos]}\n{name_0}: {ids_0}\n{name_1}: {ids_1}")
            assert t1 in lps_0[pos], (
                f"prompt {i}, position {pos}: {name_1} token {t1} not in {name_0}'s top "
                f"logprobs {lps_0[pos]}\n{name_0}: {ids_0}\n{name_1}: {ids_1}")
            break


def vllm_greedy(outputs) -> list[TokensAndLogprobs]:
    """RequestOutputs -> (token ids, per-position {token: logprob}) of the first sample."""
    out = []
    for o in outputs:
        c = o.outputs[0]
        lps = [{t: lp.logprob for t, lp in step.items()} for step in (c.logprobs or [])]
        out.append((list(c.token_ids), lps))
    return out


def assert_epilogue_matches(fused, separate) -> None:
    """A GEMM with the SiLU-and-multiply in its epilogue against the same GEMM followed by
    ``silu_and_mul``: bitwise on CUDA. Under Triton's interpreter ``tl.dot`` and ``tl.sum``
    are NumPy's, whose float32 summation order depends on a column's place in the matrix
    (``A @ B`` and ``A @ B[:, j]`` differ in the last bit), and the GEMM alone puts up's
    columns in other tiles than the fused kernel does: a sum that cancels to a small value can
    round a step or two apart (FP8, 1 of 40 random inputs on an AVX2 CPU)."""
    import torch

    if fused.is_cuda:
        assert torch.equal(fused, separate)
    else:
        torch.testing.assert_close(fused, separate, rtol=2**-6, atol=2**-14)
