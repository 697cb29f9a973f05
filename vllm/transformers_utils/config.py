"""Parses a Llama 3.2 Vision ``config.json`` into frozen dataclasses.

Both layouts seen in the wild are accepted: the hub layout (top-level ``rope_theta`` and
``rope_scaling`` inside ``text_config``) and the transformers 5 layout (``rope_parameters``).
Only the fields the engine needs are kept; each is validated with an error naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MLLAMA_ARCHITECTURE = "MllamaForConditionalGeneration"
DEFAULT_ASPECT_RATIOS = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))


class ConfigError(ValueError):
    """A checkpoint's configuration is missing a field or is inconsistent."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (``rope_type`` is ``default`` or ``llama3``)."""

    rope_type: str = "default"
    theta: float = 500000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TextSpec:
    """The text decoder: Llama 3.1 blocks, some of them replaced by gated cross-attention."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    cross_attention_layers: tuple[int, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def self_attention_layers(self) -> tuple[int, ...]:
        cross = set(self.cross_attention_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in cross)

    @property
    def num_embeddings(self) -> int:
        # Meta's 8 learnable embedding rows sit after the vocabulary (the image token is one).
        return self.vocab_size + 8


@dataclass(frozen=True)
class VisionSpec:
    """The ViT-H/14 vision encoder with tiled input."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_global_layers: int
    attention_heads: int
    image_size: int
    patch_size: int
    max_num_tiles: int
    intermediate_layers_indices: tuple[int, ...]
    vision_output_dim: int
    supported_aspect_ratios: tuple[tuple[int, int], ...]
    norm_eps: float = 1e-5
    num_channels: int = 3
    hidden_act: str = "gelu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.attention_heads

    @property
    def tokens_per_tile(self) -> int:
        """Patches plus the class token: 1601 for 560-px tiles of 14-px patches."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def padded_tokens_per_tile(self) -> int:
        """The encoder pads each tile's tokens to a multiple of 8 (1601 -> 1608)."""
        return -(-self.tokens_per_tile // 8) * 8

    @property
    def max_aspect_ratio_id(self) -> int:
        return len(self.supported_aspect_ratios)


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's ``quantization_config``: the fields the engine checks before loading
    (the per-tensor details are in the weights themselves)."""

    method: str
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    quant_type: str | None = None
    compute_dtype: str | None = None
    double_quant: bool = False
    quant_storage: str | None = None
    # The whole block, for methods whose loader reads more (compressed-tensors' schemes).
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class MllamaSpec:
    """A whole ``MllamaForConditionalGeneration`` configuration."""

    text: TextSpec
    vision: VisionSpec
    image_token_id: int
    torch_dtype: str | None = None
    quantization: QuantSpec | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_vision_tokens_per_image(self) -> int:
        return self.vision.max_num_tiles * self.vision.tokens_per_tile


def _require(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"config.json: `{where}.{key}` is missing")
    return d[key]


def _parse_rope(text: dict[str, Any]) -> RopeSpec:
    params = text.get("rope_parameters")
    if params is None:
        scaling = text.get("rope_scaling") or {}
        params = dict(scaling)
        params.setdefault("rope_theta", text.get("rope_theta", 500000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(
            f"config.json: rope type {rope_type!r} is not supported (llama3, default)")
    return RopeSpec(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", 500000.0)),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_text_config(text: dict[str, Any]) -> TextSpec:
    w = "text_config"
    spec = TextSpec(
        vocab_size=int(_require(text, "vocab_size", w)),
        hidden_size=int(_require(text, "hidden_size", w)),
        intermediate_size=int(_require(text, "intermediate_size", w)),
        num_hidden_layers=int(_require(text, "num_hidden_layers", w)),
        num_attention_heads=int(_require(text, "num_attention_heads", w)),
        num_key_value_heads=int(text.get("num_key_value_heads", text["num_attention_heads"])),
        cross_attention_layers=tuple(int(i) for i in _require(text, "cross_attention_layers", w)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
        rope=_parse_rope(text),
        hidden_act=text.get("hidden_act", "silu"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        bos_token_id=text.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(text.get("eos_token_id")),
        pad_token_id=text.get("pad_token_id"),
    )
    if spec.hidden_size % spec.num_attention_heads:
        raise ConfigError("config.json: text hidden_size must be divisible by num_attention_heads")
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ConfigError(
            "config.json: text num_attention_heads must be divisible by num_key_value_heads"
        )
    bad = [i for i in spec.cross_attention_layers if not 0 <= i < spec.num_hidden_layers]
    if bad:
        raise ConfigError(
            f"config.json: cross_attention_layers {bad} are outside 0..{spec.num_hidden_layers - 1}"
        )
    if spec.hidden_act != "silu":
        raise ConfigError(f"config.json: text hidden_act {spec.hidden_act!r} is not supported")
    return spec


def parse_vision_config(vision: dict[str, Any]) -> VisionSpec:
    w = "vision_config"
    ratios = vision.get("supported_aspect_ratios") or DEFAULT_ASPECT_RATIOS
    image_size = vision.get("image_size", 448)
    patch_size = vision.get("patch_size", 14)
    if isinstance(image_size, (list, tuple)):
        if image_size[0] != image_size[1]:
            raise ConfigError("config.json: only square vision tiles are supported")
        image_size = image_size[0]
    if isinstance(patch_size, (list, tuple)):
        patch_size = patch_size[0]
    spec = VisionSpec(
        hidden_size=int(_require(vision, "hidden_size", w)),
        intermediate_size=int(_require(vision, "intermediate_size", w)),
        num_hidden_layers=int(_require(vision, "num_hidden_layers", w)),
        num_global_layers=int(vision.get("num_global_layers", 8)),
        attention_heads=int(vision.get("attention_heads", vision.get("num_attention_heads", 16))),
        image_size=int(image_size),
        patch_size=int(patch_size),
        max_num_tiles=int(vision.get("max_num_tiles", 4)),
        intermediate_layers_indices=tuple(
            int(i) for i in vision.get("intermediate_layers_indices", (3, 7, 15, 23, 30))
        ),
        vision_output_dim=int(vision.get("vision_output_dim", 7680)),
        supported_aspect_ratios=tuple((int(a), int(b)) for a, b in ratios),
        norm_eps=float(vision.get("norm_eps", 1e-5)),
        num_channels=int(vision.get("num_channels", 3)),
        hidden_act=vision.get("hidden_act", "gelu"),
    )
    expected_out = spec.hidden_size * (1 + len(spec.intermediate_layers_indices))
    if spec.vision_output_dim != expected_out:
        raise ConfigError(
            f"config.json: vision_output_dim is {spec.vision_output_dim}, expected hidden_size x "
            f"(1 + len(intermediate_layers_indices)) = {expected_out}"
        )
    bad = [i for i in spec.intermediate_layers_indices if not 0 <= i < spec.num_hidden_layers]
    if bad:
        raise ConfigError(f"config.json: vision intermediate_layers_indices {bad} out of range")
    if spec.image_size % spec.patch_size:
        raise ConfigError("config.json: vision image_size must be a multiple of patch_size")
    if spec.hidden_act != "gelu":
        raise ConfigError(f"config.json: vision hidden_act {spec.hidden_act!r} is not supported")
    return spec


def parse_quantization_config(raw: dict[str, Any]) -> QuantSpec | None:
    """The ``quantization_config`` block (``compression_config`` in some early uploads), or
    None for an unquantized checkpoint. Whether the method is served is decided later."""
    q = raw.get("quantization_config", raw.get("compression_config"))
    if q is None:
        return None
    if not isinstance(q, dict) or not isinstance(q.get("quant_method"), str):
        raise ConfigError("config.json: `quantization_config.quant_method` is missing")

    def flag(*keys: str) -> bool:  # transformers writes both `load_in_4bit` and `_load_in_4bit`
        return any(bool(q.get(k)) for k in keys)

    return QuantSpec(
        method=q["quant_method"].lower(),
        load_in_4bit=flag("load_in_4bit", "_load_in_4bit"),
        load_in_8bit=flag("load_in_8bit", "_load_in_8bit"),
        quant_type=q.get("bnb_4bit_quant_type"),
        compute_dtype=q.get("bnb_4bit_compute_dtype"),
        double_quant=bool(q.get("bnb_4bit_use_double_quant", False)),
        quant_storage=q.get("bnb_4bit_quant_storage"),
        config=q,
    )


def parse_mllama_config(raw: dict[str, Any]) -> MllamaSpec:
    """Builds an :class:`MllamaSpec` from the parsed JSON of a checkpoint's config.json."""
    archs = raw.get("architectures") or [MLLAMA_ARCHITECTURE]
    if raw.get("model_type", "mllama") != "mllama" or MLLAMA_ARCHITECTURE not in archs:
        raise ConfigError(
            f"config.json describes {archs} (model_type {raw.get('model_type')!r}); "
            f"this engine serves {MLLAMA_ARCHITECTURE} only"
        )
    text = parse_text_config(_require(raw, "text_config", "config"))
    vision = parse_vision_config(_require(raw, "vision_config", "config"))
    image_token_id = int(raw.get("image_token_index", raw.get("image_token_id", 128256)))
    if not 0 <= image_token_id < text.num_embeddings:
        raise ConfigError(
            f"config.json: image_token_index {image_token_id} is outside the embedding table "
            f"({text.num_embeddings} rows)"
        )
    dtype = raw.get("torch_dtype") or raw.get("dtype") or text_dtype(raw)
    return MllamaSpec(text=text, vision=vision, image_token_id=image_token_id,
                      torch_dtype=dtype, quantization=parse_quantization_config(raw), raw=raw)


def text_dtype(raw: dict[str, Any]) -> str | None:
    text = raw.get("text_config") or {}
    return text.get("torch_dtype") or text.get("dtype")


def load_mllama_config(
    model_dir: str | Path, overrides: dict[str, Any] | None = None
) -> MllamaSpec:
    """Reads ``config.json`` from a local checkpoint folder; ``overrides`` (``hf_overrides``)
    replace its values, nested objects (``text_config``, ``vision_config``) key by key."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (a checkpoint folder needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if overrides:
        raw = apply_overrides(raw, overrides)
    try:
        return parse_mllama_config(raw)
    except (TypeError, ValueError, KeyError) as e:
        if not overrides or isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config.json with hf_overrides: {e}") from e


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` over ``raw``: a dict value over a dict merges into it (recursively)."""
    out = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = apply_overrides(out[key], value)
        else:
            out[key] = value
    return out
