"""The in-process hyspec side of the benchmark, in a child process of its own.

The engine runs in a child so that its peak RSS is its own (not the orchestrator's, nor
llama-server's) and so that nothing else in its process competes for the cores. The parent
drives it over pipes, one JSON object per line: ``HyspecWorker`` is the parent's end,
``main()`` (``python -m hyspec.bench.worker CONFIG_JSON``) the child's.

The child also times the engine's rollback work (checkpoints, restores and replays) by
wrapping those calls on its scheduler instance: benchmark instrumentation, at the cost of a
clock read per call.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from hyspec.bench.records import Batch, Run
from hyspec.bench.system import ManagedProcess, end_process, tail

log = logging.getLogger("hyspec.bench")


@dataclass
class WorkerConfig:
    model: str
    draft: str | None = None
    slots: int = 1
    ctx: int = 4096
    threads: int = 0
    batch: int = 512
    draft_max: int = 8
    adaptive_draft: bool = True  # the engine's default; False drafts draft_max tokens every step
    oracle: bool = False  # plug the controlled-acceptance drafter in as the n-gram mode
    rs_snapshots: int | None = None  # hybrid rollback: None the engine's default (a snapshot ring), 0 checkpoints
    prefix_cache_mb: int = 0  # the prefix cache: off unless a scenario measures it
    mmap: bool = False  # map the weights from the file (EngineConfig.mmap)


# -- the child ----------------------------------------------------------------------------------


class _Timers:
    """Seconds spent in the scheduler's checkpoint, restore (truncate) and replay calls."""

    NAMES = ("checkpoint", "restore", "replay")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self.calls = dict.fromkeys(self.NAMES, 0)

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        inner = getattr(obj, attr, None)
        if inner is None:
            log.warning("no %s to time on %r: its timer stays 0", attr, obj)
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        setattr(obj, attr, timed)

    def snapshot(self) -> dict[str, float]:
        out = {f"{name}_ms": self.seconds[name] * 1000.0 for name in self.NAMES}
        out.update({f"{name}_calls": float(self.calls[name]) for name in self.NAMES})
        return out


