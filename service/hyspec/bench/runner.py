"""Runs the scenarios: the processes of each, warm-up, alternating measured runs, checks.

Only one side computes at a time (the other idles on a pipe or a socket), so the two never
compete for the cores; each side lives in its own process, so each peak RSS is its own.
After every scenario its processes are stopped and the outputs compared, tie-aware.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from hyspec.bench.models import ModelSpec
from hyspec.bench.peer import LlamaServer, PeerConfig
from hyspec.bench.records import Batch, Run
from hyspec.bench.remote import HyspecService
from hyspec.bench.scenarios import (
    PROSE,
    QUESTIONS,
    STREAM_PROMPTS,
    SYSTEM,
    Cache,
    Oracle,
    Scenario,
    Service,
    Streams,
    Versus,
    agentic_session,
    variant,
)
from hyspec.bench.worker import HyspecWorker, WorkerConfig
from hyspec.exactness import Verdict, check
from hyspec.prefix_cache import common_prefix

log = logging.getLogger("hyspec.bench")

HYSPEC = "hyspec"
LLAMA = "llama-server"


@dataclass
class Settings:
    """What both sides share in every scenario."""

    llama_server: Path
    max_tokens: int = 128
    pairs: int = 3
    draft_max: int = 8
    threads: int = 2
    ctx: int = 4096
    batch: int = 512
    adaptive_draft: bool = True  # hyspec's draft length policy (llama-server's drafts are fixed)
    # Both sides load the weights alike: read into memory (hyspec's default; llama-server's
    # --load-mode none), or mapped from the file. Reading them decodes F16 weights ~4% faster on
    # either side here, which is no part of what speculation does.
    mmap: bool = False
    # Each versus row starts its processes this many times and splits its pairs among the starts:
    # two processes doing the same work differ here by up to ~4%, a luck that one start per side
    # would carry into the row's ratio.
    starts: int = 2


@dataclass
class Side:
    """The measured runs of one side (or one setting) of a scenario."""

    runs: list[Run] = field(default_factory=list)  # one per request, in order
    batches: list[float] = field(default_factory=list)  # wall seconds of each measured batch
    timers: list[dict[str, float]] = field(default_factory=list)  # hyspec's rollback timers per batch
    peak_rss_kb: int | None = None  # the largest of the processes that served it
    pids: list[int] = field(default_factory=list)  # versus rows: the process that served each batch

    def add(self, batch: Batch) -> None:
        self.runs += batch.runs
        self.batches.append(batch.wall_s)
        if batch.timers:
            self.timers.append(batch.timers)

    def aggregate_rates(self) -> list[float]:
        """Tokens per second of each measured batch, all its streams together, wall clock."""
        n = len(self.batches)
        per = len(self.runs) // n if n else 0
        return [sum(len(r.tokens) for r in self.runs[i * per:(i + 1) * per]) / wall if wall > 0 else 0.0
                for i, wall in enumerate(self.batches)]


@dataclass
class Result:
    kind: str  # versus, oracle, streams, service or cache
    number: int
    name: str
    target: str
    spec: str
    draft: str | None = None
    goal: float | None = None
    prompt_tokens: int = 0
    turns: int = 1  # a conversation's turns (cache scenarios): runs go turn by turn
    sides: dict[str, Side] = field(default_factory=dict)
    same_tokens: str = ""  # the verdict shown in the table
    exact: bool = True  # False: some output is not the target's plain run, and not at a near-tie
    ties: int = 0  # near-ties forgiven across the scenario's outputs
    comparisons: list[str] = field(default_factory=list)  # each distinct verdict, described
    seconds: float = 0.0
    error: str | None = None
    retried: int = 0  # controlled-acceptance runs repeated after a near-tie took them off the reference
    max_tokens: int = 0  # each answer's length in a versus scenario (0: the others, which answer the bench's)
    pairs: int = 0  # a versus scenario's measured pairs
    starts: int = 1  # a versus scenario's process starts per side, the pairs split among them


@dataclass
class _Requests:
    """What a versus row sends every side: prompt 0 is the warm-up, pair i gets prompt i + 1;
    an agentic row's pair first opens its session with ``openings[i + 1]``."""

    prompts: list[list[int]]
    openings: list[list[int]]


