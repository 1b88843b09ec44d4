"""The trainer's parts (hyspec.train): corpus parsing and split, the BPE and its llama.cpp twin,
training windows, the GGUF writer for trained weights, and, where PyTorch is installed (the
train extra), a tiny training whose export llama.cpp must compute exactly as PyTorch does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hyspec._native import Context, Model
from hyspec.modelgen import ModelShape, tensor_shapes, write_model
from hyspec.train import corpus
from hyspec.train import tokenizer as bpe
from hyspec.train.data import BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID, Batches, eval_windows, tokenize_chapters
from tokenizers import Tokenizer

SAMPLE = """Ge1:1 In the beginning God created the heaven and the earth.
Ge1:2 And the earth was without form, and void; and darkness was upon the face of the deep.
Ge2:1 Thus the heavens and the earth were finished, and all the host of them.
Ge2:2 And on the seventh day God ended his work which he had made.
Ge3:1 Now the serpent was more subtil than any beast of the field which the LORD God had made.
Exo1:1 Now these are the names of the children of Israel, which came into Egypt; every man and his household.
Exo1:2 Reuben, Simeon, Levi, and Judah,
"""

# Whitespace runs, tabs, digits, contractions, punctuation runs, non-ASCII letters and emoji:
# where a byte-level BPE's regex split and llama.cpp's could part ways.
TRICKY = [
    "Hello world",
    "  two leading spaces and two  inner spaces, then trailing   ",
    "line one\nline two\n\n\nthree newlines\r\n and a CRLF",
    "tabs\tand\t\tmore tabs \t mixed",
    "It's, they're, we've, I'm, you'll, he'd: 'quoted' and O'Brien's",
    "numbers 12345 and 3.14159, 1,000,000 and 2nd",
    "punctuation!!! ?? ... --- (brackets) [x] {y} <z> @#$%^&*",
    "café naïve Ελληνικά русский 日本語 한국어 العربية",
    "emoji 🙂🚀 and combining e\u0301",
    "",
    " ",
    "\n",
]


def test_parse_splits_verses_into_chapters_in_order() -> None:
    chapters = corpus.parse(SAMPLE)
    assert [c.name for c in chapters] == ["Ge 1", "Ge 2", "Ge 3", "Exo 1"]
    assert chapters[0].verses[0] == "In the beginning God created the heaven and the earth."
    assert chapters[3].text == (
        "Now these are the names of the children of Israel, which came into Egypt; every man and his household.\n"
        "Reuben, Simeon, Levi, and Judah,"
    )
    with pytest.raises(corpus.CorpusError, match="line 2"):
        corpus.parse("Ge1:1 fine\nnot a verse\n")


def test_split_holds_out_every_nth_chapter_and_nothing_else() -> None:
    chapters = [corpus.Chapter("B", i, (f"verse {i}",)) for i in range(100)]
    train, held = corpus.split(chapters, every=20)
    assert [c.number for c in held] == [10, 30, 50, 70, 90]
    assert len(train) + len(held) == 100 and not {c.number for c in train} & {c.number for c in held}
    assert corpus.split(chapters, every=20) == (train, held)


def _sample_tokenizer(vocab_size: int = 400) -> Tokenizer:
    text = [c.text for c in corpus.parse(SAMPLE)] * 3 + TRICKY
    return bpe.train_bpe(text, vocab_size)


def _lfm2_file(path: Path, tokenizer: Tokenizer, seed: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
    shape = ModelShape(n_layer=2, n_embd=32, n_ff=64, n_head=2, n_head_kv=1, n_ctx=128, attn_layers=(1,))
    meta = bpe.gguf_metadata(tokenizer)
    n_vocab = len(next(kv.value for kv in meta if kv.key == "tokenizer.ggml.tokens"))
    rng = np.random.default_rng(seed)
    weights = {name: rng.normal(0, 0.3, size).astype(np.float32)
               for name, size in tensor_shapes("lfm2", shape, n_vocab).items()}
    write_model(path, arch="lfm2", shape=shape, weights=weights, tokenizer=meta, name="t")
    return path, weights


def test_bpe_is_deterministic_and_has_the_special_tokens_first() -> None:
    a, b = _sample_tokenizer(), _sample_tokenizer()
    assert a.to_str() == b.to_str()
    assert [a.token_to_id(t) for t in bpe.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert a.get_vocab_size() == 400


def test_llama_cpp_tokenizes_as_the_trained_bpe(tmp_path: Path) -> None:
    """tokenizer.ggml.pre = "trillion" is the GPT-2 regex the BPE was trained with; llama.cpp's
    ids must be the trainer's, on the corpus and on text unlike it, and decode back exactly."""
    tok = _sample_tokenizer()
    path, _ = _lfm2_file(tmp_path / "m.gguf", tok)
    model = Model(str(path), vocab_only=True)
    assert model.n_vocab == 400 and model.bos == BOS_ID and model.eos == EOS_ID
    assert model.is_eog(EOS_ID) and model.is_eog(IM_END_ID) and not model.is_eog(IM_START_ID)
    for text in [c.text for c in corpus.parse(SAMPLE)] + TRICKY:
        ids = tok.encode(text).ids
        assert model.tokenize(text, add_special=False) == ids, repr(text)
        assert model.tokenize(text) == [BOS_ID, *ids]
        assert model.detokenize(ids) == text
    # A chat turn: the special tokens are parsed as such, the text around them as text.
    chat = model.apply_chat_template([{"role": "user", "content": "And God said"}], add_assistant=True)
    assert chat == "<|im_start|>user\nAnd God said<|im_end|>\n<|im_start|>assistant\n"
    assert model.tokenize(chat, add_special=False, parse_special=True) == tok.encode(chat).ids


