"""The engine: loads the models, validates requests and runs them on one worker thread.

Requests arrive from any thread (or an asyncio loop) through submit(); the Scheduler owns
the native contexts on its own thread; events come back through each RequestHandle.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hyspec import __version__
from hyspec._native import Context, HyspecError, Model, Sampler, TemplateError
from hyspec.draft_policy import SpeculationPolicy
from hyspec.drafters import Drafter
from hyspec.drafters.draft_model import DraftModelDrafter, check_same_vocab
from hyspec.drafters.suffix import SuffixDrafter
from hyspec.gguf_header import read_keys
from hyspec.handle import RequestHandle
from hyspec.output import OutputStream
from hyspec.prefix_cache import CacheSizing, PrefixCache
from hyspec.rollback import RollbackMethod, SeqRollback, probe_rollback
from hyspec.scheduler import Job, Scheduler
from hyspec.speculation import Speculator, calibrate
from hyspec.types import ErrorCode, FinishReason, GenerationRequest, RequestError, Result, SamplingParams, SpecMode

log = logging.getLogger("hyspec.engine")

MAX_DRAFT = 64
DEFAULT_CTX = 4096
# llama.cpp reports graph overflows for LFM2 from about 24 recurrent snapshots.
MAX_RS_SNAPSHOTS = 16


@dataclass
class EngineConfig:
    model: Path
    draft: Path | None = None
    spec: SpecMode | None = None  # None: auto
    draft_min: int = 0
    draft_max: int = 8
    adaptive_draft: bool = True  # shorten or pause drafting while drafts are rejected
    # Hybrid targets: recurrent-state snapshots kept per slot, so that a rollback is a plain trim
    # (no checkpoint, no replay). None: draft_max of them (at most MAX_RS_SNAPSHOTS); 0: checkpoints.
    rs_snapshots: int | None = None
    slots: int = 1
    ctx: int | None = None  # tokens per slot; None: 4096, or the model's training context if shorter
    threads: int = 0  # 0: every core
    batch: int = 512
    max_queue: int = 64
    # Memory of finished requests kept for reuse (prefix_cache.py); 0 turns the cache off.
    prefix_cache_mb: int = 256
    # The suffix drafter's index of earlier requests' outputs (drafters/suffix.py).
    suffix_cache_mb: int = 64
    # Layers offloaded to a GPU (-1: all); only a GPU build of llama.cpp uses them.
    gpu_layers: int = 0
    draft_gpu_layers: int = 0
    # Map the weights from the file (shared with other processes through the page cache) instead
    # of reading them into the process's memory: mapped F16 weights decoded ~4% slower here
    # (LFM2-1.2B F16, 12 alternating pairs); repacked ones (Q8_0, Q4_K) are copied either way.
    mmap: bool = False
    progress: bool = False
    record_shapes: bool = False  # Result.shapes: each token's batch shape, for hyspec.exactness


def _close_at_exit(ref: weakref.ref[Engine]) -> None:
    engine = ref()
    if engine is not None:
        engine.close(grace=0)


def _load(path: Path, gpu_layers: int, progress: bool, mmap: bool) -> Model:
    load = functools.partial(Model, str(path), n_gpu_layers=gpu_layers, use_mmap=mmap)
    if not progress:
        return load()
    from tqdm import tqdm

    with tqdm(total=100, desc=f"loading {Path(path).name}", unit="%", leave=False) as bar:
        def update(fraction: float) -> None:
            bar.update(round(fraction * 100) - bar.n)

        return load(progress=update)


def _check_layer_kinds(model: Model) -> None:
    """Refuse a hybrid model whose layers are all of one kind: llama.cpp builds inputs for both
    kinds and aborts the process (GGML_ASSERT(buffer)) on the first decode of such a model."""
    if not model.is_hybrid:
        return
    key = f"{model.arch}.attention.head_count_kv"  # per layer: 0 for a recurrent layer
    counts = read_keys(model.path, {key}).get(key)
    if isinstance(counts, list) and counts and (all(c == 0 for c in counts) or all(c > 0 for c in counts)):
        kind = "recurrent (convolution)" if all(c == 0 for c in counts) else "attention"
        raise ValueError(f"{model.path}: every layer of this hybrid {model.arch} model is a {kind} layer; "
                         "llama.cpp needs at least one layer of each kind to run it")


class Engine:
    def __init__(self, config: EngineConfig, *, drafter_overrides: dict[SpecMode, Drafter] | None = None) -> None:
        """Load the models and start the worker. ``drafter_overrides`` replaces the drafter
        of a mode (the benchmark's controlled-acceptance drafter plugs in this way)."""
        if config.slots < 1:
            raise ValueError("slots must be at least 1")
        if config.batch < config.slots:
            raise ValueError(f"--batch ({config.batch}) must be at least --slots ({config.slots}): every busy slot "
                             "puts a token into each decode")
        if config.ctx is not None and config.ctx < 8:
            raise ValueError("ctx must be at least 8 tokens")
        if not 0 <= config.draft_min <= config.draft_max <= MAX_DRAFT:
            raise ValueError(f"need 0 <= draft-min <= draft-max <= {MAX_DRAFT}")
        if config.rs_snapshots is not None and not 0 <= config.rs_snapshots <= MAX_RS_SNAPSHOTS:
            raise ValueError(f"rs-snapshots must be between 0 and {MAX_RS_SNAPSHOTS}")
        self.config = config
        self._accepting = True
        self._live: set[RequestHandle] = set()  # submitted, not yet ended (for the queue bound)
        # Set when the worker thread died; on_failure(exc) is then called from that thread.
        self.failure: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self._lock = threading.Lock()
        # Everything that computes with llama.cpp runs on the worker thread: a second thread
        # decoding even once leaves a second OpenMP thread pool behind, and the two slow every
        # later decode down (measured 10-90%).
        ready = threading.Event()
        failure: list[BaseException] = []

        def work() -> None:
            try:
                self._start(drafter_overrides or {})
            except BaseException as e:  # reported to the constructing thread
                failure.append(e)
                return
            finally:
                ready.set()
            try:
                self.scheduler.run()
            except BaseException as e:  # the worker is gone: every request fails, new ones are refused
                self._died(e)

        self._thread = threading.Thread(target=work, name="hyspec-worker", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        # An engine left open at exit is stopped before the interpreter tears threads down (a
        # daemon worker inside native code would otherwise abort the process as it exits).
        atexit.register(_close_at_exit, weakref.ref(self))
        log.info("engine ready: %s (%s, rollback %s), %d slot(s) x %d tokens, speculation %s",
                 config.model, self.model.arch, self.rollback_method.value, config.slots, self.n_ctx_seq,
                 self.default_spec.value)

    def _ring_size(self) -> int:
        if self.config.rs_snapshots is not None:
            return self.config.rs_snapshots
        return min(self.config.draft_max, MAX_RS_SNAPSHOTS)

    def _start(self, drafter_overrides: dict[SpecMode, Drafter]) -> None:
        """Load the models, make the contexts and the scheduler (on the worker thread)."""
        config = self.config
        threads = config.threads or os.cpu_count() or 1
        self.model = _load(config.model, config.gpu_layers, config.progress, config.mmap)
        self.draft_model = (_load(config.draft, config.draft_gpu_layers, config.progress, config.mmap)
                            if config.draft else None)
        if self.draft_model is not None:
            check_same_vocab(self.model, self.draft_model)
        _check_layer_kinds(self.model)
        if self.draft_model is not None:
            _check_layer_kinds(self.draft_model)
        # One KV buffer for all slots: llama.cpp then puts every slot's tokens in one ubatch
        # (with a buffer per slot it splits the batch by sequence). It holds ctx x slots tokens
        # (llama.cpp rounds it up to a multiple of 256); the scheduler keeps each slot within ctx.
        recurrent = self.model.is_hybrid or self.model.is_recurrent
        ring = self._ring_size() if recurrent else 0
        if ring and config.batch < ring + 2:
            # llama.cpp keeps a sequence's last ring + 1 tokens in one ubatch and aborts otherwise.
            raise ValueError(f"--batch {config.batch} is too small for {ring} recurrent-state snapshots: it must "
                             f"be at least {ring + 2} (or lower --rs-snapshots)")
        # A draft model's context keeps a quarter of the prefix cache's budget for its own memory.
        budget = config.prefix_cache_mb << 20
        target_budget = budget - budget // 4 if self.draft_model is not None else budget
        ctx = config.ctx or min(DEFAULT_CTX, self.model.n_ctx_train)
        sizing = CacheSizing.of(self.model, target_budget, ctx, config.slots)
        self.ctx = Context(self.model, n_ctx=ctx * config.slots + sizing.cells, n_batch=config.batch,
                           n_ubatch=config.batch, n_seq_max=config.slots + sizing.n_seqs, n_threads=threads,
                           kv_unified=True, n_rs_seq=ring)
        self.n_ctx_seq = ctx
        self.rollback_method = probe_rollback(self.ctx)
        drafters: dict[SpecMode, Drafter] = {SpecMode.NGRAM: SuffixDrafter(config.suffix_cache_mb << 20)}
        if self.draft_model is not None:
            drafters[SpecMode.DRAFT] = DraftModelDrafter(
                self.draft_model, n_slots=config.slots, n_ctx_seq=self.n_ctx_seq, n_batch=config.batch,
                n_threads=threads, cache_budget=budget // 4)
        drafters.update(drafter_overrides)
        rollback = SeqRollback(self.ctx, self.rollback_method)
        policy = SpeculationPolicy(hybrid=recurrent, rollback_costs=self.rollback_method is RollbackMethod.CHECKPOINT)
        self.speculator = Speculator(drafters, policy)
        self.default_spec = config.spec or SpecMode.AUTO
        if self.default_spec not in self.speculator.modes:
            raise ValueError("--spec draft needs a draft model (--draft PATH)")
        # Costs measured before the first request, so that no request pays for learning them.
        calibrate(self.ctx, policy, rollback, self._calibration_prompt(), drafters.get(SpecMode.DRAFT),
                  max_width=config.draft_max + 1)
        model_drafter = drafters.get(SpecMode.DRAFT)
        if isinstance(model_drafter, DraftModelDrafter) and model_drafter.cache is not None:
            model_drafter.cache.clear()  # nothing of the calibration is worth keeping
        self.cache = PrefixCache(self.ctx, sizing, recurrent=recurrent) if sizing.scratch_seq is not None else None
        self.scheduler = Scheduler(target=self.ctx, rollback=rollback, speculator=self.speculator,
                                   n_slots=config.slots, n_ctx_seq=self.n_ctx_seq, n_batch=config.batch,
                                   ring=self.ctx.n_rs_seq, record_shapes=config.record_shapes, cache=self.cache)

    def _calibration_prompt(self) -> list[int]:
        text = "The history of the printing press begins long before Gutenberg. Wooden blocks were carved"
        tokens = self.tokenize(text)
        return tokens[: max(2, min(len(tokens), self.config.batch - 9, self.n_ctx_seq - 32))]

    # -- requests --------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, *, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Validate and queue a request. Raises RequestError (never blocks on the worker)."""
        with self._lock:
            if self.failure is not None:
                raise RequestError(ErrorCode.UNAVAILABLE, "the engine stopped after an internal error")
            if not self._accepting:
                raise RequestError(ErrorCode.UNAVAILABLE, "the server is shutting down")
            # Cancelled requests do not count: their slots are freed at the worker's next step.
            self._live = {h for h in self._live if not h.finished}
            if sum(not h.cancelled for h in self._live) >= self.config.slots + self.config.max_queue:
                raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                                   f"the queue is full ({self.config.max_queue} waiting); retry later")
            job = self._job(request, RequestHandle(request.request_id, self.scheduler.cancel, loop))
            self.scheduler.submit(job)
            self._live.add(job.handle)
        return job.handle

    def _died(self, error: BaseException) -> None:
        """The worker thread raised outside a decode step: fail every request with INTERNAL,
        refuse new ones, tell on_failure (the server then stops, so a supervisor restarts it)."""
        log.critical("the engine's worker thread failed; no request can run any more", exc_info=error)
        with self._lock:
            self.failure = error
            self._accepting = False
        self.scheduler.abort(RequestError(ErrorCode.INTERNAL, f"the engine failed: {error!r}"))
        if self.on_failure is not None:
            self.on_failure(error)

    def generate(self, request: GenerationRequest) -> Result:
        """Run one request to the end (blocking)."""
        return self.submit(request).result()

    def _job(self, request: GenerationRequest, handle: RequestHandle) -> Job:
        invalid = ErrorCode.INVALID_ARGUMENT
        prompt = self._prompt(request)
        if request.max_tokens <= 0:
            raise RequestError(invalid, "max_tokens must be positive")
        if len(prompt) > self.n_ctx_seq:
            raise RequestError(ErrorCode.OUT_OF_RANGE,
                               f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx_seq}")
        for token in request.stop_token_ids:
            self._check_token(token, "stop_token_ids")
        spec = request.spec.mode or self.default_spec
        if spec not in self.speculator.modes:
            raise RequestError(invalid, "speculation mode 'draft' needs a server started with a draft model")
        draft_min = self.config.draft_min if request.spec.draft_min is None else request.spec.draft_min
        draft_max = self.config.draft_max if request.spec.draft_max is None else request.spec.draft_max
        if not 0 <= draft_min <= draft_max <= MAX_DRAFT:
            raise RequestError(invalid, f"need 0 <= draft_min <= draft_max <= {MAX_DRAFT}")
        s = request.sampling
        seed = s.seed if s.seed is not None else random.getrandbits(32)
        if not 0 <= seed < 2**32:
            raise RequestError(invalid, "seed must be in [0, 2^32)")
        # llama.cpp keeps a ring of penalty_last_n tokens per request: bounded by the context (the
        # default is always accepted, even with a smaller context).
        most = max(self.n_ctx_seq, SamplingParams().penalty_last_n)
        if not -1 <= s.penalty_last_n <= most:
            raise RequestError(invalid, f"penalty_last_n must be between -1 (the whole context) and {most}, "
                               f"got {s.penalty_last_n}")
        last_n = self.n_ctx_seq if s.penalty_last_n == -1 else s.penalty_last_n
        try:
            sampler = Sampler(self.model, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                              repeat_penalty=s.repeat_penalty, frequency_penalty=s.frequency_penalty,
                              presence_penalty=s.presence_penalty, penalty_last_n=last_n, seed=seed)
        except (ValueError, TypeError) as e:
            raise RequestError(invalid, str(e)) from e
        output = OutputStream(self.model, max_tokens=request.max_tokens, stop=request.stop,
                              stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos)
        return Job(handle=handle, prompt=prompt, sampling=s, sampler=sampler, output=output, spec=spec,
                   draft_min=draft_min, draft_max=draft_max,
                   adaptive=self.config.adaptive_draft or spec is SpecMode.AUTO,  # auto is a policy
                   t_submit=time.perf_counter())

    def _prompt(self, request: GenerationRequest) -> list[int]:
        invalid = ErrorCode.INVALID_ARGUMENT
        given = [x for x in (request.text, request.token_ids, request.chat) if x is not None]
        if len(given) != 1:
            raise RequestError(invalid, "give exactly one prompt: text, token_ids or chat")
        if request.text is not None:
            if not request.text:
                raise RequestError(invalid, "the prompt is empty")
            return self.tokenize(request.text)
        if request.token_ids is not None:
            if not request.token_ids:
                raise RequestError(invalid, "the prompt is empty")
            for token in request.token_ids:
                self._check_token(token, "token_ids")
            return list(request.token_ids)
        try:
            text = self.model.apply_chat_template(list(request.chat or []), add_assistant=True)
        except (TemplateError, ValueError) as e:
            raise RequestError(invalid, str(e)) from e
        return self.tokenize(text, parse_special=True)

    def _check_token(self, token: int, field: str) -> None:
        if not 0 <= token < self.model.n_vocab:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"{field}: token id {token} is outside the vocabulary [0, {self.model.n_vocab})")

    # -- model services --------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, token_ids: list[int]) -> str:
        try:
            return self.model.detokenize(list(token_ids))
        except HyspecError as e:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, str(e)) from e

    def cache_summary(self) -> dict | None:
        """The prefix cache's size and hit rate (None without a cache), for the request log."""
        if self.cache is None:
            return None
        return {"mb": round(self.cache.nbytes / (1 << 20), 2), "entries": len(self.cache.entries),
                "hit_rate": round(self.cache.hit_rate, 3)}

    def info(self) -> dict:
        def describe(model: Model | None, path: Path | None) -> dict | None:
            if model is None:
                return None
            return {"path": str(path), "arch": model.arch, "is_hybrid": model.is_hybrid,
                    "is_recurrent": model.is_recurrent, "n_vocab": model.n_vocab, "n_ctx_train": model.n_ctx_train,
                    "gpu_layers": model.n_gpu_layers}

        modes = [mode.value for mode in self.speculator.modes]
        return {"target": describe(self.model, self.config.model),
                "draft": describe(self.draft_model, self.config.draft),
                "ctx": self.n_ctx_seq, "slots": self.config.slots, "spec_modes": modes,
                "default_spec": self.default_spec.value, "rollback": self.rollback_method.value,
                "prefix_cache_mb": self.config.prefix_cache_mb if self.cache is not None else 0,
                "version": __version__}

    def warmup(self) -> None:
        """One short generation through the whole path; raises if it fails."""
        prompt = [self.model.bos] if self.model.bos is not None else [0]
        result = self.generate(GenerationRequest(token_ids=prompt, max_tokens=2, ignore_eos=True))
        if result.finish_reason is FinishReason.CANCELLED:
            raise RuntimeError("warm-up generation failed")

    # -- shutdown --------------------------------------------------------------------------

    def close(self, grace: float | None = None) -> None:
        """Stop accepting, let running requests finish for up to ``grace`` seconds (None: wait
        for them), cancel the rest, stop the worker and free the contexts' memory. The models
        stay loaded: tokenize and detokenize still work. Closing again does nothing."""
        with self._lock:
            self._accepting = False
        if self._thread.is_alive():
            deadline = None if grace is None else time.monotonic() + grace
            while self.scheduler.busy and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.02)
            self.scheduler.stop()
            self._thread.join()
        self._free_contexts()

    def _free_contexts(self) -> None:
        """The worker is gone, so nothing uses the contexts: free their KV memory and the prefix
        caches now, not when the engine object is collected (a caller may keep holding it)."""
        if self.cache is not None:
            self.cache.clear()
        if isinstance(self.speculator.model, DraftModelDrafter):
            self.speculator.model.close()
        self.ctx.close()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(grace=0)
