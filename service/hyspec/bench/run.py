"""``hyspec bench``: prepare the models, run the scenarios, print the tables, write the JSON."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

from hyspec import __version__
from hyspec.bench import report, scenarios
from hyspec.bench.models import default_models_dir, prepare
from hyspec.bench.peer import NGRAM_MOD_MATCH, PeerError, default_binary
from hyspec.bench.remote import ServiceError
from hyspec.bench.runner import Result, Runner, Settings
from hyspec.bench.system import load_average, machine
from hyspec.bench.worker import WorkerError
from hyspec.paths import LLAMA_CPP_PIN

log = logging.getLogger("hyspec.bench")

BUSY_LOAD = 0.5  # a 1-minute load average above this before the run: the figures will suffer
INTERRUPTED = 130  # the exit code of a run stopped by SIGINT or SIGTERM (its report holds what finished)


@dataclass
class Options:
    quick: bool = False
    only: list[int] | None = None  # scenario numbers; None: all of the set
    out: Path = Path("hyspec-bench.json")
    markdown: Path | None = None
    llama_server: Path | None = None
    models_dir: Path | None = None
    max_tokens: int | None = None  # None: 64, or 32 with --quick
    pairs: int = 3
    starts: int = 2  # process starts per versus row, in alternating order
    draft_max: int = 8
    threads: int = 0  # 0: every core
    ctx: int = 4096
    batch: int = 512
    fixed_draft: bool = False  # hyspec drafts draft-max tokens every step, as llama-server does
    prepare_only: bool = False


def _scenario_list(opts: Options) -> list[scenarios.Scenario]:
    chosen = scenarios.quick() if opts.quick else scenarios.full()
    if opts.only:
        unknown = set(opts.only) - set(scenarios.SCENARIO_TITLES)
        if unknown:
            raise ValueError(f"no scenario {sorted(unknown)}; they are 1-{max(scenarios.SCENARIO_TITLES)}")
        chosen = [s for s in chosen if s.number in opts.only]
        if not chosen:
            raise ValueError(f"scenarios {opts.only} are not in the {'quick' if opts.quick else 'full'} set")
    return chosen


def _header(opts: Options, settings: Settings, info: dict, elapsed: float, started: str, interrupted: bool) -> str:
    cmd = shlex.join(["hyspec", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith("hyspec") else "hyspec bench"
    return "\n".join([
        f"## hyspec bench {'--quick ' if opts.quick else ''}({started})",
        "",
        f"- command: `{cmd}`",
        f"- machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, {info['os']}, "
        f"Python {info['python']}, OMP_WAIT_POLICY={info['omp_wait_policy']}, "
        f"load average at start {info['load_average_at_start']}",
        f"- llama.cpp {LLAMA_CPP_PIN} (both sides), llama-server `{settings.llama_server}`",
        f"- every request: {settings.max_tokens} tokens greedy (ignore EOS), draft-max {settings.draft_max}, "
        f"{settings.threads} threads, context {settings.ctx} per slot, batch {settings.batch}; "
        f"warm-up then {settings.pairs} alternating pairs, medians; versus rows split their pairs among "
        f"{settings.starts} start(s) of every process, each warmed up, the start order "
        "reversed from one start to the next; hyspec draft length "
        f"{'adaptive' if settings.adaptive_draft else 'fixed'} (fixed in scenario 4), llama-server's fixed; "
        f"llama-server runs each n-gram type, drafting at most draft-max tokens (ngram-mod: match "
        f"{NGRAM_MOD_MATCH}, n-min 1; ngram-simple and ngram-map-k: lookup 12); hyspec's prefix cache is off "
        f"except in the cache scenarios; both sides "
        + ("map the weights from the file" if settings.mmap
           else "read the weights into memory (llama-server: --load-mode none)"),
        f"- wall time of the run: {elapsed / 60:.1f} min"
        + (": **interrupted**, only the scenarios below finished" if interrupted else ""),
        "",
        "",
    ])


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the run as Ctrl-C does. Its default action would end this process alone and
    leave the llama-servers and workers it started running, each holding its model in memory;
    unwinding stops them. A second SIGTERM while they stop is ignored, so that it cannot cut the
    unwinding short."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set on the main thread
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log.warning("SIGTERM: stopping the run")
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_bench(opts: Options) -> int:
    """Run the benchmark; 0 when every scenario ran and every output was exact, 1 when one failed
    or differed, INTERRUPTED when SIGINT or SIGTERM stopped it (the report then holds the
    scenarios that finished)."""
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    chosen = _scenario_list(opts)
    models_dir = opts.models_dir or default_models_dir()
    t0 = time.perf_counter()
    paths = prepare(scenarios.models(chosen), models_dir)
    log.info("models ready in %.0f s", time.perf_counter() - t0)
    if opts.prepare_only:
        for spec, path in paths.items():
            print(f"{spec.label}: {path}")
        return 0
    binary = opts.llama_server or default_binary()
    if not binary.is_file():
        raise FileNotFoundError(f"llama-server not found at {binary}: build it with `make llama-server` "
                                "(or pass --llama-server PATH, built from the pinned llama.cpp tree)")
    settings = Settings(llama_server=binary, max_tokens=opts.max_tokens or (32 if opts.quick else 64),
                        pairs=opts.pairs, starts=opts.starts, draft_max=opts.draft_max,
                        threads=opts.threads or os.cpu_count() or 1,
                        ctx=opts.ctx, batch=opts.batch, adaptive_draft=not opts.fixed_draft)
    load = load_average()
    if load is not None and load > BUSY_LOAD:
        log.warning("load average %.2f: something else is running, and with OpenMP threads that can cost "
                    "llama.cpp several times its speed. Figures from a busy machine are not comparable.", load)
    runner = Runner(settings, paths, passive_omp=opts.quick)
    info = machine()
    info["omp_wait_policy"] = runner.env.get("OMP_WAIT_POLICY", "(unset)")
    results: list[Result] = []
    t_run = time.perf_counter()
    interrupted = False
    try:
        with _sigterm_interrupts():
            for k, sc in enumerate(chosen, 1):
                what = f"{sc.number} {scenarios.SCENARIO_TITLES[sc.number]}: {sc.name}"
                log.info("[%d/%d] scenario %s (%s) ...", k, len(chosen), what, ", ".join(t.label for t in sc.targets))

                t_sc = time.perf_counter()
                try:
                    results += runner.run(sc, lambda msg: log.info("  %s", msg))
                except (WorkerError, PeerError, ServiceError, OSError, TimeoutError) as e:
                    log.error("scenario %s failed: %s", what, e)
                    results.append(Result(sc.kind, sc.number, sc.name, sc.targets[0].label, getattr(sc, "spec", ""),
                                          error=str(e).splitlines()[0], exact=False, same_tokens="error"))
                log.info("  done in %.0f s (%.1f min so far)", time.perf_counter() - t_sc,
                         (time.perf_counter() - t_run) / 60)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: the report holds the %d result(s) that finished", len(results))
    finally:
        runner.close()
    elapsed = time.perf_counter() - t_run

    summaries = [report.summarize(r) for r in results]
    goals = report.goals(results, summaries)
    text = _header(opts, settings, info, elapsed, started, interrupted) + report.markdown(results, summaries, goals)
    print(text)
    doc = {"hyspec": __version__, "llama_cpp": LLAMA_CPP_PIN, "started": started, "quick": opts.quick,
           "command": sys.argv, "elapsed_s": elapsed, "interrupted": interrupted, "machine": info,
           "settings": {**asdict(settings), "llama_server": str(settings.llama_server)},
           "results": report.to_json(results, summaries), "goals": goals}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(doc, indent=1, default=str))
    log.info("wrote %s", opts.out)
    if opts.markdown is not None:
        opts.markdown.write_text(text + "\n")
        log.info("wrote %s", opts.markdown)
    if interrupted:
        return INTERRUPTED
    ok = all(r.error is None and r.exact for r in results)
    if not ok:
        log.error("some scenario failed or produced different tokens: see the 'same tokens' column")
    return 0 if ok else 1