class _Checker:
    """Every output of a target walked along its plain run (hyspec.exactness), cached."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self._seen: dict[tuple[tuple[int, ...], tuple[int, ...]], Verdict] = {}

    def __call__(self, prompt: list[int], *outputs: list[int]) -> None:
        for output in outputs:
            key = (tuple(prompt), tuple(output))
            if key not in self._seen:
                self._seen[key] = check(self.model, prompt, output)

    def verdict(self, result: Result) -> None:
        found = list(self._seen.values())
        result.comparisons = sorted({v.describe() for v in found})
        bad = [v for v in found if not v.ok]
        result.ties = sum(len(v.ties) for v in found)
        result.exact = not bad
        if bad:
            result.same_tokens = f"NO ({bad[0].describe()})"
        elif result.ties:
            result.same_tokens = f"yes ({result.ties} near-tie(s) forgiven)"
        else:
            result.same_tokens = "yes"


def child_env(passive_omp: bool = False) -> dict[str, str]:
    """The environment of the children: ours, less the HYSPEC_* flag twins (a --draft meant for
    the benchmark must not reach a ``hyspec serve`` child as its default). ``passive_omp``
    makes idle OpenMP threads sleep unless OMP_WAIT_POLICY says otherwise: slower, but a busy
    machine no longer slows llama.cpp several times (for smoke tests, not for figures)."""
    keep = {"HYSPEC_CACHE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYSPEC_") or k in keep}
    if passive_omp:
        env.setdefault("OMP_WAIT_POLICY", "passive")
    return env


class Runner:
    def __init__(self, settings: Settings, paths: dict[ModelSpec, Path], *, log_dir: Path | None = None,
                 passive_omp: bool = False) -> None:
        self.s = settings
        self.paths = paths
        self._tmp = tempfile.TemporaryDirectory(prefix="hyspec-bench-") if log_dir is None else None
        self.log_dir = Path(self._tmp.name) if self._tmp else log_dir
        assert self.log_dir is not None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = child_env(passive_omp)
        self._n = 0

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- processes ----------------------------------------------------------------------------

    def _log(self, what: str) -> Path:
        self._n += 1
        return self.log_dir / f"{self._n:02d}-{what}.log"

    def _worker_config(self, target: ModelSpec, draft: ModelSpec | None = None, slots: int = 1,
                       oracle: bool = False, ring: bool = True, prefix_cache_mb: int = 0) -> WorkerConfig:
        return WorkerConfig(model=str(self.paths[target]), draft=str(self.paths[draft]) if draft else None,
                            slots=slots, ctx=self._ctx(target), threads=self.s.threads, batch=self.s.batch,
                            draft_max=self.s.draft_max, oracle=oracle, prefix_cache_mb=prefix_cache_mb,
                            rs_snapshots=None if ring else 0, mmap=self.s.mmap,
                            # Controlled acceptance measures fixed drafts: a policy would change α.
                            adaptive_draft=self.s.adaptive_draft and not oracle)

    def _worker(self, config: WorkerConfig) -> HyspecWorker:
        return HyspecWorker(config, self._log("hyspec"), env=self.env)

    def _peer(self, target: ModelSpec, spec: str, draft: ModelSpec | None = None, slots: int = 1,
              cache: bool = False) -> LlamaServer:
        config = PeerConfig(binary=self.s.llama_server, model=self.paths[target],
                            draft=self.paths[draft] if draft else None, spec=spec, draft_max=self.s.draft_max,
                            slots=slots, ctx=self._ctx(target), threads=self.s.threads, batch=self.s.batch,
                            cache=cache, mmap=self.s.mmap)
        return LlamaServer(config, self._log("llama-server"), env=self.env)

    def _ctx(self, target: ModelSpec) -> int:
        """The context per slot: the trained pair knows only its training context."""
        return min(self.s.ctx, 512) if target.bundled else self.s.ctx

    # -- scenarios ----------------------------------------------------------------------------

    def run(self, scenario: Scenario, progress: Callable[[str], None]) -> list[Result]:
        """One result per scenario (the controlled-acceptance one: per target)."""
        if isinstance(scenario, Oracle):
            return [self._timed(self._oracle, scenario, target, progress) for target in scenario.targets]
        runners = {"versus": self._versus, "streams": self._streams, "service": self._service, "cache": self._cache}
        return [self._timed(runners[scenario.kind], scenario, progress)]

    @staticmethod
    def _timed(fn: Callable[..., Result], *args: object) -> Result:
        t0 = time.perf_counter()
        result = fn(*args)
        result.seconds = time.perf_counter() - t0
        return result

    def _versus(self, sc: Versus, progress: Callable[[str], None]) -> Result:
        result = Result("versus", sc.number, sc.name, sc.target.label, sc.spec, goal=sc.goal,
                        draft=sc.draft.label if sc.draft else None)
        for mode in sc.modes:
            result.sides[side_name(HYSPEC, mode, sc.spec)] = Side()
        for peer in sc.peers:
            result.sides[side_name(LLAMA, peer, sc.spec)] = Side()
        pairs = result.pairs = sc.pair_scale * self.s.pairs
        result.starts = min(self.s.starts, pairs)
        requests: _Requests | None = None
        for start in range(result.starts):
            with contextlib.ExitStack() as stack:
                worker, peers = self._versus_processes(stack, sc, reverse=start % 2 == 1)
                if requests is None:
                    requests = self._versus_requests(sc, worker, result)
                measured = range(pairs * start // result.starts, pairs * (start + 1) // result.starts)
                self._versus_pairs(sc, result, requests, worker, peers, measured, progress)
        assert requests is not None
        check = _Checker(self.paths[sc.target])
        for side in result.sides.values():
            for i, run in enumerate(side.runs):
                check(requests.prompts[i + 1], run.tokens)
        check.verdict(result)
        return result

    def _versus_requests(self, sc: Versus, worker: HyspecWorker, result: Result) -> _Requests:
        """Every side's prompts (and agentic openings); sets the result's answer length that fits them."""
        pairs = result.pairs
        openings: list[list[int]] = []
        if sc.agentic:
            openings, prompts = self._agentic_sessions(sc, worker, pairs)
        else:
            prompts = [worker.tokenize(variant(sc.prompt, i)) for i in range(pairs + 1)]
        result.prompt_tokens = len(prompts[0])
        result.max_tokens = min(sc.answer_scale * self.s.max_tokens,
                                self._ctx(sc.target) - max(len(p) for p in (*prompts, *openings)) - 1)
        return _Requests(prompts, openings)

    def _versus_pairs(self, sc: Versus, result: Result, requests: _Requests, worker: HyspecWorker,
                      peers: dict[str, LlamaServer], measured: range, progress: Callable[[str], None]) -> None:
        """The warm-up, then pairs ``measured``, on one start of the processes."""
        args = {"max_tokens": result.max_tokens}

        def on_hyspec(prompt: list[int], mode: str) -> Batch:
            return worker.run([prompt], spec=mode, draft_max=self.s.draft_max, **args)

        def unmeasured(prompt: list[int], modes: tuple[str, ...]) -> None:
            for mode in modes:
                on_hyspec(prompt, mode)
            for peer in peers.values():
                peer.run([prompt], **args)

        # Every drafting side answers a session's first request, as a server asked to edit its
        # own answer has written it (plain decoding keeps nothing across requests).
        drafting = tuple(mode for mode in sc.modes if mode != "off")
        openings, prompts = requests.openings, requests.prompts
        if openings:
            unmeasured(openings[0], drafting)
        unmeasured(prompts[0], sc.modes)  # the warm-up
        order = [(HYSPEC, mode) for mode in sc.modes] + [(LLAMA, name) for name in peers]
        process_of = {(who, setting): worker if who == HYSPEC else peers[setting] for who, setting in order}
        for i in measured:
            if openings:
                unmeasured(openings[i + 1], drafting)
            for who, setting in _shuffled(order, result, i):
                side = result.sides[side_name(who, setting, sc.spec)]
                process = process_of[who, setting]
                side.add(on_hyspec(prompts[i + 1], setting) if who == HYSPEC else
                         process.run([prompts[i + 1]], **args))
                side.pids.append(process.pid)
            progress(f"pair {i + 1}/{result.pairs}: " + ", ".join(
                f"{name} {side.runs[-1].tokens_per_second:.1f}" for name, side in result.sides.items()) + " tok/s")
        for (who, setting), process in process_of.items():
            side = result.sides[side_name(who, setting, sc.spec)]
            side.peak_rss_kb = max(side.peak_rss_kb or 0, process.peak_rss_kb() or 0) or None

    def _versus_processes(self, stack: contextlib.ExitStack, sc: Versus,
                          reverse: bool) -> tuple[HyspecWorker, dict[str, LlamaServer]]:
        """hyspec's worker and one llama-server per n-gram type (or the one), each started once
        the one before it is ready, stopped with ``stack``. Two processes doing the same work
        differ here by a few percent, a process started later reading faster, so successive
        starts of a row reverse the order: every two processes then meet both ways round, as
        far apart each way (a rotation would start the last llama-server type before the
        worker in no start)."""
        names = [HYSPEC, *sc.peers]
        if reverse:
            names.reverse()
        worker: HyspecWorker | None = None
        peers: dict[str, LlamaServer] = {}
        for name in names:
            process: HyspecWorker | LlamaServer
            if name == HYSPEC:
                worker = process = self._worker(self._worker_config(sc.target, sc.draft))
            else:
                peers[name] = process = self._peer(sc.target, name, sc.draft)
            stack.callback(process.stop)
            process.wait_ready()
        assert worker is not None
        return worker, {name: peers[name] for name in sc.peers}

    def _agentic_sessions(self, sc: Versus, worker: HyspecWorker,
                          pairs: int) -> tuple[list[list[int]], list[list[int]]]:
        """Each session's first request and its second, an edit that carries the first one's
        answer (its plain greedy run, so that every side is sent the same prompts)."""
        openings, edits = [], []
        for i in range(pairs + 1):
            opening, edit = agentic_session(sc.prompt, i)
            openings.append(worker.tokenize(opening))
            answer = worker.run(openings[-1:], max_tokens=self.s.max_tokens, spec="off", draft_max=0).runs[0]
            edits.append(worker.tokenize(edit.format(answer=worker.detokenize(answer.tokens))))
        return openings, edits

    def _oracle(self, sc: Oracle, target: ModelSpec, progress: Callable[[str], None]) -> Result:
        result = Result("oracle", sc.number, sc.name, target.label, "oracle", goal=None)
        with self._worker(self._worker_config(target, oracle=True, ring=sc.ring)) as worker:
            prompt = worker.tokenize(sc.prompt)
            result.prompt_tokens = len(prompt)
            run = {"max_tokens": self.s.max_tokens, "draft_max": self.s.draft_max}
            reference = worker.run([prompt], spec="off", **run).runs[0].tokens  # also the warm-up
            references = _References(worker, prompt, reference, self.s.max_tokens)
            worker.call("alpha", alpha=sc.alphas[0], seed=10_000)  # warm-up of the speculative path
            worker.run([prompt], spec="ngram", **run)
            # Each setting: its name, α (None: no drafts) and the mode that runs it.
            runs: list[tuple[str, float | None, str]] = [("plain", None, "off")]
            for a in sc.alphas:
                runs += [(f"α={a:g}", a, "ngram"), (f"α={a:g} auto", a, "auto")]
            for name, _, _ in runs:  # the report's order, whatever order the pairs run in
                result.sides[name] = Side()
            left: list[list[int]] = []  # outputs run again: checked for exactness too
            for i in range(self.s.pairs):
                for name, alpha, spec in _shuffled(runs, result, i):
                    for _ in range(_RETRIES + 1):
                        if alpha is not None:
                            worker.call("alpha", alpha=alpha, seed=i)
                        batch = worker.run([prompt], spec=spec, **run)
                        if not references.extend(batch.runs[0].tokens):
                            break
                        left.append(batch.runs[0].tokens)  # a near-tie took it off: run it again
                        result.retried += 1
                    result.sides[name].add(batch)
                progress(f"round {i + 1}/{self.s.pairs}: " + ", ".join(
                    f"{name} {side.runs[-1].tokens_per_second:.1f}" for name, side in result.sides.items()) + " tok/s")
            rss = worker.peak_rss_kb()
        for side in result.sides.values():
            side.peak_rss_kb = rss
        check = _Checker(self.paths[target])
        check(prompt, reference, *left, *(r.tokens for side in result.sides.values() for r in side.runs))
        check.verdict(result)
        return result

    def _streams(self, sc: Streams, progress: Callable[[str], None]) -> Result:
        result = Result("streams", sc.number, sc.name, sc.target.label, sc.spec, goal=sc.goal)
        counts = [1, sc.streams]
        with contextlib.ExitStack() as stack:
            peer, worker = _start(stack, lambda: self._peer(sc.target, sc.spec, slots=sc.streams),
                                  lambda: self._worker(self._worker_config(sc.target, slots=sc.streams)))
            prompts = [worker.tokenize(t) for t in _prompts(sc.streams)]
            result.prompt_tokens = len(prompts[0])
            args = {"max_tokens": self.s.max_tokens}
            worker.run(prompts, spec=sc.spec, draft_max=self.s.draft_max, **args)  # warm-up
            peer.run(prompts, **args)
            for i in range(self.s.pairs):
                line = []
                for n in counts:
                    hy = result.sides.setdefault(f"{HYSPEC} ×{n}", Side())
                    ll = result.sides.setdefault(f"{LLAMA} ×{n}", Side())
                    hy.add(worker.run(prompts[:n], spec=sc.spec, draft_max=self.s.draft_max, **args))
                    ll.add(peer.run(prompts[:n], **args))
                    line.append(f"×{n}: hyspec {hy.aggregate_rates()[-1]:.1f} / "
                                f"llama-server {ll.aggregate_rates()[-1]:.1f}")
                progress(f"pair {i + 1}/{self.s.pairs}: " + ", ".join(line) + " tok/s aggregate")
            rss = {HYSPEC: worker.peak_rss_kb(), LLAMA: peer.peak_rss_kb()}
        for name, side in result.sides.items():
            side.peak_rss_kb = rss[HYSPEC if name.startswith(HYSPEC) else LLAMA]
        check = _Checker(self.paths[sc.target])
        for n in counts:
            hy, ll = result.sides[f"{HYSPEC} ×{n}"], result.sides[f"{LLAMA} ×{n}"]
            for k, (h, lr) in enumerate(zip(hy.runs, ll.runs, strict=True)):
                check(prompts[k % n], h.tokens, lr.tokens)
        check.verdict(result)
        return result

    def _service(self, sc: Service, progress: Callable[[str], None]) -> Result:
        result = Result("service", sc.number, sc.name, sc.target.label, sc.spec, goal=None)
        inproc, remote = result.sides.setdefault("in-process", Side()), result.sides.setdefault("gRPC", Side())
        config = self._worker_config(sc.target)
        with contextlib.ExitStack() as stack:
            service, worker = _start(stack, lambda: HyspecService(config, self._log("hyspec-serve"), env=self.env),
                                     lambda: self._worker(config))
            prompt = worker.tokenize(sc.prompt)
            result.prompt_tokens = len(prompt)
            args = {"max_tokens": self.s.max_tokens, "spec": sc.spec, "draft_max": self.s.draft_max}
            worker.run([prompt], **args)  # warm-up
            service.complete(prompt, **args)
            for i in range(self.s.pairs):
                inproc.add(worker.run([prompt], **args))
                t0 = time.perf_counter()
                run = service.complete(prompt, **args)
                remote.add(Batch(runs=[run], wall_s=time.perf_counter() - t0, timers={}))
                progress(f"pair {i + 1}/{self.s.pairs}: in-process {inproc.batches[-1]:.2f} s, "
                         f"gRPC {remote.batches[-1]:.2f} s end to end")
            inproc.peak_rss_kb, remote.peak_rss_kb = worker.peak_rss_kb(), service.peak_rss_kb()
        check = _Checker(self.paths[sc.target])
        for a, b in zip(inproc.runs, remote.runs, strict=True):
            check(prompt, a.tokens, b.tokens)
        check.verdict(result)
        return result


    def _cache(self, sc: Cache, progress: Callable[[str], None]) -> Result:
        """TTFT per turn (or per stream) with hyspec's prefix cache, without it, and with
        llama-server's prompt cache; each pair a conversation of its own (a new first line)."""
        result = Result("cache", sc.number, sc.name, sc.target.label, "off", goal=None, turns=sc.turns)
        names = (f"{HYSPEC} cache", f"{HYSPEC} no cache", f"{LLAMA} cache")
        with contextlib.ExitStack() as stack:
            cached = self._worker(self._worker_config(sc.target, slots=sc.streams, prefix_cache_mb=1024))
            stack.callback(cached.stop)
            uncached = self._worker(self._worker_config(sc.target, slots=sc.streams))
            stack.callback(uncached.stop)
            peer = self._peer(sc.target, "off", slots=sc.streams, cache=True)
            stack.callback(peer.stop)
            for process in (cached, uncached, peer):
                process.wait_ready()
            args = {"max_tokens": self.s.max_tokens}
            system = _filler(cached, SYSTEM, sc.system_tokens)
            sides = [(cached, result.sides.setdefault(names[0], Side())),
                     (uncached, result.sides.setdefault(names[1], Side())),
                     (peer, result.sides.setdefault(names[2], Side()))]
            prompts_seen: list[list[int]] = []
            for i in range(self.s.pairs + 1):  # round 0 is the warm-up
                if sc.streams > 1:  # one system prompt for all: other questions each round
                    history = cached.tokenize(system)
                    questions = [QUESTIONS[(i + k) % len(QUESTIONS)] for k in range(sc.streams)]
                else:  # a conversation of its own each round (its first line differs)
                    history = cached.tokenize(variant(system, i))
                    questions = [QUESTIONS[0]]
                for turn in range(sc.turns):
                    if turn:
                        pasted = _filler(cached, "", sc.question_tokens, start=10 * turn)
                        questions = [f" {pasted} {QUESTIONS[turn % len(QUESTIONS)]}"]
                    prompts = [history + cached.tokenize(q, add_special=False) for q in questions]
                    answers: list[list[int]] = []
                    for process, side in sides:
                        batch = peer.run(prompts, **args) if process is peer else \
                            process.run(prompts, spec="off", draft_max=0, **args)  # type: ignore[attr-defined]
                        if i:
                            side.add(batch)
                        answers.append(batch.runs[0].tokens)
                    if i:
                        prompts_seen += prompts
                        progress(f"round {i}/{self.s.pairs}, turn {turn + 1} ({len(prompts[0])} tokens): TTFT " +
                                 ", ".join(f"{name} {side.runs[-1].ttft_ms:.0f} ms"
                                           for name, (_, side) in zip(names, sides, strict=True)))
                    # The next turn resends it all: the prompt, the (plain greedy) answer, more text.
                    history = prompts[0] + answers[1]
            for process, side in sides:
                side.peak_rss_kb = process.peak_rss_kb()
        result.prompt_tokens = max(len(p) for p in prompts_seen)
        check = _Checker(self.paths[sc.target])
        for _, side in sides:
            for prompt, run in zip(prompts_seen, side.runs, strict=True):
                check(prompt, run.tokens)
        check.verdict(result)
        return result


