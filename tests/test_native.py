"""The worker boundary, hyspec._native: rollback invariants, metadata, tokenizer, errors."""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hyspec import _native as N

PROMPT = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13, 578]
MORE = [1115, 374, 264, 1296, 315, 279, 1887, 13]


def decode_all(ctx: N.Context, tokens: list[int], start: int, seq: int = 0) -> int:
    """One batch, logits for the last token."""
    return ctx.decode(tokens, list(range(start, start + len(tokens))), [seq] * len(tokens),
                      [False] * (len(tokens) - 1) + [True])


def make_ctx(path: Path, n_seq_max: int = 1, n_ctx: int = 512) -> N.Context:
    return N.Context(N.Model(str(path)), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_seq_max=n_seq_max, n_threads=2)


# -- rollback invariants (llama.cpp's test-recurrent-state-rollback, through the binding) ----


@pytest.mark.parametrize("replay", [1, 3, 7])
def test_partial_restore_then_replay_matches_fresh_context(tiny_lfm2: Path, replay: int) -> None:
    k = len(MORE)
    ctx = make_ctx(tiny_lfm2)
    decode_all(ctx, PROMPT, 0)
    saved = ctx.state_seq_get(0, partial=True)
    assert len(saved) == ctx.state_seq_size(0, partial=True) > 0
    decode_all(ctx, MORE, len(PROMPT))
    assert ctx.memory_seq_pos_max(0) == len(PROMPT) + k - 1
    ctx.state_seq_set(0, saved, partial=True)
    assert ctx.memory_seq_rm(0, len(PROMPT), -1)
    assert ctx.memory_seq_pos_max(0) == len(PROMPT) - 1
    decode_all(ctx, MORE[:replay], len(PROMPT))
    rolled_back = ctx.logits(-1)

    fresh = make_ctx(tiny_lfm2)
    decode_all(fresh, PROMPT, 0)
    decode_all(fresh, MORE[:replay], len(PROMPT))
    np.testing.assert_allclose(rolled_back, fresh.logits(-1), rtol=0, atol=1e-5)


def test_partial_state_round_trips_through_bytes_into_a_dirty_context(tiny_lfm2: Path) -> None:
    ctx = make_ctx(tiny_lfm2)
    decode_all(ctx, PROMPT, 0)
    saved = bytes(ctx.state_seq_get(0))
    decode_all(ctx, MORE, len(PROMPT))  # dirty: the state moved on
    ctx.state_seq_set(0, bytearray(saved))
    assert ctx.memory_seq_rm(0, len(PROMPT), -1)
    assert ctx.state_seq_get(0) == saved


def test_seq_rm_of_a_partial_tail_fails_on_hybrid_and_works_on_attention(tiny_lfm2: Path, tiny_llama: Path) -> None:
    hybrid = make_ctx(tiny_lfm2)
    decode_all(hybrid, PROMPT + MORE, 0)
    assert hybrid.memory_seq_rm(0, len(PROMPT), -1) is False
    assert hybrid.memory_seq_rm(0, -1, -1) is True  # a whole sequence always goes

    attention = make_ctx(tiny_llama)
    decode_all(attention, PROMPT + MORE, 0)
    assert attention.memory_seq_rm(0, len(PROMPT), -1) is True
    assert attention.memory_seq_pos_max(0) == len(PROMPT) - 1


def test_rolling_back_one_sequence_leaves_the_other_bit_identical(tiny_lfm2: Path) -> None:
    def run(rollback_seq0: bool) -> np.ndarray:
        ctx = make_ctx(tiny_lfm2, n_seq_max=2, n_ctx=1024)
        decode_all(ctx, PROMPT, 0, seq=0)
        decode_all(ctx, PROMPT[:6], 0, seq=1)
        if rollback_seq0:
            saved = ctx.state_seq_get(0)
            decode_all(ctx, MORE, len(PROMPT), seq=0)
            ctx.state_seq_set(0, saved)
            assert ctx.memory_seq_rm(0, len(PROMPT), -1)
            decode_all(ctx, MORE[:2], len(PROMPT), seq=0)
        decode_all(ctx, MORE[:3], 6, seq=1)
        return ctx.logits(-1)

    assert np.array_equal(run(True), run(False))


