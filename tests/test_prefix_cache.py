"""The prefix cache (prefix_cache.py): hits, partial hits, misses, eviction, sharing, branching
conversations and cancels, each against a fresh engine without the cache, on a hybrid target
(checkpoints of the recurrent state) and an attention target (cells trimmed anywhere)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from exactness import assert_plain
from hypothesis import given, settings
from hypothesis import strategies as st
from hyspec import _native as N
from hyspec import prefix_cache
from hyspec.engine import Engine, EngineConfig
from hyspec.prefix_cache import CacheSizing, PrefixCache, common_prefix
from hyspec.types import BatchShape, FinishReason, GenerationRequest, Result, SpecMode, SpecParams

BATCH = 16  # prompts prefill in chunks of 16: a hybrid target keeps a checkpoint every 16 tokens
RNG = random.Random(11)
P1 = [128000] + [RNG.randint(200, 30000) for _ in range(40)]

Factory = Callable[..., Engine]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=600), st.data())
def test_common_prefix_is_the_length_of_the_longest_shared_start(a: list[int], data: st.DataObject) -> None:
    shared = data.draw(st.integers(0, len(a)))
    b = a[:shared] + data.draw(st.lists(st.integers(0, 3), max_size=50))
    brute = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert common_prefix(a, b) == common_prefix(b, a) == brute


@pytest.fixture(params=["tiny_lfm2", "tiny_llama"])
def target(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture
def make_engine() -> Iterator[Factory]:
    engines: list[Engine] = []

    def factory(model: Path, **kwargs: object) -> Engine:
        config = {"threads": 2, "ctx": 512, "batch": BATCH, "adaptive_draft": False, "record_shapes": True, **kwargs}
        engine = Engine(EngineConfig(model=model, **config))  # type: ignore[arg-type]
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close(grace=0)


def run(engine: Engine, prompt: list[int], n: int = 12, mode: SpecMode = SpecMode.OFF) -> Result:
    return engine.generate(GenerationRequest(token_ids=prompt, max_tokens=n, ignore_eos=True,
                                             spec=SpecParams(mode=mode)))


def same_as_fresh(fresh: Engine, model: Path, prompt: list[int], got: Result, mode: SpecMode = SpecMode.OFF) -> None:
    """``got`` (from a cached prefix) is the plain run's, as a fresh engine's output is; the two
    may differ only where each took the other side of a near-tie of the plain run (a prefix
    decoded in other batch shapes moves logits by float noise)."""
    expected = run(fresh, prompt, len(got.token_ids), mode)
    assert_plain(model, prompt, got, expected)


def test_hit_partial_hit_and_miss(target: Path, make_engine: Factory) -> None:
    engine, fresh = make_engine(target, slots=1), make_engine(target, slots=1, prefix_cache_mb=0)
    assert fresh.cache is None and engine.cache is not None
    first = run(engine, P1)
    assert first.stats.cached_tokens == 0
    # A next turn: the whole first prompt and its answer (but the last token) come from the cache.
    turn = P1 + first.token_ids + [1000, 1001, 1002]
    second = run(engine, turn)
    assert second.stats.cached_tokens == len(P1) + len(first.token_ids) - 1
    same_as_fresh(fresh, target, turn, second)
    # A prompt sharing 30 tokens: all of them on attention, the checkpoint at 16 on a hybrid.
    partial = P1[:30] + [2000, 2001, 2002, 2003]
    third = run(engine, partial)
    assert third.stats.cached_tokens == (16 if engine.model.is_hybrid else 30)
    same_as_fresh(fresh, target, partial, third)
    miss = run(engine, [128000, 5, 6, 7, 8, 9, 10])
    assert miss.stats.cached_tokens == 0
    assert engine.cache.stats.hits == 2 and engine.cache.stats.lookups == 4


def test_a_cached_prefix_is_traced_in_the_batches_that_computed_it(target: Path, make_engine: Factory) -> None:
    """The trace hyspec.exactness replays shows a cached prefix in the batches of the request
    that left it, not as one chunk: the memory holds that request's float noise, and a replay
    in other shapes would misjudge how much noise a near-tie may have."""
    engine = make_engine(target, slots=1)
    first = run(engine, P1)  # 41 prompt tokens in chunks of 16, then 11 one-token steps into memory
    assert first.trace is not None and [c.length for c in first.trace.prefill] == [16, 16, 9]
    turn = P1 + first.token_ids + [1000, 1001, 1002]
    second = run(engine, turn)
    assert second.stats.cached_tokens == 52 and second.trace is not None
    # Then its own chunk: the first answer's last token (never fed) and the three new ones.
    assert second.trace.prefill == [*first.trace.prefill, *[BatchShape(1, 0, 1)] * 11, BatchShape(4, 3, 4)]
    # A hit ending inside one of those batches: the batch's part, in a batch of its size.
    partial = P1[:36] + [2000, 2001]
    third = run(engine, partial)
    cut = 32 if engine.model.is_hybrid else 36
    assert third.stats.cached_tokens == cut and third.trace is not None
    expected = [BatchShape(16, 15, 16)] * 2 + ([] if cut == 32 else [BatchShape(4, 3, 9)])
    assert third.trace.prefill[:len(expected)] == expected
    assert sum(c.length for c in third.trace.prefill) == len(partial)
    same_as_fresh(make_engine(target, slots=1, prefix_cache_mb=0), target, partial, third)


def test_a_shared_system_prompt_and_a_repeated_prompt_hit_with_long_chunks(target: Path,
                                                                           make_engine: Factory) -> None:
    """Prompts in one chunk of 512: a hybrid target still has checkpoints every 256 positions
    and 4 tokens before each prompt's end (when that is 64 or more past the one before), so a
    shared prefix and a repeated prompt resume from the cache (attention targets resume anywhere)."""
    engine = make_engine(target, slots=2, batch=512)
    fresh = make_engine(target, slots=1, batch=512, prefix_cache_mb=0)
    system = [128000] + [RNG.randint(200, 30000) for _ in range(299)]
    first = system + list(range(3000, 3100))  # its last checkpoint (396) is past the shared part
    run(engine, first)
    other = system + [4000, 4001, 4002, 4003]
    got = run(engine, other)
    assert got.stats.cached_tokens == (256 if engine.model.is_hybrid else 300)
    same_as_fresh(fresh, target, other, got)
    again = run(engine, first)
    assert again.stats.cached_tokens == len(first) - (4 if engine.model.is_hybrid else 1)
    same_as_fresh(fresh, target, first, again)
    # A new part shorter than the gap gets no checkpoint of its own (no extra pass): a repeat
    # resumes from where the chunk started on a hybrid target.
    short = system + list(range(5000, 5020))
    run(engine, short)
    assert run(engine, short).stats.cached_tokens == (256 if engine.model.is_hybrid else len(short) - 1)


def test_the_draft_models_context_reuses_its_memory_too(tiny_lfm2: Path, tiny_lfm2_q8: Path,
                                                       make_engine: Factory) -> None:
    engine = make_engine(tiny_lfm2, slots=1, draft=tiny_lfm2_q8, draft_max=4)
    drafter = engine.speculator.model
    assert drafter is not None and drafter.cache is not None and drafter.cache.recurrent
    first = run(engine, P1, 16, SpecMode.DRAFT)
    run(engine, P1 + first.token_ids + [3100], 16, SpecMode.DRAFT)
    assert drafter.cache.stats.hits == 1 and drafter.cache.stats.reused_tokens > len(P1)


def test_speculation_on_a_cached_prefix_is_exact(target: Path, tiny_lfm2_q8: Path, tiny_llama_q8: Path,
                                                 make_engine: Factory) -> None:
    draft = tiny_lfm2_q8 if "lfm2" in target.name else tiny_llama_q8
    engine = make_engine(target, slots=1, draft=draft, draft_max=4)
    fresh = make_engine(target, slots=1, draft=draft, draft_max=4, prefix_cache_mb=0)
    first = run(engine, P1, 16, SpecMode.DRAFT)
    for mode in (SpecMode.DRAFT, SpecMode.NGRAM, SpecMode.AUTO):
        prompt = P1 + first.token_ids + [3000 + list(SpecMode).index(mode)]
        got = run(engine, prompt, 16, mode)
        assert got.stats.cached_tokens > len(P1)
        same_as_fresh(fresh, target, prompt, got, mode)


def test_chat_turns_hit_the_cache(target: Path, make_engine: Factory) -> None:
    """Turn 2's rendered template starts with turn 1's prompt (and, as far as its text
    re-tokenizes alike, its answer): it resumes from the cache, with a fresh engine's output."""
    engine, fresh = make_engine(target, slots=1), make_engine(target, slots=1, prefix_cache_mb=0)
    chat = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour of the sky at dusk, and a fruit of the same colour."}]
    first = engine.generate(GenerationRequest(chat=chat, max_tokens=8, ignore_eos=True))
    prompt1 = engine._prompt(GenerationRequest(chat=chat))
    chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a flower?"}]
    second = engine.generate(GenerationRequest(chat=chat, max_tokens=8, ignore_eos=True))
    prompt2 = engine._prompt(GenerationRequest(chat=chat))
    assert prompt2[:len(prompt1)] == prompt1 and second.stats.cached_tokens >= len(prompt1)
    same_as_fresh(fresh, target, prompt2, second)