def _serve(config: WorkerConfig, stdin: IO[str], stdout: IO[str]) -> None:
    from hyspec.drafters import Drafter
    from hyspec.drafters.oracle import OracleDrafter
    from hyspec.drafters.suffix import SharedIndex, SuffixDrafter
    from hyspec.engine import Engine, EngineConfig
    from hyspec.types import GenerationRequest, SpecMode, SpecParams

    def reply(obj: dict[str, Any]) -> None:
        stdout.write(json.dumps(obj) + "\n")
        stdout.flush()

    overrides: dict[SpecMode, Drafter] = {}
    oracle: OracleDrafter | None = None
    engine_config = EngineConfig(model=Path(config.model), draft=Path(config.draft) if config.draft else None,
                                 spec=SpecMode.OFF, draft_max=config.draft_max, adaptive_draft=config.adaptive_draft,
                                 rs_snapshots=config.rs_snapshots, slots=config.slots, ctx=config.ctx,
                                 threads=config.threads, batch=config.batch, max_queue=64,
                                 prefix_cache_mb=config.prefix_cache_mb, mmap=config.mmap)
    if config.oracle:
        oracle = OracleDrafter()
        overrides[SpecMode.NGRAM] = oracle
    engine = Engine(engine_config, drafter_overrides=overrides)
    engine.warmup()
    # Each mode learns from its own earlier requests only, as a server of its own would: a mode
    # run after another on the same prompt must not find that run's output in the shared index.
    suffix = engine.speculator.suffix
    indexes: dict[str, SharedIndex] = {}
    timers = _Timers()
    timers.wrap(engine.scheduler.rollback, "checkpoint", "checkpoint")
    timers.wrap(engine.scheduler.rollback, "truncate", "restore")
    timers.wrap(engine.scheduler, "_replay", "replay")
    reply({"ready": True, "pid": os.getpid(), "info": engine.info()})

    for line in stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "tokenize":
                reply({"ok": True, "tokens": engine.tokenize(cmd["text"], add_special=cmd.get("add_special", True))})
            elif op == "detokenize":
                reply({"ok": True, "text": engine.detokenize(cmd["tokens"])})
            elif op == "reference":
                assert oracle is not None, "the worker was started without the oracle drafter"
                oracle.add_reference(cmd["prompt"], cmd["tokens"])
                reply({"ok": True})
            elif op == "alpha":
                assert oracle is not None, "the worker was started without the oracle drafter"
                oracle.set_alpha(cmd["alpha"], cmd.get("seed", 0))
                reply({"ok": True})
            elif op == "run":
                requests = [GenerationRequest(token_ids=r["prompt"], max_tokens=r["max_tokens"], ignore_eos=True,
                                              spec=SpecParams(mode=SpecMode(r["spec"]), draft_max=r["draft_max"]))
                            for r in cmd["requests"]]
                if isinstance(suffix, SuffixDrafter):
                    # The engine thread hands a finished request to the index just after its
                    # result: the last command's requests must reach their own mode's index
                    # before the switch (one that lost the race reached the next command's: in
                    # b44 the n-gram mode's first measured request found nothing at its first
                    # step, and drafted 55 tokens of 56).
                    while engine.scheduler.busy:
                        time.sleep(0.001)
                    suffix.shared = indexes.setdefault(cmd["requests"][0]["spec"], SharedIndex())
                timers.reset()
                t0 = time.perf_counter()
                handles = [engine.submit(request) for request in requests]
                runs = []
                for handle in handles:
                    result = handle.result()
                    s = result.stats
                    runs.append(asdict(Run(tokens=result.token_ids, tokens_per_second=s.tokens_per_second,
                                           ttft_ms=s.ttft_ms, drafted=s.drafted, accepted=s.accepted,
                                           rollbacks=s.rollbacks, replayed=s.replayed_tokens,
                                           wall_s=time.perf_counter() - t0, cached_tokens=s.cached_tokens)))
                wall = time.perf_counter() - t0
                reply({"ok": True, "runs": runs, "wall_s": wall, "timers": timers.snapshot()})
            elif op == "quit":
                reply({"ok": True})
                break
            else:
                reply({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as e:  # reported to the parent, which fails the scenario
            log.exception("worker command %s failed", op)
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    engine.close(grace=0)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = WorkerConfig(**json.loads(args[0]))
    # The protocol owns stdout: anything else printed there (native code included) goes to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(config, sys.stdin, protocol)
    return 0


# -- the parent's end ---------------------------------------------------------------------------


class WorkerError(RuntimeError):
    pass


class HyspecWorker(ManagedProcess):
    """A running worker child. Use as a context manager; ``stop()`` ends it."""

    def __init__(self, config: WorkerConfig, log_path: Path, *, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hyspec.bench.worker", json.dumps(asdict(config))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> None:
        msg = self._read()
        if not msg.get("ready"):
            raise WorkerError(f"hyspec worker did not start: {msg}")
        self.info = msg["info"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise WorkerError(f"hyspec worker exited with {self.proc.returncode}; its log "
                              f"({self.log_path}) ends with:\n{tail(self.log_path)}")
        return json.loads(line)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        msg = self._read()
        if not msg.get("ok"):
            raise WorkerError(f"hyspec worker: {op} failed: {msg.get('error')}")
        return msg

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.call("tokenize", text=text, add_special=add_special)["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        return self.call("detokenize", tokens=tokens)["text"]

    def run(self, prompts: list[list[int]], *, max_tokens: int, spec: str, draft_max: int) -> Batch:
        """Run the prompts concurrently (one request each) and wait for all of them."""
        msg = self.call("run", requests=[{"prompt": p, "max_tokens": max_tokens, "spec": spec,
                                          "draft_max": draft_max} for p in prompts])
        return Batch(runs=[Run(**r) for r in msg["runs"]], wall_s=msg["wall_s"], timers=msg["timers"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (WorkerError, OSError, ValueError):
                pass
            end_process(self.proc)
        self._log.close()



if __name__ == "__main__":
    sys.exit(main())
