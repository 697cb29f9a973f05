"""Where an engine's start-up time goes (logged once, kept on the engine for benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StartupTimes:
    """Seconds of each start-up phase. ``load``: weights and kernel choice; ``vision_graphs``:
    the vision tower's CUDA graphs; ``profile``: the memory profile that sizes the KV pool;
    ``decode_graphs``: the decode CUDA graphs; ``warmup``: the synthetic requests run before
    the first real one. ``total`` also holds what lies between them (tokenizer, page pool,
    input processor), so the parts sum to at most it."""

    load: float
    vision_graphs: float
    profile: float
    decode_graphs: float
    warmup: float
    total: float

    def parts(self) -> dict[str, float]:
        return {
            "load": self.load,
            "vision graphs": self.vision_graphs,
            "profile": self.profile,
            "decode graphs": self.decode_graphs,
            "warm-up": self.warmup,
        }

    def describe(self) -> str:
        split = ", ".join(f"{name} {sec:.1f} s" for name, sec in self.parts().items())
        return f"Start-up took {self.total:.1f} s: {split}"
