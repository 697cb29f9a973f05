"""The Llama 3.2 Vision encoder: tiled ViT-H/14 with gated aspect-ratio embeddings.

Every image is encoded at the model's maximum tile count, as the reference does: padded tiles
and the per-tile padding tokens (1601 -> 1608) take part in attention, masked only against
each other. Instead of a dense mask, each image's tokens are permuted once so the valid tokens
come first; then each attention layer runs the valid queries over all keys and the padding
queries over the valid keys (`attention/ops/vision_attention.py`).
The output keeps only the valid tiles' tokens, with the *inputs* of the intermediate layers
appended (Meta's reference; HF >= 4.56 takes outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm.attention.ops.vision_attention import padding_rows_ranges, vision_attention
from vllm.model_executor.layers.kernel_target import KernelTarget
from vllm.model_executor.layers.linear import Linear, MergedLinear
from vllm.model_executor.layers.quantization import QuantizationConfig, join, layer_format
from vllm.transformers_utils.config import VisionSpec
from vllm.utils import to_device


class VisionAttention(nn.Module):
    """Bidirectional attention over one image's tokens with the valid-first padding rule."""

    def __init__(self, spec: VisionSpec, quant: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.num_heads = spec.attention_heads
        self.head_dim = spec.head_dim
        d = spec.hidden_size
        self.qkv_proj = MergedLinear(d, [d, d, d], ["q", "k", "v"],
                                     fmt=layer_format(quant, join(prefix, "qkv_proj"),
                                                      ("q", "k", "v")))
        self.o_proj = Linear(d, d, fmt=layer_format(quant, join(prefix, "o_proj")))

    def forward(self, x: torch.Tensor, num_valid: int,
                pad_ranges: torch.Tensor | None = None) -> torch.Tensor:
        # x: [G, L, D] with the first `num_valid` tokens of every row valid; pad_ranges from
        # `padding_rows_ranges` (None: the padding rows through SDPA).
        g, length, _ = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k, v = (t.view(g, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in (q, k, v))
        # Valid queries see every key; padding queries see only valid keys.
        return self.o_proj(vision_attention(q, k, v, num_valid, pad_ranges))


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec, quant: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.fc1 = Linear(spec.hidden_size, spec.intermediate_size, bias=True,
                          fmt=layer_format(quant, join(prefix, "fc1")))
        self.fc2 = Linear(spec.intermediate_size, spec.hidden_size, bias=True,
                          fmt=layer_format(quant, join(prefix, "fc2")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm transformer layer; the global layers scale both branches by tanh gates."""

    def __init__(self, spec: VisionSpec, gated: bool, quant: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.self_attn = VisionAttention(spec, quant, join(prefix, "self_attn"))
        self.mlp = VisionMLP(spec, quant, join(prefix, "mlp"))
        self.input_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.gated = gated
        if gated:
            self.gate_attn = nn.Parameter(torch.zeros(1), requires_grad=False)
            self.gate_ffn = nn.Parameter(torch.zeros(1), requires_grad=False)
        self._add_layer_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def select_kernels(self, target: KernelTarget) -> None:
        self._add_layer_norm = None
        if target.fused:  # the add and the norm in one launch
            from vllm.model_executor.layers.fused_kernels import add_layer_norm

            self._add_layer_norm = add_layer_norm

    def forward(self, x: torch.Tensor, num_valid: int,
                pad_ranges: torch.Tensor | None = None) -> torch.Tensor:
        return _apply(*self.forward_pending(x, None, None, num_valid, pad_ranges))

    def forward_pending(self, x: torch.Tensor, delta: torch.Tensor | None,
                        gate: torch.Tensor | None, num_valid: int,
                        pad_ranges: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Adds the previous layer's pending branch (``gate * delta``) and runs this layer.
        Returns (residual, MLP branch, its gate) with the branch not yet added, so the next
        norm can take the addition in the same kernel."""
        x, y = self._add_norm(self.input_layernorm, x, delta, gate)
        h = self.self_attn(y, num_valid, pad_ranges)
        x, y = self._add_norm(self.post_attention_layernorm, x, h,
                              self.gate_attn.tanh() if self.gated else None)
        return x, self.mlp(y), self.gate_ffn.tanh() if self.gated else None

    def _add_norm(self, norm: nn.LayerNorm, x: torch.Tensor, delta: torch.Tensor | None,
                  gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + gate * delta, norm of it): one fused kernel (the sum rounded as torch rounds
        it), or the torch operations."""
        if self._add_layer_norm is not None:
            return self._add_layer_norm(x, norm.weight, norm.bias, norm.eps, delta, gate)
        x = _apply(x, delta, gate)
        return x, norm(x)


def _apply(x: torch.Tensor, delta: torch.Tensor | None,
           gate: torch.Tensor | None) -> torch.Tensor:
    """x + gate * delta, as the reference computes a (gated) residual branch."""
    if delta is None:
        return x
    return x + (gate * delta if gate is not None else delta)


class VisionEncoder(nn.Module):
    def __init__(self, spec: VisionSpec, num_layers: int, gated: bool,
                 quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(spec, gated, quant, join(prefix, f"layers.{i}"))
            for i in range(num_layers))


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


@dataclass(eq=False)
class GroupEncoding:
    """A group of images (one tile count) part-way through the encoder layers."""

    hidden: torch.Tensor  # [G, T * P_padded, D], valid tokens first
    order: torch.Tensor  # the valid-first token permutation
    aspect_ratio_ids: torch.Tensor  # [G]
    num_valid: int
    total_layers: int
    # [G, num_valid, D * (1 + k)]: the final hidden states, then the k intermediate-layer
    # inputs interleaved per channel (channel c of feature j at D + c * k + j), written in place
    # as each is produced (no stack and concatenation at the end).
    out: torch.Tensor
    next_layer: int = 0
    # The last layer's residual branch, not yet added to ``hidden`` (hidden + gate * delta).
    delta: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    # The padding rows' key ranges for the split attention kernel (None: SDPA does them).
    pad_ranges: torch.Tensor | None = None


def _valid_first_order(num_tiles: int, max_tiles: int, tokens: int, padded: int,
                       device: torch.device) -> torch.Tensor:
    """Token order putting the valid tokens of the first ``num_tiles`` tiles first.

    Built on the device without a boolean index (no host sync), so it can be captured."""
    idx = torch.arange(max_tiles * padded, device=device)
    tile = torch.div(idx, padded, rounding_mode="floor")
    valid = (tile < num_tiles) & (idx - tile * padded < tokens)
    return torch.argsort((~valid).to(torch.int8), stable=True)


def _patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p) * (W/p), C * p * p]: the non-overlapping p x p patches in
    row-major order, each flattened as (channel, row, column) like a convolution weight."""
    b, c, h, w = images.shape
    hp, wp = h // p, w // p  # a partial edge patch is dropped, as the convolution drops it
    x = images[:, :, :hp * p, :wp * p].reshape(b, c, hp, p, wp, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, hp * wp, c * p * p)


class MllamaVisionModel(nn.Module):
    """Pixels of tiled images -> per-token features ``[num_valid_tokens, vision_output_dim]``."""

    def __init__(self, spec: VisionSpec, quant: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
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
        self.transformer = VisionEncoder(spec, spec.num_hidden_layers, False, quant,
                                         join(prefix, "transformer"))
        self.global_transformer = VisionEncoder(spec, spec.num_global_layers, True, quant,
                                                join(prefix, "global_transformer"))
        self._embed_norm: Callable[..., torch.Tensor] | None = None  # vision_embed_norm
        # Padding rows of images at the maximum tile count go through the split ranged kernel
        # (``vision_attention.py``) with fused kernels; SDPA otherwise.
        self._split_padding = False

    def select_kernels(self, target: KernelTarget) -> None:
        self._embed_norm, self._split_padding = None, target.fused
        if target.fused:
            from vllm.model_executor.layers.fused_kernels import vision_embed_norm

            self._embed_norm = vision_embed_norm

    def _embed(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        # pixel_values: [N, T, C, S, S] -> [N, T, P_padded, D]
        s = self.spec
        n, t = pixel_values.shape[:2]
        w = self.patch_embedding.weight  # [D, C, p, p]
        x = _patchify(pixel_values.flatten(0, 1).to(w.dtype), s.patch_size)
        # The stride-p convolution as one GEMM over the patches (cuDNN's kernel for this
        # convolution took 0.47 ms on the H200 for 4 tiles; the GEMM and the patch copy ~30 us).
        x = F.linear(x, w.reshape(w.shape[0], -1)).view(n, t, -1, s.hidden_size)
        pre = self.pre_tile_positional_embedding(aspect_ratio_ids)  # [N, T, D]
        if self._embed_norm is not None:
            # The rest of this function in one kernel (it was a dozen passes over the tokens).
            pe, ln = self.gated_positional_embedding, self.layernorm_pre
            gate = pe.gate.tanh()
            return self._embed_norm(x, pre, self.class_embedding, pe.embedding, 1 - gate, gate,
                                     pe.tile_embedding.weight, aspect_ratio_ids, ln.weight,
                                     ln.bias, ln.eps, s.padded_tokens_per_tile)
        x = x + pre.unsqueeze(2)
        cls = self.class_embedding.view(1, 1, 1, -1).expand(n, t, 1, -1)
        x = torch.cat((cls, x), dim=2)
        x = self.gated_positional_embedding(x, aspect_ratio_ids)
        x = self.layernorm_pre(x)
        return F.pad(x, (0, 0, 0, s.padded_tokens_per_tile - s.tokens_per_tile))

    # A group can also be encoded a few layers at a time (``begin_group``, ``advance`` until
    # done, ``finish_group``): the same operations in the same order as one call, so the result
    # is bitwise the same. The engine spreads an image's encoding over decode steps this way.
    def begin_group(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                    num_tiles: int) -> GroupEncoding:
        s = self.spec
        g, t, pp, d = x.shape
        order = _valid_first_order(num_tiles, t, s.tokens_per_tile, pp, x.device)
        total = len(self.transformer.layers) + len(self.global_transformer.layers)
        num_valid = num_tiles * s.tokens_per_tile
        out = x.new_empty(g, num_valid, d * (1 + len(s.intermediate_layers_indices)))
        state = GroupEncoding(x.reshape(g, t * pp, d)[:, order], order, aspect_ratio_ids,
                              num_valid, total, out,
                              pad_ranges=padding_rows_ranges(t * pp, num_valid, x.device,
                                                             self._split_padding))
        if not self.transformer.layers:
            state.hidden = self._post_local(state.hidden, state)
        return state

    def advance(self, state: GroupEncoding, num_layers: int) -> bool:
        """Runs up to ``num_layers`` more encoder layers; True once all have run."""
        local = self.transformer.layers
        inter = self.spec.intermediate_layers_indices
        stop = min(state.next_layer + num_layers, state.total_layers)
        x, delta, gate = state.hidden, state.delta, state.gate
        for i in range(state.next_layer, stop):
            if i < len(local):
                if i in inter:
                    x, delta, gate = _apply(x, delta, gate), None, None
                    self._store_feature(state, sorted(inter).index(i), x)
                x, delta, gate = local[i].forward_pending(x, delta, gate, state.num_valid,
                                                          state.pad_ranges)
                if i == len(local) - 1:
                    x = self._post_local(_apply(x, delta, gate), state)
                    delta = gate = None
            else:
                layer = self.global_transformer.layers[i - len(local)]
                x, delta, gate = layer.forward_pending(x, delta, gate, state.num_valid,
                                                       state.pad_ranges)
        state.hidden, state.delta, state.gate, state.next_layer = x, delta, gate, stop
        return stop == state.total_layers

    def _post_local(self, x: torch.Tensor, state: GroupEncoding) -> torch.Tensor:
        x = self.layernorm_post(x)
        tile_of_token = torch.div(state.order, self.spec.padded_tokens_per_tile,
                                  rounding_mode="floor")
        post = self.post_tile_positional_embedding(state.aspect_ratio_ids)  # [G, T, D]
        return x + post[:, tile_of_token]

    def _store_feature(self, state: GroupEncoding, j: int, x: torch.Tensor) -> None:
        g, n, d = x.shape[0], state.num_valid, x.shape[-1]
        k = len(self.spec.intermediate_layers_indices)
        state.out[:, :, d:].view(g, n, d, k)[..., j].copy_(x[:, :n])

    def finish_group(self, state: GroupEncoding) -> torch.Tensor:
        assert state.next_layer == state.total_layers, "finish_group before the last layer"
        hidden = _apply(state.hidden, state.delta, state.gate)
        d = hidden.shape[-1]
        state.out[:, :, :d].copy_(hidden[:, :state.num_valid])
        return state.out

    def forward(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                num_tiles: list[int]) -> torch.Tensor:
        """pixel_values [N, max_tiles, C, S, S], aspect_ratio_ids [N], host tile counts ->
        packed valid tokens of all images in order, [sum(num_tiles) * P, vision_output_dim]."""
        encoding = ImagesEncoding(self, pixel_values, aspect_ratio_ids, num_tiles)
        encoding.advance(encoding.remaining_layers())
        return encoding.output()


class ImagesEncoding:
    """Images encoded group by group (one group per tile count), any number of layers at a
    time. ``MllamaVisionModel.forward`` runs it to the end in one call; the engine can instead
    spread it over several steps. Either way the operations and their order are the same."""

    def __init__(self, model: MllamaVisionModel, pixel_values: torch.Tensor,
                 aspect_ratio_ids: torch.Tensor, num_tiles: list[int]) -> None:
        self.model = model
        self.num_images = len(num_tiles)
        x = model._embed(pixel_values, aspect_ratio_ids)
        self._groups: list[tuple[list[int] | None, GroupEncoding]] = []
        if len(set(num_tiles)) == 1:  # one group: no gather (and no host copy to capture)
            self._groups.append((None, model.begin_group(x, aspect_ratio_ids, num_tiles[0])))
        else:
            for nt in sorted(set(num_tiles)):
                members = [i for i, n in enumerate(num_tiles) if n == nt]
                index = to_device(members, torch.int64, x.device)
                self._groups.append(
                    (members, model.begin_group(x[index], aspect_ratio_ids[index], nt)))
        self._current = 0

    def remaining_layers(self) -> int:
        """Image-layers left (a layer over a group of G images counts G)."""
        return sum(g.hidden.shape[0] * (g.total_layers - g.next_layer) for _, g in self._groups)

    @property
    def done(self) -> bool:
        return self._current == len(self._groups)

    def advance(self, budget: int) -> bool:
        """Runs at most ``budget`` image-layers (at least one layer); True once finished."""
        spent = 0
        while not self.done:
            group = self._groups[self._current][1]
            size = group.hidden.shape[0]
            layers = (budget - spent) // size
            if layers <= 0:
                if spent:
                    break
                layers = 1
            start = group.next_layer
            if self.model.advance(group, layers):
                self._current += 1
            spent += size * (group.next_layer - start)
        return self.done

    def output(self) -> torch.Tensor:
        assert self.done, "output() before the encoding finished"
        if self._groups[0][0] is None:
            encoded = self.model.finish_group(self._groups[0][1])
            return encoded.reshape(-1, encoded.shape[-1])
        outputs: list[torch.Tensor | None] = [None] * self.num_images
        for members, group in self._groups:
            encoded = self.model.finish_group(group)
            for j, i in enumerate(members or ()):
                outputs[i] = encoded[j]
        return torch.cat(outputs, dim=0)  # type: ignore[arg-type]
