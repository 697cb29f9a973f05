"""Test-only helpers (the HF reference with its Meta-parity shim, comparisons, fixtures)."""