def test_two_slots_share_a_cached_prefix_at_once(target: Path, make_engine: Factory) -> None:
    engine, fresh = make_engine(target, slots=2), make_engine(target, slots=1, prefix_cache_mb=0)
    run(engine, P1, 4)
    prompts = [P1 + [4000, 4001], P1 + [5000, 5001, 5002]]
    handles = [engine.submit(GenerationRequest(token_ids=p, max_tokens=16, ignore_eos=True)) for p in prompts]
    for prompt, handle in zip(prompts, handles, strict=True):
        result = handle.result()
        assert result.stats.cached_tokens > 0
        same_as_fresh(fresh, target, prompt, result)


def test_a_conversation_that_branches(target: Path, make_engine: Factory) -> None:
    engine, fresh = make_engine(target, slots=1), make_engine(target, slots=1, prefix_cache_mb=0)
    turn1 = run(engine, P1)
    history = P1 + turn1.token_ids + [6000, 6001]
    turn2 = run(engine, history)
    history += turn2.token_ids
    for branch in ([7000, 7001, 7002], [8000, 8001]):
        result = run(engine, history + branch)
        assert result.stats.cached_tokens >= len(history) - 1
        same_as_fresh(fresh, target, history + branch, result)


def test_least_recently_used_entries_go_first(target: Path, make_engine: Factory,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "MAX_ENTRIES", 3)
    engine = make_engine(target, slots=1)
    assert engine.cache is not None
    prompts = [[128000] + [RNG.randint(200, 30000) for _ in range(20)] for _ in range(4)]
    for prompt in prompts:
        run(engine, prompt, 4)
    assert len(engine.cache.entries) == 3
    assert run(engine, prompts[0] + [9000], 4).stats.cached_tokens == 0  # the oldest was evicted
    assert run(engine, prompts[-1] + [9000], 4).stats.cached_tokens > 0


