"""hyspec._native: the thin, strict binding of llama.cpp (C++ in native/).

Ownership: a Model owns its llama_model; a Context owns its llama_context and holds a
reference to the model's weights, so they outlive Model.close() while a context uses them.
A Context (and a Sampler) belongs to one thread at a time (ConcurrentUseError otherwise).
decode, model loading, quantize, the state copies, argmax_all, logits_all, Sampler.sample,
tokenize and detokenize release the GIL. Every failure raises a subclass of
HyspecError; none of them crashes the process.
"""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

_Ints = Sequence[int] | npt.NDArray[np.integer[Any]]
_Bools = Sequence[bool] | npt.NDArray[np.bool_]

class HyspecError(Exception):
    """Base class of every error raised here."""

class ModelLoadError(HyspecError):
    """A GGUF file is missing, unreadable or refused by llama.cpp."""

class InvalidArgumentError(HyspecError, ValueError):
    """A bad argument: token id, sequence id, array lengths, positions, sizes."""

class DecodeError(HyspecError):
    """llama_decode failed."""

    code: int  # llama_decode's return value

class NoSpaceError(DecodeError):
    """No room in the context for the batch (code 1)."""

class StateError(HyspecError):
    """A sequence state could not be read or restored."""

class ClosedError(HyspecError):
    """The Model or Context was closed."""

class ConcurrentUseError(HyspecError):
    """A Context was used by two threads at once."""

class TemplateError(HyspecError):
    """The model has no usable chat template."""

class QuantizeError(HyspecError):
    """llama_model_quantize failed."""

class Model:
    """A GGUF model loaded with llama.cpp (weights, or only the vocabulary)."""

    def __init__(
        self,
        path: str,
        *,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        vocab_only: bool = False,
        progress: Callable[[float], None] | None = None,
    ) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def n_gpu_layers(self) -> int:
        """Layers llama.cpp was asked to offload to a GPU (negative: all)."""
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_ctx_train(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_params(self) -> int: ...
    @property
    def size(self) -> int:
        """Bytes of weights."""
    @property
    def description(self) -> str: ...
    @property
    def arch(self) -> str:
        """general.architecture: 'lfm2', 'llama', 'gemma3', ..."""
    @property
    def is_hybrid(self) -> bool:
        """Attention layers mixed with recurrent-state layers (LFM2, Jamba, ...)."""
    @property
    def is_recurrent(self) -> bool:
        """Only recurrent layers (Mamba, RWKV)."""
    @property
    def bos(self) -> int | None: ...
    @property
    def eos(self) -> int | None: ...
    @property
    def metadata(self) -> dict[str, str]:
        """Every GGUF key/value pair, values rendered as strings."""
    @property
    def closed(self) -> bool: ...
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def detokenize(self, tokens: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Bytes that are not UTF-8 on their own become U+FFFD. Raises InvalidArgumentError for
        ids outside the vocabulary."""
    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The token's bytes; may be part of a UTF-8 character."""
    def is_eog(self, token: int) -> bool: ...
    def chat_template(self, name: str | None = None) -> str | None: ...
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str] | tuple[str, str]],
        add_assistant: bool = True,
        template: str | None = None,
    ) -> str:
        """llama.cpp's built-in formatters; TemplateError when the model has none."""
    def close(self) -> None: ...
    def __enter__(self) -> Model: ...
    def __exit__(self, *exc: object) -> None: ...

