"""Deterministic random-weight GGUF models for tests and benchmarks.

No LFM2 weights are reachable from these machines, so hyspec writes LFM2-architecture files
(hybrid: short-convolution + attention blocks) and plain llama files with random weights and a
real byte-level BPE tokenizer copied from the pinned llama.cpp tree. Their text is noise, but
their shapes, memory layout and speed are those of the real models, and llama.cpp runs them
unmodified.

The same (arch, preset, seed, logit_scale) gives the same weights in every dtype: a q8_0 file
is the f32 file quantized, so it makes a realistic draft for the f16 one.

``write_model`` is the GGUF writer behind it, for any named float32 weights: the trainer
(hyspec.train) writes its models with it too.
"""

from __future__ import annotations

import functools
import math
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType
from gguf.quants import quant_shape_to_byte_shape, quantize
from tqdm import tqdm

from hyspec.gguf_header import KeyValue, read_entries
from hyspec.paths import llama_cpp_dir

# Byte-level BPE: any UTF-8 text tokenizes, and multi-byte characters can split across tokens.
# Distinct BOS (128000) and EOS (128001), 128256 tokens.
VOCAB_FILE = "ggml-vocab-llama-bpe.gguf"

ARCHS = ("lfm2", "llama")


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_ctx: int
    # Blocks that use attention in the hybrid (lfm2) layout; the others are short-conv blocks.
    # The llama arch ignores this: every block is attention.
    attn_layers: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


_LFM2_ATTN_LAYERS = (2, 5, 8, 10, 12, 14)

PRESETS: dict[str, ModelShape] = {
    # Decodes a token in 1-2 ms; loading takes ~0.5 s, nearly all of it building the
    # tokenizer. The 128256 x 64 embedding is most of the file.
    "tiny": ModelShape(n_layer=6, n_embd=64, n_ff=256, n_head=4, n_head_kv=2, n_ctx=4096, attn_layers=(2, 5)),
    # The real LFM2-350M and LFM2-1.2B shapes (only the vocabulary differs: 65536 there).
    "lfm2-350m": ModelShape(
        n_layer=16, n_embd=1024, n_ff=4608, n_head=16, n_head_kv=8, n_ctx=32768, attn_layers=_LFM2_ATTN_LAYERS
    ),
    "lfm2-1.2b": ModelShape(
        n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8, n_ctx=32768, attn_layers=_LFM2_ATTN_LAYERS
    ),
}

DTYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}

DEFAULT_LOGIT_SCALE = 4.0

# What every file this module writes declares (llama.cpp reads them from the file): a model
# trained for these files uses the same values.
ROPE_FREQ_BASE = 1_000_000.0
RMS_EPS = 1e-5
SHORTCONV_L_CACHE = 3
# Small next to the residual updates of the blocks (std ~1 each): with a tied output, a large
# embedding makes every token predict itself and the text collapse into repetition (which
# is what n-gram drafting tests want from a random model: make_model(embed_std=1.0)).
DEFAULT_EMBED_STD = 0.02
# ChatML, as LFM2's own template: llama.cpp's built-in formatter recognises it.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Generate big tensors in row blocks of about this many values to keep memory flat.
_CHUNK_VALUES = 1 << 24


def vocab_path() -> Path:
    path = llama_cpp_dir() / "models" / VOCAB_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {path} not found: run `make` in the hyspec checkout to fetch the pinned "
            "llama.cpp tree, or point LLAMA_CPP_DIR at a llama.cpp checkout"
        )
    return path


# --- tokenizer metadata ----------------------------------------------------------------------