def test_entries_hold_no_kv_cells_between_requests(target: Path, make_engine: Factory) -> None:
    """llama.cpp attends over every used cell of the buffer: entries kept in cells would slow
    every decode, so they live in host memory and come back only when a request reuses them."""
    engine, fresh = make_engine(target, slots=2), make_engine(target, slots=2, prefix_cache_mb=0)
    assert engine.cache is not None
    first = run(engine, P1)
    second = run(engine, P1 + first.token_ids + [7000, 7001])
    assert second.stats.cached_tokens >= len(P1)
    same_as_fresh(fresh, target, P1 + first.token_ids + [7000, 7001], second)
    while engine.scheduler.busy:  # the worker stores the entry after it has sent the result
        time.sleep(0.01)
    assert len(engine.cache.entries) == 1  # the second turn's entry replaced the first's
    held = []
    for seq in range(64):  # every sequence id of the context holds no cells
        try:
            held.append(engine.ctx.memory_seq_pos_max(seq))
        except N.InvalidArgumentError:
            break
    assert held == [-1, -1, -1]  # two slots and the cache's scratch sequence
    engine.close()  # frees the entries' host memory with the context
    assert not engine.cache.entries and engine.ctx.closed


def test_cancel_during_a_prefill_that_started_from_the_cache(target: Path, make_engine: Factory) -> None:
    engine, fresh = make_engine(target, slots=1), make_engine(target, slots=1, prefix_cache_mb=0)
    first = run(engine, P1)
    long = P1 + first.token_ids + [RNG.randint(200, 30000) for _ in range(300)]
    handle = engine.submit(GenerationRequest(token_ids=long, max_tokens=8, ignore_eos=True))
    handle.cancel()
    assert handle.result().finish_reason is FinishReason.CANCELLED
    again = run(engine, long, 8)
    same_as_fresh(fresh, target, long, again)
    other = P1 + first.token_ids + [12345]
    same_as_fresh(fresh, target, other, run(engine, other, 8))