def test_training_windows_start_with_bos_at_a_verse(tmp_path: Path) -> None:
    tok = _sample_tokenizer()
    chapters = corpus.parse(SAMPLE)
    text = tokenize_chapters(chapters, tok)
    # Verse by verse tokenization is the chapter's: the newline never merges with a neighbour.
    whole = []
    for c in chapters:
        whole += tok.encode(c.text).ids + [EOS_ID]
    assert text.stream.tolist() == whole
    assert len(text.verse_starts) == sum(len(c.verses) for c in chapters)

    batches = Batches(text, tok, seq_len=48, chat_fraction=0.5)
    a = batches.batch(np.random.default_rng(1), 16)
    assert (a == batches.batch(np.random.default_rng(1), 16)).all()
    assert a.shape == (16, 49) and (a[:, 0] == BOS_ID).all()
    starts = {int(text.stream[s]) for s in text.verse_starts}
    plain = [row for row in a if row[1] != IM_START_ID]
    chat = [row for row in a if row[1] == IM_START_ID]
    assert plain and chat
    assert all(int(row[1]) in starts for row in plain)
    decoded = tok.decode(chat[0].tolist(), skip_special_tokens=False)
    assert decoded.startswith("<|startoftext|><|im_start|>user\n") and "<|im_end|>\n<|im_start|>assistant\n" in decoded

    windows = eval_windows(text, seq_len=48)
    assert (windows[:, 0] == BOS_ID).all()
    # Every token of the text is a target exactly once.
    assert int((windows[:, 1:] != PAD_ID).sum()) == len(text.stream)


def test_write_model_checks_names_and_shapes_and_llama_cpp_counts_them(tmp_path: Path) -> None:
    tok = _sample_tokenizer()
    path, weights = _lfm2_file(tmp_path / "m.gguf", tok)
    model = Model(str(path))
    assert model.arch == "lfm2" and model.is_hybrid
    assert model.n_params == sum(w.size for w in weights.values())
    meta = bpe.gguf_metadata(tok)
    shape = ModelShape(n_layer=2, n_embd=32, n_ff=64, n_head=2, n_head_kv=1, n_ctx=128, attn_layers=(1,))
    bad = dict(weights)
    bad["blk.0.ffn_up.weight"] = bad["blk.0.ffn_up.weight"].T
    del bad["blk.1.attn_q.weight"]
    with pytest.raises(ValueError, match=r"missing \['blk.1.attn_q.weight'\].*wrong shape.*blk.0.ffn_up"):
        write_model(tmp_path / "bad.gguf", arch="lfm2", shape=shape, weights=bad, tokenizer=meta, name="t")
    assert not (tmp_path / "bad.gguf").exists()


# PyTorch is in the test extra for this one test (a CPU wheel, pinned; README "Training the
# bundled models"): the trainer itself is checked end to end on toy shapes.
def test_tiny_training_exports_what_llama_cpp_computes(tmp_path: Path) -> None:
    import torch
    from hyspec.modelgen import RMS_EPS
    from hyspec.train.export import export_gguf
    from hyspec.train.loop import Schedule, held_out_loss, train
    from hyspec.train.model import LFM2, Config
    from hyspec.train.verify import compare_logits

    assert RMS_EPS == 1e-5
    torch.set_num_threads(2)
    tok = _sample_tokenizer()
    chapters = corpus.parse(SAMPLE)
    text = tokenize_chapters(chapters, tok)
    batches = Batches(text, tok, seq_len=32, chat_fraction=0.2)
    held = eval_windows(text, 32)
    shape = ModelShape(n_layer=3, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_ctx=64, attn_layers=(1,))

    def run() -> tuple[LFM2, list]:
        torch.manual_seed(0)
        model = LFM2(Config(tok.get_vocab_size(), shape))
        curve = train(model, batches, Schedule(steps=40, batch=8, lr=1e-2, warmup=4, eval_points=2),
                      np.random.default_rng(0), held)
        return model, curve

    model, curve = run()
    again, curve2 = run()
    assert curve[-1].held_out_loss < curve[0].held_out_loss - 1.0  # it learns
    assert [p.train_loss for p in curve] == [p.train_loss for p in curve2]  # deterministic
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                  strict=True))
    assert abs(held_out_loss(model, held) - curve[-1].held_out_loss) < 1e-6

    f32 = export_gguf(model, tok, tmp_path / "f32.gguf", dtype="f32", name="t", description="")
    diff = compare_logits(f32, model, held[:3])
    assert diff.max_rel < 1e-4 and diff.argmax_agree == 1.0, diff
    q8 = export_gguf(model, tok, tmp_path / "q8.gguf", dtype="q8_0", name="t", description="")
    assert compare_logits(q8, model, held[:3]).max_rel < 0.05

    # One token at a time (the recurrent state carried by llama.cpp) gives the batch's logits.
    gguf = Model(str(f32))
    tokens = [int(t) for t in held[0] if t != PAD_ID]
    with Context(gguf, n_ctx=64, n_batch=64, n_ubatch=64) as ctx:
        rows = []
        for i, t in enumerate(tokens):
            ctx.decode([t], [i], [0], [True])
            rows.append(ctx.logits(0))
    with torch.no_grad():
        ours = model(torch.tensor([tokens]))[0].numpy()
    assert float(np.abs(np.array(rows) - ours).max()) < 1e-4 * float(np.abs(ours).max()) + 1e-4