T = TypeVar("T")


_RETRIES = 2  # runs of a controlled-acceptance setting after its output left the reference


class _References:
    """The plain continuations the controlled-acceptance drafter drafts from, in the worker and
    here: the first run's, then one from each point where a speculative output left them (a
    near-tie that a wider verify broke the other way; the oracle goes silent there and would
    time a plain run under a speculative name)."""

    def __init__(self, worker: HyspecWorker, prompt: list[int], reference: list[int], max_tokens: int) -> None:
        self._worker = worker
        self._prompt = prompt
        self._max_tokens = max_tokens
        self._known: dict[tuple[int, ...], list[int]] = {}
        self._add(prompt, reference)

    def _add(self, prompt: list[int], continuation: list[int]) -> None:
        self._known[tuple(prompt)] = continuation
        self._worker.call("reference", prompt=prompt, tokens=continuation)

    def extend(self, output: list[int]) -> bool:
        """Whether ``output`` left every known continuation; if so, the plain continuation from
        its first token off them is registered (run plainly, untimed)."""
        start = 0  # where the continuation being followed begins in the output
        while True:
            followed = self._known.get(tuple(self._prompt + output[:start]))
            if followed is None:
                break
            off = start + common_prefix(output[start:], followed)
            if off == len(output):
                return False
            start = off + 1
        if start >= len(output):
            return False  # off at its last token: nothing was left to draft
        head = self._prompt + output[:start]
        rest = self._worker.run([head], spec="off", max_tokens=self._max_tokens - start, draft_max=0)
        self._add(head, rest.runs[0].tokens)
        return True