def test_the_byte_budget_bounds_entries(tiny_llama: Path) -> None:
    ctx = N.Context(N.Model(str(tiny_llama)), n_ctx=1024, n_batch=64, n_ubatch=64, n_seq_max=2, n_threads=2,
                    kv_unified=True)

    def fill(k: int) -> list[int]:
        tokens = [128000] + [300 + 40 * k + i for i in range(39)]
        ctx.decode(tokens, range(40), [0] * 40, [False] * 40)
        return tokens

    def cache_of(budget: int, per_token: int) -> PrefixCache:
        return PrefixCache(ctx, CacheSizing(budget=budget, kv_bytes_per_token=per_token, cells=512, scratch_seq=1),
                           recurrent=False)

    probe = cache_of(1 << 30, 1)
    probe.store(0, fill(0), {})
    ctx.memory_seq_rm(0, -1, -1)
    size = probe.entries[0].nbytes  # what one entry of 40 tokens takes in host memory
    budget = size * 5 // 2
    cache = cache_of(budget, size // 40)
    for k in range(5):
        cache.store(0, fill(k), {})
        ctx.memory_seq_rm(0, -1, -1)
        assert cache.nbytes <= budget
    assert len(cache.entries) == 2  # a third would pass the budget
    cache.store(0, list(range(200)), {})  # five entries' worth: more than the whole budget, never kept
    assert [len(e.tokens) for e in cache.entries] == [40, 40]
    assert ctx.memory_seq_pos_max(1) == -1  # the scratch sequence holds nothing


def test_cached_tokens_reach_clients_and_the_request_log(tiny_llama: Path, make_engine: Factory,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    import grpc
    from hyspec.v1 import hyspec_pb2 as pb2
    from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc
    from serving import running

    engine = make_engine(tiny_llama, slots=1)
    caplog.set_level("INFO", logger="hyspec.server")
    with running(engine, port=0) as server, grpc.insecure_channel(server.address) as channel:
        stub = pb2_grpc.GenerationStub(channel)
        first = stub.Complete(pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=P1), max_tokens=8), timeout=30)
        again = stub.Complete(pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=P1 + list(first.token_ids)),
                                                  max_tokens=8), timeout=30)
    assert first.stats.cached_tokens == 0 and again.stats.cached_tokens == len(P1) + 7
    lines = [r.getMessage() for r in caplog.records if "prompt tokens cached" in r.getMessage()]
    assert any(f"{len(P1) + 7} prompt tokens cached (cache " in line and "hit rate 33%" in line  # warm-up, miss, hit
               for line in lines), lines
