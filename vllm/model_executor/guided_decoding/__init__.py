"""Structured output through xgrammar: constraints compiled per request, a grammar matcher per
sequence, and the per-row token bitmask the sampler applies.

* ``compiler.py``: ``GrammarCompilerService`` turns a ``GuidedDecodingParams`` into an xgrammar
  ``CompiledGrammar`` (cached per constraint, bounded in size and time, off the engine loop
  on the server).
* ``matcher.py``: ``SequenceGrammar`` (one sequence's matcher, kept in step with its output
  tokens) and ``TokenBitmask`` (the static device buffer of masks, all-ones for rows without a
  constraint, filled from pinned host memory with asynchronous copies).
"""

from vllm.guided_params import GuidedDecodingError, GuidedDecodingParams

__all__ = ["GuidedDecodingError", "GuidedDecodingParams"]
