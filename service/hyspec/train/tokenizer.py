"""A byte-level BPE trained on the corpus, and its GGUF metadata.

Hugging Face ``tokenizers`` (Rust, CPU) trains it: ByteLevel pre-tokenizer with the GPT-2
split regex and no prefix space, all 256 bytes in the base alphabet (any UTF-8 text
tokenizes), then merges up to ``VOCAB_SIZE`` tokens. llama.cpp reproduces it with
``tokenizer.ggml.model = "gpt2"`` and a pre-tokenizer type whose regex is that same GPT-2
regex (llama-vocab.cpp): ``"trillion"`` is one of those, and unlike ``"gpt-2"`` it does not
"clean up" spaces before punctuation when detokenizing, so text round-trips exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from gguf import GGUFValueType, TokenType

from hyspec.gguf_header import KeyValue

if TYPE_CHECKING:
    from tokenizers import Tokenizer

VOCAB_SIZE = 4096
GGML_PRE = "trillion"  # GPT-2 regex, clean_spaces = false (src/llama-vocab.cpp of the pinned tree)

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Ids 0..4, in this order: LFM2's own names. EOS ends a chapter, IM_END a chat turn; llama.cpp
# treats both as end of generation.
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)


def _require() -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise ImportError("training needs the train extra: pip install 'hyspec[train]'") from e


def train_bpe(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A tokenizer trained on ``texts`` (deterministic for the same texts)."""
    _require()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return tokenizer


def load(json_text: str) -> Tokenizer:
    """A tokenizer from its ``to_str()`` JSON."""
    _require()
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json_text)


def gguf_metadata(tokenizer: Tokenizer) -> list[KeyValue]:
    """The ``tokenizer.*`` keys llama.cpp needs for this tokenizer, with add_bos on."""
    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    if "" in tokens:
        raise ValueError("the vocabulary's ids are not contiguous")
    specials = {piece: vocab[piece] for piece in SPECIAL_TOKENS}
    if list(specials.values()) != list(range(len(SPECIAL_TOKENS))):
        raise ValueError(f"special tokens are not ids 0..{len(SPECIAL_TOKENS) - 1}: {specials}")
    types = [TokenType.CONTROL if piece in specials else TokenType.NORMAL for piece in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]

    def u32(key: str, value: int) -> KeyValue:
        return KeyValue(key, value, GGUFValueType.UINT32)

    def flag(key: str, value: bool) -> KeyValue:
        return KeyValue(key, value, GGUFValueType.BOOL)

    return [
        KeyValue("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING),
        KeyValue("tokenizer.ggml.pre", GGML_PRE, GGUFValueType.STRING),
        KeyValue("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        KeyValue("tokenizer.ggml.token_type", [int(t) for t in types], GGUFValueType.ARRAY, GGUFValueType.INT32),
        KeyValue("tokenizer.ggml.merges", merges, GGUFValueType.ARRAY, GGUFValueType.STRING),
        u32("tokenizer.ggml.bos_token_id", specials[BOS]),
        u32("tokenizer.ggml.eos_token_id", specials[EOS]),
        u32("tokenizer.ggml.eot_token_id", specials[IM_END]),
        u32("tokenizer.ggml.padding_token_id", specials[PAD]),
        flag("tokenizer.ggml.add_bos_token", True),
        flag("tokenizer.ggml.add_eos_token", False),
    ]
