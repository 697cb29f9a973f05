"""The KV cache's storage dtype (``--kv-cache-dtype``) and the rounding it implies.

``auto`` keeps K/V in the model dtype. ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` store every
self- and cross-attention K/V row in one byte a value with scale 1.0: the value is clamped to
the format's largest finite magnitude and rounded to nearest even. The pool then holds twice
the tokens.

Semantics: every attention read of K/V, prefill included, sees the rounded values, as if
the projections' K/V (after RoPE, after the cross layers' k_norm) went through
``round_kv``. Prefill attends to its fresh K/V, so the layer rounds them the same way
before it attends (``Attention`` / ``CrossAttention``); decode reads the cache. A token's
result therefore does not depend on whether its context came from this step or from pages.
"""

from __future__ import annotations

import torch

# The names vLLM accepts for --kv-cache-dtype, with the storage dtype (None: the model dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for a ``--kv-cache-dtype`` name; ValueError for an unknown one."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                         f"got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2); 0.0 for any
    other dtype (the kernels' "no clamp" value)."""
    return float(torch.finfo(dtype).max) if is_fp8(dtype) else 0.0


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: clamped to the FP8 range, then cast (round to nearest
    even); for other cache dtypes a plain cast. NaN stays NaN."""
    if is_fp8(cache_dtype):
        limit = fp8_max(cache_dtype)
        return x.clamp(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def round_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as an attention read of the cache sees it, in ``x``'s dtype: rounded through
    ``cache_dtype`` when that is FP8, ``x`` itself otherwise."""
    if not is_fp8(cache_dtype):
        return x
    return to_cache(x, cache_dtype).to(x.dtype)
