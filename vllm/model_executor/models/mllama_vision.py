"""The Llama 3.2 Vision encoder: tiled ViT-H/14 with gated aspect-ratio embeddings.

Every image is encoded at the model's maximum tile count, as the reference does: padded tiles
and the per-tile padding tokens (1601 -> 1608) take part in attention, masked only against
each other. Instead of a dense mask, each image's tokens are permuted once so the valid tokens
come first; then every attention layer is two maskless calls (valid queries over all keys,
padding queries over the valid keys). The output keeps only the valid tiles' tokens, with the
*inputs* of the intermediate layers appended (Meta's reference; HF >= 4.56 takes outputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from vllm.model_executor.layers.linear import Linear, MergedLinear
from vllm.transformers_utils.config import VisionSpec
from vllm.utils import to_device

# cuDNN's attention is the fastest SDPA back-end for these shapes on Hopper (head_dim 80).
_CUDA_SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel(_CUDA_SDPA_ORDER, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v)


class VisionAttention(nn.Module):
    """Bidirectional attention over one image's tokens with the valid-first padding rule."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.num_heads = spec.attention_heads
        self.head_dim = spec.head_dim
        d = spec.hidden_size
        self.qkv_proj = MergedLinear(d, [d, d, d], ["q", "k", "v"])
        self.o_proj = Linear(d, d)

    def forward(self, x: torch.Tensor, num_valid: int) -> torch.Tensor:
        # x: [G, L, D] with the first `num_valid` tokens of every row valid.
        g, length, _ = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k, v = (t.view(g, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in (q, k, v))
        # Valid queries see every key; padding queries see only valid keys. One maskless
        # call computes the valid rows; the few padding rows are then redone over the
        # valid keys (cheaper than splitting the big call and concatenating).
        out = _sdpa(q, k, v)
        if num_valid < length:
            out[:, :, num_valid:] = _sdpa(q[:, :, num_valid:], k[:, :, :num_valid],
                                          v[:, :, :num_valid])
        out = out.transpose(1, 2).reshape(g, length, -1)
        return self.o_proj(out)


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.fc1 = Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.fc2 = Linear(spec.intermediate_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm transformer layer; the global layers scale both branches by tanh gates."""

    def __init__(self, spec: VisionSpec, gated: bool) -> None:
        super().__init__()
        self.self_attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)
        self.input_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.gated = gated
        if gated:
            self.gate_attn = nn.Parameter(torch.zeros(1), requires_grad=False)
            self.gate_ffn = nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, x: torch.Tensor, num_valid: int) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), num_valid)
        if self.gated:
            h = self.gate_attn.tanh() * h
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        if self.gated:
            h = self.gate_ffn.tanh() * h
        return x + h


class VisionEncoder(nn.Module):
    def __init__(self, spec: VisionSpec, num_layers: int, gated: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(spec, gated) for _ in range(num_layers))


class AspectRatioEmbedding(nn.Module):
    """A learned per-tile vector chosen by the image's aspect-ratio id, scaled by tanh(gate)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.max_num_tiles = spec.max_num_tiles
        self.embedding = nn.Embedding(spec.max_aspect_ratio_id + 1,
                                      spec.max_num_tiles * spec.hidden_size)
        self.gate = nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        # -> [N, T, D]
        emb = self.embedding(aspect_ratio_ids)
        return emb.view(aspect_ratio_ids.shape[0], self.max_num_tiles, -1) * self.gate.tanh()


class PositionEmbedding(nn.Module):
    """Gated mix of a per-token position embedding and a per-aspect-ratio tile embedding."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        p, d = spec.tokens_per_tile, spec.hidden_size
        self.embedding = nn.Parameter(torch.zeros(p, d), requires_grad=False)
        self.gate = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.tile_embedding = nn.Embedding(spec.max_aspect_ratio_id + 1,
                                           spec.max_num_tiles * p * d)

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        # x: [N, T, P, D]
        n, t, p, d = x.shape
        gate = self.gate.tanh()
        x = x + (1 - gate) * self.embedding.view(1, 1, p, d)
        tile = self.tile_embedding(aspect_ratio_ids).view(n, t, p, d)
        return x + gate * tile


def _valid_first_order(num_tiles: int, max_tiles: int, tokens: int, padded: int,
                       device: torch.device) -> torch.Tensor:
    """Token order putting the valid tokens of the first ``num_tiles`` tiles first.

    Built on the device without a boolean index (no host sync), so it can be captured."""
    idx = torch.arange(max_tiles * padded, device=device)
    tile = torch.div(idx, padded, rounding_mode="floor")
    valid = (tile < num_tiles) & (idx - tile * padded < tokens)
    return torch.argsort((~valid).to(torch.int8), stable=True)


class MllamaVisionModel(nn.Module):
    """Pixels of tiled images -> per-token features ``[num_valid_tokens, vision_output_dim]``."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        d = spec.hidden_size
        self.patch_embedding = nn.Conv2d(spec.num_channels, d, spec.patch_size,
                                         spec.patch_size, bias=False)
        self.patch_embedding.weight.requires_grad_(False)
        self.class_embedding = nn.Parameter(torch.zeros(d), requires_grad=False)
        self.gated_positional_embedding = PositionEmbedding(spec)
        self.pre_tile_positional_embedding = AspectRatioEmbedding(spec)
        self.post_tile_positional_embedding = AspectRatioEmbedding(spec)
        self.layernorm_pre = nn.LayerNorm(d)
        self.layernorm_post = nn.LayerNorm(d)
        self.transformer = VisionEncoder(spec, spec.num_hidden_layers, gated=False)
        self.global_transformer = VisionEncoder(spec, spec.num_global_layers, gated=True)

    def _embed(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        # pixel_values: [N, T, C, S, S] -> [N, T, P_padded, D]
        s = self.spec
        n, t = pixel_values.shape[:2]
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.flatten(0, 1).to(w.dtype))
        x = x.flatten(2).transpose(1, 2).view(n, t, -1, s.hidden_size)
        x = x + self.pre_tile_positional_embedding(aspect_ratio_ids).unsqueeze(2)
        cls = self.class_embedding.view(1, 1, 1, -1).expand(n, t, 1, -1)
        x = torch.cat((cls, x), dim=2)
        x = self.gated_positional_embedding(x, aspect_ratio_ids)
        x = self.layernorm_pre(x)
        return F.pad(x, (0, 0, 0, s.padded_tokens_per_tile - s.tokens_per_tile))

    def _encode_group(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                      num_tiles: int) -> torch.Tensor:
        """Images sharing a tile count: [G, T, P_padded, D] -> [G, num_tiles * P, D_out]."""
        s = self.spec
        g, t, pp, d = x.shape
        p = s.tokens_per_tile
        order = _valid_first_order(num_tiles, t, p, pp, x.device)
        num_valid = num_tiles * p
        x = x.reshape(g, t * pp, d)[:, order]
        features = []
        inter = set(s.intermediate_layers_indices)
        for i, layer in enumerate(self.transformer.layers):
            if i in inter:
                features.append(x[:, :num_valid])
            x = layer(x, num_valid)
        x = self.layernorm_post(x)
        tile_of_token = torch.div(order, pp, rounding_mode="floor")
        post = self.post_tile_positional_embedding(aspect_ratio_ids)  # [G, T, D]
        x = x + post[:, tile_of_token]
        for layer in self.global_transformer.layers:
            x = layer(x, num_valid)
        stacked = torch.stack(features, dim=-1).reshape(g, num_valid, -1)
        return torch.cat((x[:, :num_valid], stacked), dim=-1)

    def forward(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                num_tiles: list[int]) -> torch.Tensor:
        """pixel_values [N, max_tiles, C, S, S], aspect_ratio_ids [N], host tile counts ->
        packed valid tokens of all images in order, [sum(num_tiles) * P, vision_output_dim]."""
        x = self._embed(pixel_values, aspect_ratio_ids)
        if len(set(num_tiles)) == 1:  # one group: no gather (and no host copy to capture)
            encoded = self._encode_group(x, aspect_ratio_ids, num_tiles[0])
            return encoded.reshape(-1, encoded.shape[-1])
        outputs: list[torch.Tensor | None] = [None] * len(num_tiles)
        for nt in sorted(set(num_tiles)):
            members = [i for i, n in enumerate(num_tiles) if n == nt]
            index = to_device(members, torch.int64, x.device)
            encoded = self._encode_group(x[index], aspect_ratio_ids[index], nt)
            for j, i in enumerate(members):
                outputs[i] = encoded[j]
        return torch.cat(outputs, dim=0)  # type: ignore[arg-type]
