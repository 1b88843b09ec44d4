"""What the benchmark runs: the scenarios of the full set and of ``--quick``, as data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hyspec.bench.models import GEMMA, KJV_DRAFT, KJV_TARGET, ModelSpec
from hyspec.bench.peer import NGRAM_TYPES
from hyspec.prefix_cache import CHECKPOINT_EVERY

ECHO = 1.0  # embed_std of the n-gram scenario's targets

# Prompts are text, tokenized by the target's own tokenizer and sent to both sides as token ids.
PROSE = ("The history of the printing press begins long before Gutenberg. Wooden blocks were carved, "
         "inked and pressed onto paper, and each page of a book needed a block of its own. ")
REPETITIVE = "for each item in the list: check the item, log the item, move on. " * 8
FRANCE = "The capital of France is"
STREAM_PROMPTS = (
    PROSE,
    "Once upon a time, in a village at the edge of a great forest, there lived a clockmaker who ",
    "To install the package, first create a virtual environment, then run the installer and ",
    "The committee met on Tuesday to discuss the budget for the coming year. The first item was ",
)


# The trained pair's corpus: a verse it has not seen (held out), to be continued.
KJV = "And it came to pass, when the king heard the words of the book of the law, that he rent his clothes. "
# Agentic requests: each restates or edits an earlier answer, which it carries in its prompt.
AGENTIC_EDITS = ("Rewrite this paragraph in plainer words:\n\n{answer}\n\nRewritten:",
                 "Fix the grammar of this text and return all of it:\n\n{answer}\n\nFixed:",
                 "Repeat this text, then add one sentence:\n\n{answer}\n\n",
                 "Correct the spelling in this text and return all of it:\n\n{answer}\n\nCorrected:")
# Multi-turn and shared-prompt scenarios: a long system prompt, then questions.
SYSTEM = ("You are the support assistant of a company that builds printing presses. Answer precisely, "
          "quote the manual where you can, and say when you do not know. The manual follows. ")
QUESTIONS = ("How do I clean the ink rollers?", "What does error E42 mean?", "How often should the belt be oiled?",
             "Can the press print on card stock?", "Why does the paper jam at the second roller?")


def variant(text: str, i: int) -> str:
    """The prompt of measured pair ``i`` (0: the warm-up). Each pair gets a prompt of its own, so
    that neither side can answer from an earlier request: llama-server's ngram-mod keeps one
    n-gram table across requests, and an identical request would find its whole answer there."""
    return f"Part {i + 1}. {text}"


def agentic_session(opening: str, i: int) -> tuple[str, str]:
    """Session ``i`` of the agentic scenario (0: the warm-up): its first request, and the edit
    that its second request asks of the first one's answer (``{answer}`` in the text).

    Sessions start from different prompts (``opening``, then the other STREAM_PROMPTS, each with
    its ``variant`` number) and ask different edits, so no session repeats an earlier one within
    (number of openings) * len(AGENTIC_EDITS) sessions. One chain of edits of edits did (b64): on
    Gemma it reached a fixed point by its sixth request, and from then on every request equalled
    one three pairs earlier, whose whole answer both sides' cross-request tables held."""
    openings = tuple(dict.fromkeys((opening, *STREAM_PROMPTS)))
    edit = AGENTIC_EDITS[(i // len(openings)) % len(AGENTIC_EDITS)]
    return variant(openings[i % len(openings)], i), edit


def _peers(spec: str) -> tuple[str, ...]:
    return NGRAM_TYPES if spec == "ngram" else (spec,)


@dataclass(frozen=True)
class Versus:
    """hyspec and llama-server side by side, one slot (scenarios 1, 2, 3, 5, 8 and 11).

    hyspec runs ``spec`` (its fixed configuration) and, in a speculative scenario, also plain
    and ``auto`` (and any ``extra`` modes); llama-server runs each of ``peers`` (the n-gram
    scenarios: every n-gram type it has). ``agentic``: each pair is a session of two requests
    (``agentic_session``, ``prompt`` the first session's opening), an opening and an edit of its
    answer that carries the answer in its prompt; every drafting side answers both, and the edit is
    measured."""

    number: int
    name: str
    target: ModelSpec
    spec: str  # off, ngram or draft
    prompt: str
    draft: ModelSpec | None = None
    goal: float | None = 1.0  # wanted: hyspec / llama-server decode tokens/s at least this
    extra: tuple[str, ...] = ()
    agentic: bool = False
    # Answers this many times the bench's length (within the context): a model writing thousands
    # of tokens a second answers 64 tokens in ~25 ms, which times the machine's hiccups.
    answer_scale: int = 1
    # This many times the bench's pairs: where even the longest answer takes ~0.1 s (the trained
    # pair knows a 512-token context) one hiccup moves a pair's ratio by 10-15%.
    pair_scale: int = 1
    kind: ClassVar[str] = "versus"

    @property
    def targets(self) -> tuple[ModelSpec, ...]:
        return (self.target,)

    @property
    def modes(self) -> tuple[str, ...]:
        """hyspec's settings: the scenario's own first."""
        if self.spec == "off":
            return ("off",)
        return tuple(dict.fromkeys((self.spec, "off", *self.extra, "auto")))

    @property
    def peers(self) -> tuple[str, ...]:
        return _peers(self.spec)


@dataclass(frozen=True)
class Cache:
    """Prefix cache (scenarios 9 and 10): time to first token with hyspec's cache, without it,
    and with llama-server's (``cache_prompt``, its default context checkpoints). ``turns`` > 1:
    one conversation whose every turn resends the history (prompt, answer, a new question);
    ``streams`` > 1: that many concurrent requests sharing the system prompt."""

    number: int
    name: str
    target: ModelSpec
    system_tokens: int  # the system prompt's length (SYSTEM, then manual text)
    turns: int = 1
    streams: int = 1
    question_tokens: int = 0  # turns after the first: pasted text of this length, then a question
    kind: ClassVar[str] = "cache"

    @property
    def targets(self) -> tuple[ModelSpec, ...]:
        return (self.target,)


@dataclass(frozen=True)
class Oracle:
    """Controlled acceptance, hyspec alone (scenario 4): tokens/s and rollback cost against alpha."""

    targets: tuple[ModelSpec, ...]
    alphas: tuple[float, ...]
    prompt: str = PROSE
    number: int = 4
    name: str = "controlled acceptance"
    ring: bool = True  # a hybrid target rolls back with the snapshot ring (False: checkpoint + replay)
    kind: ClassVar[str] = "oracle"


@dataclass(frozen=True)
class Streams:
    """Concurrent streams against one, aggregate tokens/s, both sides (scenario 6)."""

    target: ModelSpec
    streams: int = 4
    spec: str = "off"
    number: int = 6
    name: str = "concurrent streams"
    goal: float | None = 1.0  # wanted: hyspec / llama-server aggregate tokens/s at the most streams
    kind: ClassVar[str] = "streams"

    @property
    def targets(self) -> tuple[ModelSpec, ...]:
        return (self.target,)


@dataclass(frozen=True)
class Service:
    """One stream through gRPC against in-process (scenario 7): the service's overhead."""

    target: ModelSpec
    spec: str = "off"
    prompt: str = PROSE
    number: int = 7
    name: str = "gRPC vs in-process"
    goal_overhead: float = 0.03  # wanted: end-to-end time through gRPC at most 3% over in-process
    kind: ClassVar[str] = "service"

    @property
    def targets(self) -> tuple[ModelSpec, ...]:
        return (self.target,)


Scenario = Versus | Oracle | Streams | Service | Cache

SCENARIO_TITLES = {
    1: "plain decoding",
    2: "n-gram drafting, repetitive prompt",
    3: "draft model",
    4: "controlled acceptance (hyspec alone)",
    5: "Gemma 3 270M",
    6: "concurrent streams",
    7: "gRPC overhead",
    8: "agentic edits",
    9: "multi-turn conversation, prefix cache",
    10: "shared system prompt, prefix cache",
    11: "trained pair",
}


def full() -> list[Scenario]:
    f16 = ModelSpec("lfm2", "lfm2-1.2b", 1, "f16")
    q8 = ModelSpec("lfm2", "lfm2-1.2b", 1, "q8_0")
    # Random weights give noise that never repeats; these echo their input and then loop.
    f16_echo = ModelSpec("lfm2", "lfm2-1.2b", 1, "f16", embed_std=ECHO)
    q8_echo = ModelSpec("lfm2", "lfm2-1.2b", 1, "q8_0", embed_std=ECHO)
    draft_random = ModelSpec("lfm2", "lfm2-350m", 2, "f16")  # other weights: near-zero acceptance
    attention = ModelSpec("llama", "lfm2-1.2b", 1, "f16")
    return [
        Versus(1, "plain", f16, "off", PROSE),
        Versus(1, "plain", q8, "off", PROSE),
        Versus(2, "n-gram", f16_echo, "ngram", REPETITIVE),
        Versus(2, "n-gram", q8_echo, "ngram", REPETITIVE),
        Versus(3, "draft: random 350M", f16, "draft", PROSE, draft=draft_random),
        Versus(3, "draft: Q8_0 copy", f16, "draft", PROSE, draft=q8),
        Oracle(targets=(f16, attention), alphas=(0.3, 0.6, 0.9)),
        Oracle(targets=(f16,), alphas=(0.3, 0.6, 0.9), name="controlled acceptance, checkpoint + replay",
               ring=False),
        Versus(5, "plain", GEMMA, "off", FRANCE),
        Versus(5, "n-gram", GEMMA, "ngram", FRANCE),
        Streams(f16, streams=4),
        Service(f16),
        Versus(8, "agentic", GEMMA, "ngram", PROSE, goal=1.3, agentic=True),
        Versus(8, "agentic", f16_echo, "ngram", PROSE, goal=1.3, agentic=True),
        # A chat sidecar's conversation: a long system prompt (a manual), then short questions, each
        # turn resending the history; what is new in a turn is its question (and the last answer).
        Cache(9, "4 turns to ~2000 tokens", f16, system_tokens=1600, turns=4, question_tokens=40),
        Cache(10, "4 streams", f16, system_tokens=1500, streams=4),
        Versus(11, "trained pair", KJV_TARGET, "draft", KJV, draft=KJV_DRAFT, extra=("ngram",),
               answer_scale=6, pair_scale=4),
    ]


def quick() -> list[Scenario]:
    """A smoke test of every mechanism on the tiny models: a minute or two."""
    tiny = ModelSpec("lfm2", "tiny", 1, "f32")
    tiny_q8 = ModelSpec("lfm2", "tiny", 1, "q8_0")
    tiny_attention = ModelSpec("llama", "tiny", 1, "f32")
    tiny_echo = ModelSpec("lfm2", "tiny", 1, "f32", embed_std=ECHO)
    return [
        Versus(1, "plain", tiny, "off", PROSE),
        Versus(2, "n-gram", tiny_echo, "ngram", REPETITIVE),
        Versus(3, "draft: Q8_0 copy", tiny, "draft", PROSE, draft=tiny_q8),
        Oracle(targets=(tiny, tiny_attention), alphas=(0.6,)),
        Oracle(targets=(tiny,), alphas=(0.6,), name="controlled acceptance, checkpoint + replay", ring=False),
        Streams(tiny, streams=4),
        Service(tiny),
        Versus(8, "agentic", tiny_echo, "ngram", PROSE, goal=1.3, agentic=True),
        Cache(9, "3 turns", tiny, system_tokens=120, turns=3, question_tokens=40),
        # Past CHECKPOINT_EVERY: on a hybrid target a shared prefix is resumed from the last
        # checkpoint inside it, and a shorter one has none (llama-server's cache misses it too).
        Cache(10, "2 streams", tiny, system_tokens=CHECKPOINT_EVERY + 40, streams=2),
        Versus(11, "trained pair", KJV_TARGET, "draft", KJV, draft=KJV_DRAFT, extra=("ngram",), answer_scale=2,
               pair_scale=2),
    ]


def models(scenarios: list[Scenario]) -> list[ModelSpec]:
    """Every model the scenarios need."""
    out: list[ModelSpec] = []
    for s in scenarios:
        if isinstance(s, Versus):
            out += [s.target] + ([s.draft] if s.draft else [])
        elif isinstance(s, Oracle):
            out += list(s.targets)
        else:
            out.append(s.target)
    return list(dict.fromkeys(out))
