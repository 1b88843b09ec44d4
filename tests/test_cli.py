"""The CLI's flags and their environment twins (hyspec.flags)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hyspec.cli import _engine_config, _request, build_parser
from hyspec.engine import Engine
from hyspec.flags import env_twins
from hyspec.types import GenerationRequest, SpecMode


def parse(*argv: str) -> object:
    return build_parser().parse_args(list(argv))


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("HYSPEC_") or k == "HYSPEC_CACHE"}
    return subprocess.run([sys.executable, "-m", "hyspec", *argv], capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})})


def test_no_environment_twin_means_two_things() -> None:
    twins = env_twins(build_parser())
    for env, uses in twins.items():
        flags = {flag for _, flag in uses}
        assert len(flags) == 1, f"{env} is the twin of {uses}"
        subcommands = {sub for sub, _ in uses}
        # generate and serve share the engine flags; every other subcommand has its own prefix.
        assert len(subcommands) == 1 or subcommands <= {"generate", "serve"}, f"{env}: {uses}"
    assert twins["HYSPEC_SEED"] == [("generate", "--seed")]
    assert twins["HYSPEC_MAKE_MODEL_SEED"] == [("make-model", "--seed")]
    assert ("bench", "--max-tokens") in twins["HYSPEC_BENCH_MAX_TOKENS"]


def test_precedence_command_line_then_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse("generate", "--prompt", "x").draft_max == 8
    monkeypatch.setenv("HYSPEC_DRAFT_MAX", "5")
    assert parse("generate", "--prompt", "x").draft_max == 5
    assert parse("generate", "--prompt", "x", "--draft-max", "3").draft_max == 3
    monkeypatch.setenv("HYSPEC_PROMPT", "from the environment")
    assert parse("generate").prompt == "from the environment"
    monkeypatch.setenv("HYSPEC_MAKE_MODEL_SEED", "7")
    monkeypatch.setenv("HYSPEC_SEED", "99")
    assert parse("make-model", "--out", "m.gguf").seed == 7
    assert parse("generate").seed == 99


def test_repeatable_flags_replace_their_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYSPEC_STOP", "env-stop")
    assert parse("generate", "--prompt", "x").stop == ["env-stop"]
    assert parse("generate", "--prompt", "x", "--stop", "a", "--stop", "b").stop == ["a", "b"]


@pytest.mark.parametrize("env,value,message", [
    ("HYSPEC_LOG_LEVEL", "loud", "HYSPEC_LOG_LEVEL='loud': choose from debug, info, warning, error"),
    ("HYSPEC_SPEC", "bogus", "HYSPEC_SPEC='bogus': choose from"),
    ("HYSPEC_DRAFT_MAX", "-2", "HYSPEC_DRAFT_MAX='-2': must be >= 0"),
    ("HYSPEC_FIXED_DRAFT", "maybe", "HYSPEC_FIXED_DRAFT='maybe': expected one of"),
    ("HYSPEC_GPU_LAYERS", "many", "HYSPEC_GPU_LAYERS='many'"),
])
def test_bad_environment_values_are_one_line_errors(env: str, value: str, message: str) -> None:
    proc = run("generate", "--prompt", "x", env={env: value})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_spec_help_lists_plain_choices() -> None:
    proc = run("generate", "--help")
    assert "{off,auto,draft,ngram}" in proc.stdout and "SpecMode." not in proc.stdout


def test_remote_requests_carry_only_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """`generate --server` must not override the server's --draft-max with the CLI's default."""
    spec = _request(parse("generate", "--prompt", "x")).spec
    assert (spec.mode, spec.draft_min, spec.draft_max) == (None, None, None)
    spec = _request(parse("generate", "--prompt", "x", "--draft-max", "2", "--spec", "ngram")).spec
    assert (spec.mode, spec.draft_max) == (SpecMode.NGRAM, 2)
    monkeypatch.setenv("HYSPEC_DRAFT_MIN", "1")
    assert _request(parse("generate", "--prompt", "x")).spec.draft_min == 1


def test_gpu_layers_reach_llama_cpp_and_both_settings_run(tiny_lfm2: Path) -> None:
    args = parse("generate", "--prompt", "x", "--model", str(tiny_lfm2), "--gpu-layers", "all")
    config = _engine_config(args, progress=False)
    assert (config.gpu_layers, config.draft_gpu_layers) == (-1, -1)
    assert _engine_config(parse("generate", "--prompt", "x", "--model", str(tiny_lfm2), "--gpu-layers", "3",
                                "--draft-gpu-layers", "0"), progress=False).draft_gpu_layers == 0
    outputs = []
    for layers in (0, -1):
        config = _engine_config(parse("generate", "--prompt", "x", "--model", str(tiny_lfm2), "--gpu-layers",
                                      str(layers) if layers >= 0 else "all", "--ctx", "256", "--threads", "2"),
                                progress=False)
        with Engine(config) as engine:
            assert engine.model.n_gpu_layers == layers
            assert engine.info()["target"]["gpu_layers"] == layers
            outputs.append(engine.generate(GenerationRequest(token_ids=[128000, 9906], max_tokens=8,
                                                             ignore_eos=True)).token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


def test_weights_are_read_into_memory_unless_mapping_is_asked_for(tiny_lfm2: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "own-copy.gguf"  # a file no other test's engine has mapped
    model.write_bytes(tiny_lfm2.read_bytes())

    def mapped() -> bool:
        return str(model) in Path("/proc/self/maps").read_text()

    outputs = []
    for argv in ([], ["--mmap"]):
        config = _engine_config(parse("generate", "--prompt", "x", "--model", str(model), "--ctx", "256",
                                      "--threads", "2", *argv), progress=False)
        assert config.mmap is bool(argv)
        with Engine(config) as engine:
            assert mapped() is config.mmap
            outputs.append(engine.generate(GenerationRequest(token_ids=[128000, 9906], max_tokens=8,
                                                             ignore_eos=True)).token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8
    monkeypatch.setenv("HYSPEC_MMAP", "1")
    assert _engine_config(parse("generate", "--prompt", "x", "--model", str(model)), progress=False).mmap

def test_serve_defaults_to_the_bundled_pair_and_gemma_is_one_flag_away() -> None:
    from hyspec import models
    from hyspec.gemma import gemma_path

    config = _engine_config(parse("serve"), progress=False)
    assert (config.model, config.draft, config.spec, config.ctx) == (models.target(), models.draft(), None, None)
    gemma = _engine_config(parse("serve", "--model", "gemma"), progress=False)
    assert gemma.model == gemma_path(progress=False) and gemma.draft is None
    own = _engine_config(parse("serve", "--model", "/x.gguf", "--ctx", "100"), progress=False)
    assert own.model == Path("/x.gguf") and own.draft is None and own.ctx == 100


def test_the_default_server_speculates_on_the_trained_hybrid_pair() -> None:
    """What `make serve` serves: the bundled LFM2 target with its draft, speculation auto, the
    context of the models' training (512) per slot; text that reads like the corpus."""
    import re
    import time

    import grpc
    from hyspec.v1 import hyspec_pb2 as pb2
    from hyspec.v1 import hyspec_pb2_grpc as pb2_grpc

    server = subprocess.Popen([sys.executable, "-m", "hyspec", "serve", "--port", "0", "--slots", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        address, deadline = None, time.monotonic() + 120
        while address is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            assert line, server.stderr.read() if server.stderr else ""
            if match := re.match(r"hyspec: ready on (\S+)", line):
                address = match.group(1)
        assert address
        with grpc.insecure_channel(address) as channel:
            stub = pb2_grpc.GenerationStub(channel)
            info = stub.GetModelInfo(pb2.GetModelInfoRequest(), timeout=30)
            assert info.target.arch == "lfm2" and info.target.is_hybrid and info.draft.arch == "lfm2"
            assert info.default_spec == pb2.SPEC_MODE_AUTO and info.ctx == 512
            done = stub.Complete(pb2.GenerateRequest(text="And God said,", max_tokens=24), timeout=60)
            words = done.text.split()
            assert len(words) >= 5 and sum(w.strip(",.;:").lower() in {"the", "and", "of", "unto", "lord", "god"}
                                            for w in words) >= 2, done.text
    finally:
        server.terminate()
        server.wait(timeout=60)
