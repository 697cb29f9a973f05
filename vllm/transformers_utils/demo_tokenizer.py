"""Tokenizer, chat-template and image-processor files for the built-in demo checkpoints.

Two byte-level BPE tokenizers share one layout: ``base`` ordinary tokens, then the 256 Llama 3
special tokens, then ``<|image|>``.

* ``byte``: the 256 bytes only (``base`` = 256), for ``demo/mllama-tiny``.
* ``llama3``: Meta's 128,000 BPE ranks shipped in the optional ``llama-models`` package
  (``base`` = 128000, ``<|image|>`` = 128256), for the full-size shapes.

Everything written here depends only on ``tokenizers`` and the standard library, and is
byte-for-byte deterministic.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# Llama 3's pre-tokenizer split pattern (tiktoken ``pat_str``).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS_TOKEN = "<|begin_of_text|>"
EOT_TOKEN = "<|eot_id|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|finetune_right_pad_id|>"
IMAGE_TOKEN = "<|image|>"
NUM_SPECIAL_TOKENS = 256
LLAMA3_BASE_VOCAB = 128000
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
CHAT_TEMPLATE_FILE = "llama32_vision_instruct.jinja"
LLAMA_MODELS_HINT = "pip install llama-models tiktoken"


class DemoCheckpointError(OSError):
    """A demo checkpoint cannot be built here (its tokenizer needs an optional package that is
    missing or broken). An ``OSError``, like any other checkpoint that cannot be read."""


def llama3_special_tokens() -> list[str]:
    """The 256 Llama 3 special tokens in id order (ids ``base`` .. ``base + 255``)."""
    named = [
        BOS_TOKEN,
        END_OF_TEXT_TOKEN,
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        PAD_TOKEN,
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        EOT_TOKEN,
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + NUM_SPECIAL_TOKENS)]
    return (named + reserved)[:NUM_SPECIAL_TOKENS]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the others are shifted to code points 256+.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _bytes_to_symbol(token: bytes, table: dict[int, str]) -> str:
    return "".join(table[b] for b in token)


def _finish_tokenizer(tok: Tokenizer, base: int) -> Tokenizer:
    """Adds the Llama 3 pre-tokenizer, decoder, special tokens and BOS post-processor."""
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [*llama3_special_tokens(), IMAGE_TOKEN]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    bos = tok.token_to_id(BOS_TOKEN)
    image = tok.token_to_id(IMAGE_TOKEN)
    assert bos == base and image == base + NUM_SPECIAL_TOKENS, (bos, image, base)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos)],
            ),
        ]
    )
    return tok


def build_byte_tokenizer() -> Tokenizer:
    """The tiny tokenizer: ids 0..255 are bytes, 256..511 specials, ``<|image|>`` = 512."""
    table = byte_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    bpe = models.BPE(vocab=vocab, merges=[], fuse_unk=False, ignore_merges=True)
    return _finish_tokenizer(Tokenizer(bpe), base=256)


def llama3_ranks_path() -> Path:
    """Locates ``llama_models/llama3/tokenizer.model`` without importing the package."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None or not spec.submodule_search_locations:
        raise DemoCheckpointError(
            "the full-size demo checkpoints (demo/mllama-11b, demo/mllama-11b-base, "
            "demo/mllama-90b) use the real Llama 3 tokenizer, which ships in the optional PyPI "
            f"package `llama-models`; install it with `{LLAMA_MODELS_HINT}`, or serve "
            "demo/mllama-tiny"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "llama3" / "tokenizer.model"
    if not path.is_file():
        raise DemoCheckpointError(f"{path} is missing; reinstall with `{LLAMA_MODELS_HINT}`")
    return path


def load_bpe_ranks(path: Path) -> dict[bytes, int]:
    """Reads a tiktoken BPE file: one ``base64(token) rank`` pair per line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bpe_merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every pair (left, right) whose parts and concatenation are all tokens.

    Ordered by the rank of the concatenation, then of the parts: a BPE applying merges in this
    order reproduces tiktoken's "merge the lowest-ranked adjacent pair" rule.
    """
    keyed: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                keyed.append((rank, ranks[left], ranks[right], left, right))
    keyed.sort()
    return [(left, right) for _, _, _, left, right in keyed]


def build_llama3_tokenizer() -> Tokenizer:
    """The real Llama 3 tokenizer (128,000 BPE tokens + 256 specials + ``<|image|>``)."""
    ranks = load_bpe_ranks(llama3_ranks_path())
    if len(ranks) != LLAMA3_BASE_VOCAB:
        raise DemoCheckpointError(
            f"expected {LLAMA3_BASE_VOCAB} Llama 3 BPE ranks, found {len(ranks)}"
        )
    table = byte_to_unicode()
    vocab = {_bytes_to_symbol(t, table): r for t, r in ranks.items()}
    merges = [
        (_bytes_to_symbol(a, table), _bytes_to_symbol(b, table))
        for a, b in bpe_merges_from_ranks(ranks)
    ]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True)
    return _finish_tokenizer(Tokenizer(bpe), base=LLAMA3_BASE_VOCAB)


def tokenizer_config(eos_token: str, base: int) -> dict[str, Any]:
    """``tokenizer_config.json`` in the hub layout (``PreTrainedTokenizerFast``)."""
    specials = [*llama3_special_tokens(), IMAGE_TOKEN]
    added = {
        str(base + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(specials)
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        # The hub ships True; transformers 5 ignores it for BPE with a warning.
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def preprocessor_config(tile_size: int, max_image_tiles: int = 4) -> dict[str, Any]:
    """``preprocessor_config.json`` as the hub ships it, for tiles of ``tile_size`` pixels."""
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "MllamaImageProcessor",
        "image_std": CLIP_STD,
        "max_image_tiles": max_image_tiles,
        "processor_class": "MllamaProcessor",
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": tile_size, "width": tile_size},
    }


def chat_template() -> str:
    """This engine's Llama 3.2 Vision Instruct chat template (Jinja source)."""
    return resources.files(__package__).joinpath("templates", CHAT_TEMPLATE_FILE).read_text()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Writes JSON the way ``save_pretrained`` does: sorted keys, 2-space indent."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_tokenizer_files(
    out_dir: Path,
    kind: str,
    eos_token: str,
    tile_size: int,
    with_chat_template: bool = True,
) -> None:
    """Writes tokenizer.json, tokenizer_config.json, the chat template and the processor config.

    ``kind`` is ``"byte"`` (tiny) or ``"llama3"`` (real ranks, needs ``llama-models``).
    """
    if kind == "byte":
        tok, base = build_byte_tokenizer(), 256
    elif kind == "llama3":
        tok, base = build_llama3_tokenizer(), LLAMA3_BASE_VOCAB
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r} (byte, llama3)")
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(eos_token, base))
    write_json(out_dir / "preprocessor_config.json", preprocessor_config(tile_size))
    if with_chat_template:
        (out_dir / "chat_template.jinja").write_text(chat_template())
