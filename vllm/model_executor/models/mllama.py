"""Llama 3.2 Vision (``MllamaForConditionalGeneration``): text decoder, projector, top level.

Semantics follow Meta's reference (docs/architecture.md, "Model semantics"): cross-attention
layers gate both branches by tanh and zero both branches for text tokens that see no image (the
per-token row mask). The forward reads per-step attention metadata from the forward
context; the skip of the cross layers is decided from the host integer ``max_encoder_seq_len``.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.attention.layer import Attention, CrossAttention
from vllm.distributed.parallel_state import all_gather_last, all_reduce, get_tp
from vllm.forward_context import get_attention_metadata
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import MaskedGate, RMSNorm
from vllm.model_executor.layers.linear import Linear, MergedLinear
from vllm.model_executor.layers.quantization import QuantizationConfig, join, layer_format
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.models.mllama_vision import MllamaVisionModel
from vllm.transformers_utils.config import MllamaSpec, TextSpec


def _local_heads(spec: TextSpec) -> tuple[int, int, int]:
    """This rank's query and KV heads, and the head size."""
    tp = get_tp()
    return (tp.part(spec.num_attention_heads, "attention heads"),
            tp.part(spec.num_key_value_heads, "KV heads"), spec.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, spec: TextSpec, quant: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        i = get_tp().part(spec.intermediate_size, "intermediate_size")  # this rank's columns
        gate_up = join(prefix, "gate_up_proj")
        self.gate_up_proj = MergedLinear(spec.hidden_size, [i, i], ["gate", "up"],
                                         fmt=layer_format(quant, gate_up, ("gate", "up")))
        self.down_proj = Linear(i, spec.hidden_size,
                                fmt=layer_format(quant, join(prefix, "down_proj")))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up_proj.silu_kernel()
        if fused is not None:  # decode sizes: the activation in the GEMM's epilogue
            return all_reduce(self.down_proj(fused(x)))
        return all_reduce(self.down_proj(self.act(self.gate_up_proj(x))))


class LlamaSelfAttention(nn.Module):
    def __init__(self, spec: TextSpec, rotary: RotaryEmbedding,
                 quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hq, hkv, d = _local_heads(spec)
        qkv = join(prefix, "qkv_proj")
        self.qkv_proj = MergedLinear(spec.hidden_size, [hq * d, hkv * d, hkv * d],
                                     ["q", "k", "v"], fmt=layer_format(quant, qkv, ("q", "k", "v")))
        self.o_proj = Linear(hq * d, spec.hidden_size,
                             fmt=layer_format(quant, join(prefix, "o_proj")))
        self.attn = Attention(hq, hkv, d)
        self.rotary = [rotary]  # shared; kept out of the module tree

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        # RoPE is applied by the attention layer: on CUDA fused into its KV-cache write.
        return all_reduce(self.o_proj(self.attn(q, k, v, positions, self.rotary[0])))


class LlamaDecoderLayer(nn.Module):
    """A Llama 3.1 block: pre-norm self-attention and SwiGLU MLP with residuals.

    Layers pass ``(delta, residual)``: the hidden state is ``residual + delta``, and each norm
    performs that add (fused on CUDA) before normalising.
    """

    def __init__(self, spec: TextSpec, rotary: RotaryEmbedding,
                 quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = LlamaSelfAttention(spec, rotary, quant, join(prefix, "self_attn"))
        self.mlp = LlamaMLP(spec, quant, join(prefix, "mlp"))
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class MllamaCrossAttention(nn.Module):
    """Text queries attend to vision keys; q and k get per-head RMS norms, no RoPE."""

    def __init__(self, spec: TextSpec, quant: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        hq, hkv, d = _local_heads(spec)
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.q_proj = Linear(spec.hidden_size, hq * d,
                             fmt=layer_format(quant, join(prefix, "q_proj")))
        self.kv_proj = MergedLinear(spec.hidden_size, [hkv * d, hkv * d], ["k", "v"],
                                    fmt=layer_format(quant, join(prefix, "kv_proj"), ("k", "v")))
        self.o_proj = Linear(hq * d, spec.hidden_size,
                             fmt=layer_format(quant, join(prefix, "o_proj")))
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.attn = CrossAttention(hq, hkv, d)

    def forward(self, x: torch.Tensor, vision: torch.Tensor | None) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = v = None
        if vision is not None:
            k, v = self.kv_proj.split(self.kv_proj(vision))
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        return all_reduce(self.o_proj(self.attn(q.reshape(t, -1), k, v)))


class MllamaCrossAttentionDecoderLayer(nn.Module):
    """Gated cross-attention block; rows that see no image get neither branch."""

    def __init__(self, spec: TextSpec, quant: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.cross_attn = MllamaCrossAttention(spec, quant, join(prefix, "cross_attn"))
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.mlp = LlamaMLP(spec, quant, join(prefix, "mlp"))
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1), requires_grad=False)
        # tanh of the gates, refreshed after loading (two fewer launches per layer and step).
        self.register_buffer("gates_tanh", torch.zeros(2), persistent=False)
        self.mlp_gate = MaskedGate()

    def refresh_gates(self) -> None:
        with torch.no_grad():
            self.gates_tanh.copy_(torch.cat((self.cross_attn_attn_gate.tanh(),
                                             self.cross_attn_mlp_gate.tanh())))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                vision: torch.Tensor | None,
                row_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # row_mask: [T, 1] bool. Both branches are gated by tanh and zeroed (torch.where, so
        # a NaN in a masked row stays out) for tokens that see no image.
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.cross_attn(h, vision)
        h, residual = self.post_attention_layernorm.forward_gated(
            h, residual, self.gates_tanh[0:1], row_mask)
        return self.mlp_gate(self.mlp(h), self.gates_tanh[1:2], row_mask), residual


class MllamaTextModel(nn.Module):
    def __init__(self, spec: TextSpec, max_position: int,
                 quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.spec = spec
        # Vocabulary-parallel: this rank's rows [start, start + rows) of the table.
        tp = get_tp()
        rows = tp.part(spec.num_embeddings, "embedding rows")
        self.embed_start = tp.rank * rows
        self.embed_tokens = nn.Embedding(rows, spec.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(spec.head_dim, max_position, spec.rope)
        cross = set(spec.cross_attention_layers)
        self.layers = nn.ModuleList(
            MllamaCrossAttentionDecoderLayer(spec, quant, join(prefix, f"layers.{i}"))
            if i in cross
            else LlamaDecoderLayer(spec, self.rotary, quant, join(prefix, f"layers.{i}"))
            for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp().size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.embed_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0))
        return all_reduce(torch.where(mine[:, None], x, 0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                vision: torch.Tensor | None) -> torch.Tensor:
        md = get_attention_metadata()
        skip_cross = md.skip_cross_attention
        row_mask = None if skip_cross else md.cross_row_mask()
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            if isinstance(layer, MllamaCrossAttentionDecoderLayer):
                if skip_cross:
                    continue
                x, residual = layer(x, residual, vision, row_mask)
            else:
                x, residual = layer(positions, x, residual)
        if residual is None:
            return self.norm(x)
        return self.norm(x, residual)[0]


class MllamaForCausalLM(nn.Module):
    def __init__(self, spec: TextSpec, max_position: int,
                 quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.model = MllamaTextModel(spec, max_position, quant, join(prefix, "model"))
        self.lm_head = Linear(spec.hidden_size, get_tp().part(spec.vocab_size, "vocabulary"),
                              fmt=layer_format(quant, join(prefix, "lm_head")))


class MllamaForConditionalGeneration(nn.Module):
    """The whole model. Parameter names follow the hub checkpoint except the fused projections
    (``qkv_proj``, ``gate_up_proj``, cross ``kv_proj``); see ``mllama_weights.py``.

    ``quant_config`` chooses each linear layer's storage format by its parameter prefix (None:
    every layer unquantized)."""

    def __init__(self, spec: MllamaSpec, max_position: int | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.quant_config = quant_config
        max_position = max_position or spec.text.max_position_embeddings
        self.vision_model = MllamaVisionModel(spec.vision, quant_config, "vision_model")
        self.multi_modal_projector = Linear(
            spec.vision.vision_output_dim, spec.text.hidden_size, bias=True,
            fmt=layer_format(quant_config, "multi_modal_projector"))
        self.language_model = MllamaForCausalLM(spec.text, max_position, quant_config,
                                                "language_model")

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the embedding table's: embeddings are never quantized)."""
        return self.language_model.model.embed_tokens.weight.dtype

    def encode_images(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                      num_tiles: list[int]) -> torch.Tensor:
        """-> projected vision tokens of all images, packed: [sum(num_tiles) * P, H_text]."""
        features = self.vision_model(pixel_values, aspect_ratio_ids, num_tiles)
        return self.multi_modal_projector(features)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cross_attention_states: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, H]. ``cross_attention_states`` are
        this prefill step's packed vision tokens (None in decode)."""
        return self.language_model.model(input_ids, positions, cross_attention_states)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> float32 logits [N, vocab] (written into ``out`` when given)."""
        if get_tp().size > 1:  # each rank's vocabulary columns, gathered in rank order
            full = all_gather_last(self.language_model.lm_head(hidden_states).float())
            return full if out is None else out.copy_(full)
        if out is None:
            return self.language_model.lm_head(hidden_states).float()
        return self.language_model.lm_head(hidden_states, out=out)

    def post_load(self) -> None:
        """Derived state computed once the weights are in place."""
        for layer in self.language_model.model.layers:
            if isinstance(layer, MllamaCrossAttentionDecoderLayer):
                layer.refresh_gates()

    def attention_layers(self) -> tuple[list[Attention], list[CrossAttention]]:
        """Self and cross attention layers in layer order (the cache engine binds their pages)."""
        selfs, crosses = [], []
        for layer in self.language_model.model.layers:
            if isinstance(layer, MllamaCrossAttentionDecoderLayer):
                crosses.append(layer.cross_attn.attn)
            else:
                selfs.append(layer.self_attn.attn)
        return selfs, crosses