def test_mixed_batch_of_two_sequences_gives_outputs_in_batch_order(tiny_lfm2: Path) -> None:
    ctx = make_ctx(tiny_lfm2, n_seq_max=2, n_ctx=1024)
    n = ctx.decode(PROMPT[:4] + PROMPT[:6], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0] * 4 + [1] * 6,
                   [False, False, False, True, False, False, False, False, False, True])
    assert n == ctx.n_outputs == 2
    both = ctx.logits_all()
    assert both.shape == (2, ctx.n_vocab)
    alone = make_ctx(tiny_lfm2)
    decode_all(alone, PROMPT[:6], 0)
    np.testing.assert_allclose(both[1], alone.logits(0), atol=1e-4)
    assert list(ctx.argmax_all()) == [int(np.argmax(both[0])), int(np.argmax(both[1]))]


def test_argmax_all_is_the_first_largest_logit_of_every_output(tiny_lfm2: Path) -> None:
    ctx = make_ctx(tiny_lfm2)
    tokens = PROMPT + MORE
    ctx.decode(tokens, range(len(tokens)), [0] * len(tokens), [True] * len(tokens))
    logits = ctx.logits_all()
    assert list(ctx.argmax_all()) == [int(np.argmax(row)) for row in logits]  # numpy: the first maximum


# -- metadata, tokenizer ------------------------------------------------------------------


def test_metadata(tiny_lfm2: Path, tiny_llama: Path, gemma: Path) -> None:
    lfm2, llama, gem = N.Model(str(tiny_lfm2)), N.Model(str(tiny_llama)), N.Model(str(gemma))
    assert (lfm2.arch, lfm2.is_hybrid, lfm2.is_recurrent) == ("lfm2", True, False)
    assert (llama.arch, llama.is_hybrid, llama.is_recurrent) == ("llama", False, False)
    assert (gem.arch, gem.is_hybrid) == ("gemma3", False)
    assert lfm2.metadata["general.architecture"] == "lfm2"
    assert lfm2.n_vocab == 128256 and lfm2.n_layer == 6 and lfm2.n_embd > 0 and lfm2.n_ctx_train > 0
    assert gem.n_vocab == 262144
    assert lfm2.bos is not None and lfm2.eos is not None and lfm2.is_eog(lfm2.eos)
    assert gem.chat_template() is None  # the base model ships without one


def test_tokenize_round_trip_with_multibyte_characters_split_across_tokens(tiny_lfm2: Path) -> None:
    model = N.Model(str(tiny_lfm2), vocab_only=True)
    text = "Grüße aus Köln: 日本語 🙂 naïve café, 𓂀 ꙮ 龘 🪿"
    tokens = model.tokenize(text, add_special=False)
    pieces = [model.token_to_piece(t) for t in tokens]
    assert all(isinstance(p, bytes) for p in pieces)
    split = [p for p in pieces if not _valid_utf8(p)]
    assert split, "the text should make at least one token that is part of a character"
    assert b"".join(pieces).decode("utf-8") == text
    assert model.detokenize(tokens) == text
    with_bos = model.tokenize(text)
    assert with_bos[0] == model.bos and model.detokenize(with_bos, remove_special=True) == text


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_chat_template(gemma: Path) -> None:
    model = N.Model(str(gemma), vocab_only=True)
    with pytest.raises(N.TemplateError, match="no chat template"):
        model.apply_chat_template([{"role": "user", "content": "hi"}])
    text = model.apply_chat_template([{"role": "user", "content": "hi"}, ("assistant", "yo")], template="chatml")
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(N.InvalidArgumentError):
        model.apply_chat_template([{"role": "user"}], template="chatml")


# -- sampler, quantize --------------------------------------------------------------------


