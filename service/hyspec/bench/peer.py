"""The peer: llama-server built from the same pinned llama.cpp tree, on loopback.

It gets what hyspec gets: the same target and draft, draft size, threads, context per slot,
batch and slots, greedy sampling (top-k 1) and ``n_predict`` with ``ignore_eos`` so both
generate the same number of tokens. No prompt cache (``--cache-ram 0``, ``cache_prompt: false``,
no context checkpoints) unless the scenario measures caches; then ``cache_prompt: true`` with the
server's default cache and context checkpoints. Speculation is ``draft-simple`` with a draft
model, or one of the n-gram types (``ngram-simple``, ``ngram-map-k``, ``ngram-mod``) drafting at
most draft-max tokens as hyspec does; never the ``--spec-synth-*`` modes, which accept wrong
tokens on purpose. Speed and acceptance are the server's own ``/completion`` timings.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyspec.bench.records import Batch, Run
from hyspec.bench.system import ManagedProcess, end_process, free_port, tail
from hyspec.paths import cache_dir

log = logging.getLogger("hyspec.bench")

# ngram-mod drafts only after this many tokens match (llama.cpp's default, 24, suits long
# repeats; below 16 it warns of poor quality).
NGRAM_MOD_MATCH = 24
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


def default_binary() -> Path:
    """Where ``make llama-server`` (scripts/llama_cpp.py server) puts the CPU build."""
    return cache_dir() / "build" / "server-cpu" / "bin" / "llama-server"


@dataclass
class PeerConfig:
    binary: Path
    model: Path
    draft: Path | None = None
    spec: str = "off"  # off, draft, or one of NGRAM_TYPES
    draft_max: int = 8
    slots: int = 1
    ctx: int = 4096  # per slot
    threads: int = 2
    batch: int = 512
    cache: bool = False  # the server's prompt cache and context checkpoints, as it ships
    mmap: bool = True  # map the weights from the file, as it ships (False: read them into memory)

    def argv(self, port: int) -> list[str]:
        t = str(self.threads)
        argv = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
                "-t", t, "-tb", t, "-c", str(self.ctx * self.slots), "-np", str(self.slots), "--no-kv-unified",
                "-b", str(self.batch), "-ub", str(self.batch), "--no-webui", "-fit", "off", "--no-slots"]
        if not self.cache:
            argv += ["--cache-ram", "0", "--ctx-checkpoints", "0"]
        if not self.mmap:
            argv += ["--load-mode", "none"]
        if self.spec == "draft":
            if self.draft is None:
                raise ValueError("speculation 'draft' needs a draft model")
            argv += ["--spec-type", "draft-simple", "-md", str(self.draft), "--spec-draft-n-max", str(self.draft_max),
                     "--spec-draft-n-min", "0", "-td", t, "-tbd", t]
        elif self.spec == "ngram-mod":
            argv += ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", str(self.draft_max),
                     "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-match", str(NGRAM_MOD_MATCH)]
        elif self.spec in ("ngram-simple", "ngram-map-k"):  # lookup n-gram of 12 (the default)
            argv += ["--spec-type", self.spec, f"--spec-{self.spec}-size-m", str(self.draft_max)]
        elif self.spec != "off":
            raise ValueError(f"unknown speculation mode {self.spec!r}")
        return argv


class PeerError(RuntimeError):
    pass


class LlamaServer(ManagedProcess):
    """A running llama-server. Use as a context manager (it waits until the model is loaded)."""

    def __init__(self, config: PeerConfig, log_path: Path, *, env: dict[str, str] | None = None,
                 start_timeout: float = 600.0) -> None:
        if not config.binary.is_file():
            raise FileNotFoundError(f"llama-server not found at {config.binary}: build it with `make llama-server` "
                                    "(or point --llama-server at one built from the pinned tree)")
        self.config = config
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(config.argv(self.port), stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        next_note = time.monotonic() + 10.0
        while True:
            if self.proc.poll() is not None:
                raise PeerError(f"llama-server exited with {self.proc.returncode}; its log ({self.log_path}) "
                                f"ends with:\n{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while loading
            if time.monotonic() > deadline:
                raise PeerError(f"llama-server not ready after {self.start_timeout:.0f} s; log: {self.log_path}")
            if time.monotonic() > next_note:
                log.info("  waiting for llama-server to load %s ...", self.config.model.name)
                next_note += 10.0
            time.sleep(0.1)

    def _post(self, path: str, body: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise PeerError(f"llama-server {path}: HTTP {e.code}: {e.read()[:500]!r}") from None

    def complete(self, prompt: list[int], n_predict: int) -> Run:
        """One greedy completion of ``prompt`` (from the prompt cache where the server keeps one)."""
        body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": self.config.cache,
                "temperature": 0.0, "top_k": 1, "samplers": ["top_k"], "return_tokens": True, "stream": False}
        t0 = time.perf_counter()
        answer = self._post("/completion", body)
        wall = time.perf_counter() - t0
        timings = answer.get("timings", {})
        return Run(tokens=[int(t) for t in answer.get("tokens", [])],
                   tokens_per_second=float(timings.get("predicted_per_second", 0.0)),
                   ttft_ms=float(timings.get("prompt_ms", 0.0)),
                   drafted=int(timings.get("draft_n", 0)), accepted=int(timings.get("draft_n_accepted", 0)),
                   wall_s=wall, cached_tokens=int(timings.get("cache_n", 0)))

    def run(self, prompts: list[list[int]], *, max_tokens: int) -> Batch:
        """The prompts as concurrent requests (one connection each); waits for all of them."""
        t0 = time.perf_counter()
        if len(prompts) == 1:
            runs = [self.complete(prompts[0], max_tokens)]
        else:
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                runs = list(pool.map(lambda p: self.complete(p, max_tokens), prompts))
        return Batch(runs=runs, wall_s=time.perf_counter() - t0, timers={})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            end_process(self.proc)
        self._log.close()