# --- weights ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix, ggml's ne reversed
    std: float = 0.0  # > 0: random, zero-mean with this standard deviation
    fill: float = 1.0  # otherwise every value is this (norm gains)
    keep_f32: bool = False  # stored as F32 whatever the dtype

    def values(self, seed: int) -> Iterator[np.ndarray]:
        """The tensor's float32 values in blocks of whole rows (quantization works per row)."""
        if self.std <= 0.0:
            yield np.full(self.shape, self.fill, dtype=np.float32)
            return
        # Seeded per tensor (crc32, not hash(): that one is salted per process), so every
        # tensor is reproducible on its own and independent of the others.
        rng = np.random.default_rng([seed, zlib.crc32(self.name.encode())])
        # Uniform with the requested std: twice as fast to draw as a normal.
        half_width = math.sqrt(3.0) * self.std
        rows, cols = self.shape
        step = max(1, _CHUNK_VALUES // cols)
        for start in range(0, rows, step):
            block = rng.random((min(step, rows - start), cols), dtype=np.float32)
            block -= 0.5
            block *= 2.0 * half_width
            yield block


def _linear(name: str, n_out: int, n_in: int) -> _Tensor:
    # std 1/sqrt(fan_in): a unit-RMS input (they all follow an RMS norm) gives unit-RMS outputs.
    return _Tensor(name, (n_out, n_in), std=1.0 / math.sqrt(n_in))


def _norm(name: str, size: int, gain: float = 1.0) -> _Tensor:
    return _Tensor(name, (size,), fill=gain, keep_f32=True)


def _tensors(arch: str, shape: ModelShape, n_vocab: int, logit_scale: float, embed_std: float) -> list[_Tensor]:
    n_embd, n_kv = shape.n_embd, shape.n_head_kv * shape.head_dim
    # The output projection is tied to the embedding, so the logits are scaled by the output
    # norm's gain: the logits over the vocabulary come out with std ~logit_scale, and the
    # input embeddings stay as they are.
    output_gain = logit_scale / (embed_std * math.sqrt(n_embd))
    output_norm = "token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight"
    out = [_Tensor("token_embd.weight", (n_vocab, n_embd), std=embed_std)]
    for i in range(shape.n_layer):
        blk = f"blk.{i}"
        out.append(_norm(f"{blk}.attn_norm.weight", n_embd))
        if arch == "llama" or i in shape.attn_layers:
            out += [
                _linear(f"{blk}.attn_q.weight", n_embd, n_embd),
                _linear(f"{blk}.attn_k.weight", n_kv, n_embd),
                _linear(f"{blk}.attn_v.weight", n_kv, n_embd),
                _linear(f"{blk}.attn_output.weight", n_embd, n_embd),
            ]
            if arch == "lfm2":
                out += [
                    _norm(f"{blk}.attn_q_norm.weight", shape.head_dim),
                    _norm(f"{blk}.attn_k_norm.weight", shape.head_dim),
                ]
        else:
            out += [
                # ggml_ssm_conv reads its kernel as F32 only; llama.cpp's converter keeps it F32 too.
                _Tensor(
                    f"{blk}.shortconv.conv.weight",
                    (n_embd, SHORTCONV_L_CACHE),
                    std=1.0 / math.sqrt(SHORTCONV_L_CACHE),
                    keep_f32=True,
                ),
                _linear(f"{blk}.shortconv.in_proj.weight", 3 * n_embd, n_embd),
                _linear(f"{blk}.shortconv.out_proj.weight", n_embd, n_embd),
            ]
        out += [
            _norm(f"{blk}.ffn_norm.weight", n_embd),
            _linear(f"{blk}.ffn_gate.weight", shape.n_ff, n_embd),
            _linear(f"{blk}.ffn_up.weight", shape.n_ff, n_embd),
            _linear(f"{blk}.ffn_down.weight", n_embd, shape.n_ff),
        ]
    out.append(_norm(output_norm, n_embd, gain=output_gain))
    return out


def _add_hparams(writer: gguf.GGUFWriter, arch: str, shape: ModelShape, n_vocab: int) -> None:
    writer.add_vocab_size(n_vocab)
    writer.add_block_count(shape.n_layer)
    writer.add_context_length(shape.n_ctx)
    writer.add_embedding_length(shape.n_embd)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    if arch == "lfm2":
        # Per block: 0 KV heads marks a short-conv (recurrent) block.
        writer.add_head_count_kv(
            [shape.n_head_kv if i in shape.attn_layers else 0 for i in range(shape.n_layer)]
        )
        writer.add_shortconv_l_cache(SHORTCONV_L_CACHE)
    else:
        writer.add_head_count_kv(shape.n_head_kv)
        writer.add_rope_dimension_count(shape.head_dim)


@dataclass(frozen=True)
class Weight:
    """A tensor to write: its name, numpy-order shape and float32 values in blocks of whole rows."""

    name: str
    shape: tuple[int, ...]
    blocks: Callable[[], Iterable[np.ndarray]]
    keep_f32: bool = False  # stored as F32 whatever the file's dtype

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> Weight:
        """An array's weight; norm gains (1-D) and the short-conv kernel stay F32, as in llama.cpp's
        own converter (ggml_ssm_conv reads its kernel as F32 only)."""
        values = np.ascontiguousarray(array, dtype=np.float32)
        keep_f32 = values.ndim == 1 or name.endswith(".shortconv.conv.weight")
        return cls(name, values.shape, lambda: (values,), keep_f32)


def tensor_shapes(arch: str, shape: ModelShape, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a file of this arch and shape holds, in file order, with its numpy-order shape
    (ggml's ne reversed: a linear layer is (n_out, n_in))."""
    return {t.name: t.shape for t in _tensors(arch, shape, n_vocab, DEFAULT_LOGIT_SCALE, DEFAULT_EMBED_STD)}


def _n_vocab(tokenizer: Sequence[KeyValue]) -> int:
    return next(len(kv.value) for kv in tokenizer if kv.key == "tokenizer.ggml.tokens")


def _write(
    path: Path,
    arch: str,
    shape: ModelShape,
    weights: Sequence[Weight],
    dtype: str,
    tokenizer: Sequence[KeyValue],
    name: str,
    description: str,
    chat_template: str | None,
    progress: bool,
) -> None:
    qtype, file_type = DTYPES[dtype]
    n_vocab = _n_vocab(tokenizer)

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_description(description)
    writer.add_file_type(file_type)
    if dtype.startswith("q"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(writer, arch, shape, n_vocab)
    for kv in tokenizer:
        writer.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    stored: list[tuple[Weight, GGMLQuantizationType, int]] = []
    for w in weights:
        w_qtype = GGMLQuantizationType.F32 if w.keep_f32 else qtype
        nbytes = math.prod(quant_shape_to_byte_shape(w.shape, w_qtype))
        # Logical (numpy-order) shape; raw_dtype names the stored type.
        writer.add_tensor_info(w.name, w.shape, np.dtype(np.float32), nbytes, raw_dtype=w_qtype)
        stored.append((w, w_qtype, nbytes))

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # Streamed block by block: the writer's own write_tensor_data wants each tensor whole
        # (the 1.2B preset's embedding alone is 1 GB in f32).
        assert writer.fout is not None
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        total = sum(nbytes for _, _, nbytes in stored)
        with tqdm(total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress) as bar:
            for w, w_qtype, nbytes in stored:
                for block in w.blocks():
                    data = quantize(block, w_qtype)
                    data.tofile(fout)
                    bar.update(data.nbytes)
                writer.write_padding(fout, nbytes)
    finally:
        writer.close()


def write_model(
    out: Path,
    *,
    arch: str,
    shape: ModelShape,
    weights: Mapping[str, np.ndarray] | Sequence[Weight],
    tokenizer: Sequence[KeyValue],
    dtype: str = "f32",
    name: str,
    description: str = "",
    chat_template: str | None = CHAT_TEMPLATE,
    progress: bool = False,
) -> Path:
    """Write a GGUF model (atomically) and return ``out``.

    ``weights``: float32 arrays by tensor name (written in llama.cpp's file order, the set of
    names and shapes checked against ``tensor_shapes``), or ``Weight`` objects written as
    given. ``tokenizer``: the ``tokenizer.*`` metadata. Norm gains and short-conv kernels are
    stored as F32, the other tensors as ``dtype``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {tuple(DTYPES)}")
    if isinstance(weights, Mapping):
        expected = tensor_shapes(arch, shape, _n_vocab(tokenizer))
        got = {k: tuple(np.shape(v)) for k, v in weights.items()}
        if got != expected:
            missing = sorted(expected.keys() - got.keys())
            extra = sorted(got.keys() - expected.keys())
            wrong = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
            raise ValueError(f"weights do not fit {arch} {shape}: missing {missing}, unexpected {extra}, "
                             f"wrong shape {[(k, got[k], expected[k]) for k in wrong]}")
        weights = [Weight.of(k, weights[k]) for k in expected]

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written next to the target and renamed: readers never see a partial file, and
    # concurrent writers of the same file don't collide.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _write(tmp, arch, shape, weights, dtype, tokenizer, name, description, chat_template, progress)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def make_model(
    out: Path,
    *,
    arch: str = "lfm2",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "f32",
    logit_scale: float = DEFAULT_LOGIT_SCALE,
    embed_std: float = DEFAULT_EMBED_STD,
    progress: bool = True,
) -> Path:
    """Write a random-weight GGUF model to ``out`` (atomically) and return ``out``.

    ``logit_scale`` is the standard deviation of the logits over the vocabulary: random
    weights otherwise give flat logits whose near-ties flip between batch shapes.
    ``embed_std`` is the token embedding's spread; around 1.0 the model echoes its input
    and its output repeats. Every file carries a ChatML chat template.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    tokenizer = read_entries(vocab_path(), lambda key: key.startswith("tokenizer."))
    shape = PRESETS[preset]
    weights = [
        Weight(t.name, t.shape, functools.partial(t.values, seed), t.keep_f32)
        for t in _tensors(arch, shape, _n_vocab(tokenizer), logit_scale, embed_std)
    ]
    return write_model(
        out,
        arch=arch,
        shape=shape,
        weights=weights,
        tokenizer=tokenizer,
        dtype=dtype,
        name=f"hyspec-random-{arch}-{preset}",
        description=f"random weights: seed={seed} logit_scale={logit_scale} embed_std={embed_std}",
        progress=progress,
    )