class Context:
    """A llama.cpp context: the memory (KV cache and recurrent state) of up to n_seq_max
    sequences. n_ctx is shared: each sequence gets n_ctx / n_seq_max unless kv_unified."""

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_seq_max: int = 1,
        n_threads: int = 0,
        n_rs_seq: int = 0,
        kv_unified: bool = False,
    ) -> None: ...
    @property
    def model(self) -> Model:
        """A new Model object sharing the context's weights (closing it leaves the context alone)."""
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_ctx(self) -> int: ...
    @property
    def n_ctx_seq(self) -> int: ...
    @property
    def n_batch(self) -> int: ...
    @property
    def n_ubatch(self) -> int: ...
    @property
    def n_seq_max(self) -> int: ...
    @property
    def n_rs_seq(self) -> int: ...
    @property
    def n_threads(self) -> int: ...
    @property
    def n_outputs(self) -> int:
        """Outputs (tokens decoded with want_logits) of the last decode."""
    @property
    def closed(self) -> bool: ...
    def decode(self, tokens: _Ints, positions: _Ints, seq_ids: _Ints, want_logits: _Bools) -> int:
        """One batch, possibly of several sequences; returns the number of outputs. Each
        sequence's positions continue its memory one by one. InvalidArgumentError for bad
        input (floats included: nothing is truncated), NoSpaceError when the context is full,
        DecodeError otherwise."""
    def logits(self, i: int) -> npt.NDArray[np.float32]:
        """A copy of the logits of the i-th output of the last decode (negative from the end);
        later decodes do not change it."""
    def logits_all(self) -> npt.NDArray[np.float32]:
        """A copy, shape (n_outputs, n_vocab)."""
    def argmax_all(self) -> npt.NDArray[np.int32]:
        """The best token of every output of the last decode."""
    def state_seq_size(self, seq: int, partial: bool = True) -> int: ...
    def state_seq_get(self, seq: int, partial: bool = True) -> bytes:
        """partial: LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (recurrent / SWA part only)."""
    def state_seq_set(self, seq: int, data: bytes | bytearray | memoryview, partial: bool = True) -> None:
        """With partial=True the attention cache is untouched: trim it with memory_seq_rm. The
        data must be contiguous (InvalidArgumentError for a strided view)."""
    def memory_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """False when a partial range cannot be removed (recurrent state). Positions outside
        [-1, 2^31) are an InvalidArgumentError."""
    def memory_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...
    def memory_seq_keep(self, seq: int) -> None: ...
    def memory_seq_pos_min(self, seq: int) -> int: ...
    def memory_seq_pos_max(self, seq: int) -> int: ...
    def memory_clear(self, data: bool = True) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Context: ...
    def __exit__(self, *exc: object) -> None: ...

class Sampler:
    """llama.cpp's sampler chain for one sequence: [penalties] -> greedy, or
    [penalties] -> [top_k] -> [top_p] -> [min_p] -> temperature -> dist(seed)."""

    def __init__(
        self,
        model: Model,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        penalty_last_n: int = 64,
        seed: int = 0xFFFFFFFF,
    ) -> None: ...
    def sample(self, ctx: Context, i: int) -> int:
        """Draw from output i of the last decode and accept the token."""
    def accept(self, token: int) -> None: ...
    def distribution(self, ctx: Context, i: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        """(token ids, probabilities) after every stage but the final draw, most likely first."""
    def candidates(self, ctx: Context, i: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        """(token ids, logits) after every stage but the final selector, in the order it walks them."""
    def clone(self) -> Sampler: ...
    def reset(self) -> None: ...
    @property
    def greedy(self) -> bool: ...
    @property
    def seed(self) -> int: ...

def quantize(src: str, dst: str, type: str, nthread: int = 0) -> None:
    """Write a quantized copy of a GGUF (q8_0, q4_0, f16, ...). QuantizeError on failure."""

def set_log_level(level: str) -> None:
    """Which llama.cpp messages are passed on (to the handler, else stderr): debug, info, warn,
    error or none (default)."""

def set_log_handler(handler: Callable[[int, str], object] | None) -> None:
    """handler(level, message) gets every whole llama.cpp message at or above the threshold
    (0 debug, 1 info, 2 warn, 3 error), from whichever thread logs; None: stderr again."""

def cancel_loads() -> None:
    """Stop every Model load in progress at its next step (it raises ModelLoadError)."""

def system_info() -> str: ...
def max_parallel_sequences() -> int: ...
def supports_gpu_offload() -> bool: ...