def _shuffled(items: list[T], result: Result, i: int) -> list[T]:
    """Pair ``i``'s order of the settings, an order of its own (seeded): no setting always runs
    first, nor always right after the same other one. Both matter here: the machine drifts
    within a pair, and a request right after another process's runs slower than one after a run
    of its own process (a rotation would keep every setting's predecessor). The seed names the
    result too: seeded by the pair alone, every scenario with as many settings ran the same
    orders, and an order's effect repeated across them instead of averaging out."""
    return random.Random(f"{result.number} {result.target} {result.name} {i}").sample(items, len(items))


def side_name(who: str, mode: str, own: str) -> str:
    """A side's name: ``who`` alone for the scenario's own setting, else with the setting."""
    return who if mode == own else f"{who} {mode}"


def _filler(worker: HyspecWorker, head: str, n_tokens: int, start: int = 0) -> str:
    """``head`` followed by manual text (prose variants), about ``n_tokens`` tokens long."""
    text, k = head, start
    while len(worker.tokenize(text, add_special=False)) < n_tokens:
        text += variant(PROSE, k)
        k += 1
    return text


class _Process(Protocol):
    def wait_ready(self) -> None: ...

    def stop(self) -> None: ...


P = TypeVar("P", bound=_Process)
Q = TypeVar("Q", bound=_Process)


def _start(stack: contextlib.ExitStack, first: Callable[[], P], second: Callable[[], Q]) -> tuple[P, Q]:
    """Start both processes (they load their models at the same time), stop both on the way out
    whatever happens, and return once both are ready."""
    a = first()
    stack.callback(a.stop)
    b = second()
    stack.callback(b.stop)
    a.wait_ready()
    b.wait_ready()
    return a, b


def _prompts(n: int) -> list[str]:
    return [STREAM_PROMPTS[k % len(STREAM_PROMPTS)] for k in range(n)]