def test_sampler_distribution_and_clone(tiny_lfm2: Path) -> None:
    ctx = make_ctx(tiny_lfm2)
    decode_all(ctx, PROMPT, 0)
    greedy = N.Sampler(ctx.model)
    ids, probs = greedy.distribution(ctx, 0)
    assert list(ids) == [int(np.argmax(ctx.logits(0)))] and list(probs) == [1.0]
    assert greedy.sample(ctx, 0) == ids[0]

    hot = N.Sampler(ctx.model, temperature=1.5, top_k=40, seed=7)
    ids, probs = hot.distribution(ctx, 0)
    assert len(ids) == 40 and abs(float(probs.sum()) - 1.0) < 1e-5 and np.all(np.diff(probs) <= 0)
    twin = hot.clone()
    drawn = [hot.sample(ctx, 0) for _ in range(20)]
    assert drawn == [twin.sample(ctx, 0) for _ in range(20)]
    assert set(drawn) <= set(int(i) for i in ids)


def test_quantize_makes_a_loadable_q8_0_copy(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "q8.gguf"
    N.quantize(str(tiny_llama), str(out), "q8_0")
    assert out.stat().st_size < tiny_llama.stat().st_size
    assert N.Model(str(out)).n_vocab == 128256
    with pytest.raises(N.InvalidArgumentError, match="unknown quantization type"):
        N.quantize(str(tiny_llama), str(out), "q3_weird")


# -- errors: each in a subprocess, so that a crash fails the test instead of pytest --------

BAD_INPUTS = {
    "missing file": ("N.Model('/nonexistent/model.gguf')", "ModelLoadError"),
    "not a gguf": ("open(TMP, 'wb').write(b'hello world' * 10); N.Model(TMP)", "ModelLoadError"),
    "truncated gguf": ("open(TMP, 'wb').write(open(MODEL, 'rb').read()[:200000]); N.Model(TMP)", "ModelLoadError"),
    "corrupt gguf": ("d = bytearray(open(MODEL, 'rb').read()); d[8:4096] = bytes(4088); "
                     "open(TMP, 'wb').write(d); N.Model(TMP)", "ModelLoadError"),
    "token outside vocab": ("ctx.decode([10**7], [0], [0], [True])", "InvalidArgumentError"),
    "negative token": ("ctx.decode([-5], [0], [0], [True])", "InvalidArgumentError"),
    "seq id too large": ("ctx.decode([1], [0], [2], [True])", "InvalidArgumentError"),
    "mismatched lengths": ("ctx.decode([1, 2], [0], [0, 0], [True, True])", "InvalidArgumentError"),
    "empty batch": ("ctx.decode([], [], [], [])", "InvalidArgumentError"),
    "position gap": ("ctx.decode([1, 2], [0, 5], [0, 0], [False, True])", "InvalidArgumentError"),
    "position not continuing": ("ctx.decode([1], [0], [0], [True]); ctx.decode([2], [0], [0], [True])",
                                "InvalidArgumentError"),
    "batch over n_batch": ("ctx.decode([1] * 600, range(600), [0] * 600, [False] * 600)", "InvalidArgumentError"),
    "no room in context": ("ctx.decode([1] * 256, range(256), [0] * 256, [False] * 256); "
                           "ctx.decode([1], [256], [0], [True])", "NoSpaceError"),
    "logits out of range": ("ctx.decode([1], [0], [0], [False]); ctx.logits(0)", "InvalidArgumentError"),
    "seq_rm bad seq": ("ctx.memory_seq_rm(9, 0, -1)", "InvalidArgumentError"),
    "garbage state": ("ctx.state_seq_set(0, b'garbage' * 10)", "StateError"),
    "truncated state": ("ctx.decode([1, 2], [0, 1], [0, 0], [False, True]); s = ctx.state_seq_get(0); "
                        "ctx.state_seq_set(0, s[: len(s) // 2])", "StateError"),
    "use after close": ("ctx.close(); ctx.decode([1], [0], [0], [True])", "ClosedError"),
    "model after close": ("model.close(); model.n_vocab", "ClosedError"),
    "bad sampler": ("N.Sampler(model, temperature=-1.0)", "InvalidArgumentError"),
    "bad top_p": ("N.Sampler(model, temperature=1.0, top_p=1.5)", "InvalidArgumentError"),
    "sampler accept bad token": ("N.Sampler(model).accept(10**7)", "InvalidArgumentError"),
    "n_seq_max zero": ("N.Context(model, n_ctx=256, n_seq_max=0)", "InvalidArgumentError"),
    "decode wrong type": ("ctx.decode('abc', [0], [0], [True])", "InvalidArgumentError"),
}


# Values that a cast used to truncate or wrap, and views llama.cpp would read past: each must be
# an InvalidArgumentError (all in one subprocess).
BOUNDARY_INPUTS = {
    "float token id": "ctx.decode([1.7], [0], [0], [True])",
    "float token array": "ctx.decode(__import__('numpy').array([5.0]), [0], [0], [True])",
    "float position": "ctx.decode([1], [0.0], [0], [True])",
    "token id past int64": "ctx.decode([2**70], [0], [0], [True])",
    "seq_rm position past int32": "ctx.memory_seq_rm(0, 2**32 + 1, -1)",
    "seq_rm position below -1": "ctx.memory_seq_rm(0, -2**32, -1)",
    "seq_cp position past int32": "ctx.memory_seq_cp(0, 1, 0, 2**31)",
    "reversed state view": "ctx.decode([1, 2], [0, 1], [0, 0], [False, True]); s = ctx.state_seq_get(0); "
                           "ctx.state_seq_set(0, memoryview(s)[::-1])",
    "strided state view": "ctx.decode([1, 2], [0, 1], [0, 0], [False, True]); s = ctx.state_seq_get(0); "
                          "ctx.state_seq_set(0, memoryview(s + s)[::2])",
}


def _run_native(model: Path, body: str, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``body`` in a fresh interpreter with N, MODEL, TMP, model and a two-sequence ctx defined, so
    that a crash fails the test instead of pytest; asserts it did not crash."""
    script = textwrap.dedent(f"""
        import sys
        from hyspec import _native as N
        MODEL = {str(model)!r}
        TMP = {str(tmp) if tmp else ""!r}
        model = N.Model(MODEL)
        ctx = N.Context(model, n_ctx=256, n_batch=512, n_ubatch=512, n_seq_max=2, n_threads=1)
    """) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"crashed with {proc.returncode}: {proc.stderr[-2000:]}"
    return proc


def test_values_the_boundary_used_to_truncate_are_refused(tiny_lfm2: Path) -> None:
    cases = "".join(f"""
        try:
            {code}
            print({name!r}, "no error")
        except N.HyspecError as e:
            print({name!r}, type(e).__name__)
        ctx.memory_clear()""" for name, code in BOUNDARY_INPUTS.items())
    proc = _run_native(tiny_lfm2, cases)
    got = {line.rsplit(" ", 1)[0].strip("'"): line.rsplit(" ", 1)[1] for line in proc.stdout.splitlines()}
    assert got == dict.fromkeys(BOUNDARY_INPUTS, "InvalidArgumentError")


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_typed_error_without_crashing(case: str, tiny_lfm2: Path, tmp_path: Path) -> None:
    code, expected = BAD_INPUTS[case]
    proc = _run_native(tiny_lfm2, f"""
        try:
            {code}
        except N.HyspecError as e:
            print(type(e).__name__, getattr(e, "code", ""), e)
            sys.exit(0)
        print("no error")
    """, tmp_path / "bad.gguf")
    name = proc.stdout.split()[0] if proc.stdout else ""
    assert name == expected, proc.stdout + proc.stderr[-2000:]
    assert len(proc.stdout.strip()) > len(expected) + 10, "the message should say what went wrong"
    if expected == "NoSpaceError":
        assert proc.stdout.split()[1] == "1"


def test_a_quantized_model_decodes_a_batch_on_this_cpu(tiny_lfm2_q8: Path) -> None:
    """On CPUs with AMX the pinned llama.cpp's AMX kernels crashed (SIGSEGV) in the first matrix
    product of a quantized model; the build leaves them out (scripts/llama_cpp.py)."""
    assert "AMX_INT8 = 1" not in N.system_info()
    proc = _run_native(tiny_lfm2_q8, """
        import numpy as np
        ctx.decode(list(range(10, 19)), list(range(9)), [0] * 9, [True] * 9)
        logits = ctx.logits_all()
        print(bool(np.isfinite(logits).all()), logits.shape[0])
    """)
    assert proc.stdout.split() == ["True", "9"]


def test_model_stays_alive_while_a_context_uses_it(tiny_lfm2: Path) -> None:
    model = N.Model(str(tiny_lfm2))
    ctx = N.Context(model, n_ctx=256, n_threads=1)
    model.close()
    with pytest.raises(N.ClosedError):
        model.tokenize("x")
    assert ctx.decode([1, 2], [0, 1], [0, 0], [False, True]) == 1
    assert ctx.model.n_vocab == 128256


def test_context_model_is_a_handle_of_its_own(tiny_lfm2: Path) -> None:
    """Closing what ctx.model returns, then the user's Model, leaves the context working (it
    used to close the context's own handle and free the weights under it: a use after free,
    so this runs in a subprocess)."""
    proc = _run_native(tiny_lfm2, """
        view = ctx.model
        assert view is not ctx.model and view.n_vocab == model.n_vocab
        view.close()
        assert view.closed and not ctx.model.closed
        model.close()
        for _ in range(3):
            ctx.model.close()
        assert ctx.decode([1, 2, 3], [0, 1, 2], [0, 0, 0], [False, False, True]) == 1
        assert ctx.model.tokenize("still here") and int(ctx.argmax_all()[0]) >= 0
        print("ok")
    """)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_valid_contiguous_state_view_is_accepted(tiny_lfm2: Path) -> None:
    ctx = make_ctx(tiny_lfm2)
    decode_all(ctx, PROMPT, 0)
    saved = ctx.state_seq_get(0)
    padded = b"xx" + saved
    ctx.state_seq_set(0, memoryview(padded)[2:])  # a contiguous slice is fine
    assert ctx.state_seq_get(0) == saved
    decode_all(ctx, [np.int32(5), np.int64(6)], len(PROMPT))  # numpy integers are integers
    assert ctx.memory_seq_rm(0, np.int64(0), -1)  # the whole sequence
    assert ctx.memory_seq_pos_max(0) == -1


def _sees_busy(ctx: N.Context, call: Callable[[], object], seconds: float = 10.0) -> bool:
    """Whether another thread runs Python while ``call`` is inside ``ctx`` (it gets
    ConcurrentUseError then): only possible when the call released the GIL."""
    stop = threading.Event()
    seen = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            try:
                ctx.memory_seq_pos_max(0)
            except N.ConcurrentUseError:
                seen.set()
                return

    thread = threading.Thread(target=probe)
    thread.start()
    deadline = time.monotonic() + seconds
    try:
        while not seen.is_set() and time.monotonic() < deadline:
            call()
    finally:
        stop.set()
        thread.join()
    return seen.is_set()


def test_sampling_and_logit_copies_release_the_gil(gemma: Path) -> None:
    """Top-p over Gemma's 262k vocabulary, the argmax and the logits copies run without the
    GIL: the event loop is not stalled while the worker samples."""
    model = N.Model(str(gemma))
    ctx = N.Context(model, n_ctx=512, n_threads=2)
    tokens = model.tokenize("The capital of France is Paris, and the capital of Italy is")[:32]
    ctx.decode(tokens, range(len(tokens)), [0] * len(tokens), [True] * len(tokens))
    sampler = N.Sampler(model, temperature=1.0, top_p=0.95, seed=1)
    assert _sees_busy(ctx, lambda: sampler.sample(ctx, 0))
    assert _sees_busy(ctx, ctx.argmax_all)
    assert _sees_busy(ctx, ctx.logits_all)
    assert ctx.logits_all().shape == (len(tokens), model.n_vocab)


def _ticks_during(call: Callable[[], object]) -> tuple[float, float]:
    """(fraction of a free-running Python thread's pace it kept during ``call``, seconds the call
    took). A call that holds the GIL stops that thread for all of it."""
    count = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        time.sleep(0.2)
        before, start = count[0], time.perf_counter()
        time.sleep(0.2)
        pace = (count[0] - before) / (time.perf_counter() - start)
        before, start = count[0], time.perf_counter()
        call()
        took = time.perf_counter() - start
        ticks = count[0] - before
    finally:
        stop.set()
        thread.join()
    return ticks / (pace * took), took


def _ticks_during_a_long_call(make: Callable[[int], Callable[[], object]], size: int) -> tuple[float, float]:
    """``_ticks_during(make(size))``, doubling ``size`` until the call lasts long enough (0.2 s) to
    tell a released GIL from a held one on a machine of any speed. ``make`` prepares the
    arguments outside the measured time."""
    for _ in range(6):
        kept, took = _ticks_during(make(size))
        if took >= 0.2:
            break
        size *= 2
    return kept, took


def test_tokenize_and_detokenize_release_the_gil(gemma: Path) -> None:
    model = N.Model(str(gemma))
    sentence = "The quick brown fox jumps over the lazy dog. "
    ids = model.tokenize(sentence * 8000, add_special=False)

    def tokenize(n: int) -> Callable[[], object]:
        text = sentence * n
        return lambda: model.tokenize(text)

    def detokenize(n: int) -> Callable[[], object]:
        many = ids * n
        return lambda: model.detokenize(many)

    # A call that holds the GIL for its 0.2 s or more leaves the other thread at most one switch
    # interval (5 ms): under 0.025 of its pace. Released, it keeps more, though not all of it:
    # converting the arguments and building the result hold the GIL (detokenize kept 0.095 once).
    kept, took = _ticks_during_a_long_call(tokenize, 8000)
    assert took >= 0.2 and kept > 0.05, (kept, took)
    kept, took = _ticks_during_a_long_call(detokenize, 80)
    assert took >= 0.2 and kept > 0.05, (kept, took)


def test_model_load_can_be_cancelled(tiny_lfm2: Path) -> None:
    started = threading.Event()
    errors: list[BaseException] = []

    def crawl(fraction: float) -> None:
        started.set()
        time.sleep(0.05)

    def load() -> None:
        try:
            N.Model(str(tiny_lfm2), progress=crawl)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=load)
    thread.start()
    assert started.wait(30)
    N.cancel_loads()
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], N.ModelLoadError) and "cancelled" in str(errors[0])
    assert N.Model(str(tiny_lfm2)).n_vocab == 128256  # a load started afterwards is not affected


def test_llama_log_reaches_python_logging(tiny_lfm2: Path, caplog: pytest.LogCaptureFixture) -> None:
    from hyspec.logs import bridge_llama_log

    try:
        with caplog.at_level(logging.DEBUG, logger="hyspec.llama"):
            bridge_llama_log("debug")
            N.Model(str(tiny_lfm2))
            loading = [r for r in caplog.records if r.name == "hyspec.llama"]
            assert any("llama_model_loader" in r.getMessage() for r in loading)
            assert all("\n" not in r.getMessage() for r in loading)  # whole lines, no trailing newline
            caplog.clear()
            bridge_llama_log("warning")
            ctx = N.Context(N.Model(str(tiny_lfm2)), n_ctx=256, n_threads=1)
            assert not [r for r in caplog.records if r.name == "hyspec.llama" and r.levelno < logging.WARNING]
            with pytest.raises(N.StateError):
                ctx.state_seq_set(0, b"garbage" * 10)
            errors = [r for r in caplog.records if r.name == "hyspec.llama" and r.levelno == logging.ERROR]
            assert errors
    finally:
        N.set_log_handler(None)
        N.set_log_level("none")


def test_log_level_flag_decides_what_of_llama_cpp_reaches_the_log(tiny_lfm2: Path) -> None:
    def stderr(level: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "hyspec", "generate", "--model", str(tiny_lfm2), "--prompt", "hi",
                               "--max-tokens", "1", "--ctx", "64", "--spec", "off", "--log-level", level],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    assert "DEBUG hyspec.llama: llama_model_loader: loaded meta data" in stderr("debug")
    assert "llama_model_loader" not in stderr("info")


def test_a_context_used_by_two_threads_at_once_raises(tiny_lfm2: Path) -> None:
    ctx = make_ctx(tiny_lfm2, n_ctx=4096)
    stop = threading.Event()

    def busy() -> None:
        pos = 0
        while not stop.is_set() and pos + 500 < 4096:
            ctx.decode([1] * 500, range(pos, pos + 500), [0] * 500, [False] * 500)
            pos += 500

    worker = threading.Thread(target=busy)
    worker.start()
    errors = 0
    try:
        while worker.is_alive() and errors == 0:
            try:
                ctx.memory_seq_pos_max(0)
            except N.ConcurrentUseError:
                errors += 1
    finally:
        stop.set()
        worker.join()
    assert errors > 0
    assert ctx.memory_seq_pos_max(0) >= 499  # the context is intact


# -- a real model ---------------------------------------------------------------------------


def test_gemma_greedy_writes_deterministic_english(gemma: Path) -> None:
    def run() -> str:
        model = N.Model(str(gemma))
        ctx = N.Context(model, n_ctx=512, n_threads=2)
        tokens = model.tokenize("The capital of France is")
        decode_all(ctx, tokens, 0)
        out: list[int] = []
        for _ in range(24):
            token = int(ctx.argmax_all()[0])
            out.append(token)
            ctx.decode([token], [len(tokens) + len(out) - 1], [0], [True])
        return model.detokenize(out)

    first = run()
    assert first == run()
    words = first.split()
    assert len(words) >= 10 and "France" in first
    assert sum(w.strip(".,").isalpha() and w.isascii() for w in words) >= 0.8 * len(words)


def test_stub_describes_the_module() -> None:
    """The shipped .pyi names exactly what the extension exports."""
    import ast

    import hyspec

    stub = ast.parse((Path(hyspec.__file__).parent / "_native.pyi").read_text())
    declared = {node.name for node in stub.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    exported = {name for name in dir(N) if not name.startswith("_")}
    assert declared == exported
    for cls in stub.body:
        if isinstance(cls, ast.ClassDef) and cls.name in ("Model", "Context", "Sampler"):
            members = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("__")}
            assert members <= set(dir(getattr(N, cls.name))), cls.name


def test_llama_cpp_loaded_by_someone_else_first_does_not_take_over_our_calls(tmp_path: Path) -> None:
    """llama.cpp is linked into the extension; another copy the process loaded globally before it
    (another package's libllama, a host application's) must not receive the extension's calls."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler builds llama.cpp here, so one is on PATH"
    source = tmp_path / "other_llama.c"
    source.write_text("#include <stddef.h>\nsize_t llama_max_parallel_sequences(void) { return 7777; }\n")
    other = tmp_path / "libother_llama.so"
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(other)], check=True, timeout=120)
    script = textwrap.dedent(f"""
        import ctypes
        ctypes.CDLL({str(other)!r}, mode=ctypes.RTLD_GLOBAL)
        from hyspec import _native
        print(_native.max_parallel_sequences())
    """)
    seen = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          timeout=120).stdout
    assert int(seen) == N.max_parallel_sequences() != 7777
    if sys.platform == "linux":  # where the build hides them (GNU ld's --exclude-libs)
        native = ctypes.CDLL(N.__file__)
        assert hasattr(native, "PyInit__native")  # the module's own entry point is exported ...
        for name in ("llama_decode", "llama_max_parallel_sequences", "ggml_init"):  # ... llama.cpp's are not
            assert not hasattr(native, name), name


@pytest.mark.parametrize("keep", [1, 3, 7])
def test_snapshot_ring_trims_inside_the_last_batch(tiny_lfm2: Path, keep: int) -> None:
    """With n_rs_seq snapshots, a tail of the last batch can be removed from hybrid memory
    as long as one of its tokens stays; the state then equals a context that never held it."""
    model = N.Model(str(tiny_lfm2))
    ring = N.Context(model, n_ctx=512, n_threads=2, n_rs_seq=8)
    assert ring.n_rs_seq == 8
    decode_all(ring, PROMPT, 0)
    decode_all(ring, MORE, len(PROMPT))
    assert ring.memory_seq_rm(0, len(PROMPT) + keep, -1)
    decode_all(ring, [42], len(PROMPT) + keep)
    fresh = make_ctx(tiny_lfm2)
    decode_all(fresh, PROMPT, 0)
    decode_all(fresh, MORE[:keep], len(PROMPT))
    decode_all(fresh, [42], len(PROMPT) + keep)
    np.testing.assert_allclose(ring.logits(-1), fresh.logits(-1), atol=2e-3)
