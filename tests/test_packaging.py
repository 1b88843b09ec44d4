"""Set-up and packaging: the wheel works on its own, the Makefile rebuilds what changed, the
licence and CI settings hold."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import venv
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


@pytest.mark.slow
def test_wheel_installs_into_a_clean_venv_and_serves(tmp_path: Path, tiny_lfm2: Path) -> None:
    """`pip install .` (not editable) gives a working `hyspec generate` and `hyspec serve`,
    with the gRPC stubs built into the package, not generated into the source tree."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                    str(dist), str(REPO)], check=True, timeout=900)
    wheel = next(dist.glob("hyspec-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=900)
    listing = subprocess.run([str(py), "-m", "pip", "show", "-f", "hyspec"], capture_output=True, text=True,
                             check=True).stdout
    assert "hyspec/v1/hyspec_pb2.py" in listing and "hyspec/v1/hyspec_pb2_grpc.py" in listing
    assert "grpcio-tools" not in subprocess.run([str(py), "-m", "pip", "list"], capture_output=True,
                                                text=True).stdout.lower().replace("_", "-")

    hyspec = env_dir / "bin" / "hyspec"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYSPEC_") or k == "HYSPEC_CACHE"}
    # Run from elsewhere, so nothing can come from the checkout.
    gen = subprocess.run([str(hyspec), "generate", "--model", str(tiny_lfm2), "--prompt", "Hello",
                          "--max-tokens", "5", "--ignore-eos", "--json"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert gen.returncode == 0, gen.stderr
    local = json.loads(gen.stdout)
    assert local["finish_reason"] == "length" and len(local["token_ids"]) == 5

    server = subprocess.Popen([str(hyspec), "serve", "--model", str(tiny_lfm2), "--port", "0", "--slots", "1",
                               "--ctx", "256"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path, env=env)
    try:
        address = None
        deadline = time.monotonic() + 120
        assert server.stdout is not None
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                break
            if match := re.match(r"hyspec: ready on (\S+)", line):
                address = match.group(1)
                break
        assert address, "the installed server never became ready"
        remote = subprocess.run([str(hyspec), "generate", "--server", address, "--prompt", "Hello", "--max-tokens",
                                 "5", "--ignore-eos", "--json"], capture_output=True, text=True, cwd=tmp_path,
                                env=env, timeout=120)
        assert remote.returncode == 0, remote.stderr
        assert json.loads(remote.stdout)["token_ids"] == local["token_ids"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert server.returncode == 0
    assert not (REPO / "service" / "hyspec" / "v1").exists(), "stubs must not be generated into the source tree"


def test_editing_native_sources_reinstalls_the_extension() -> None:
    """`make serve` / `make test` rebuild the extension when native/, the .proto or the build
    files change (make -W pretends a file was just modified)."""
    for changed in ("native/context.cpp", "native/model.h", "proto/hyspec/v1/hyspec.proto", "CMakeLists.txt"):
        for target in ("serve", "test"):
            plan = subprocess.run(["make", "-n", "-W", changed, target], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout
            assert "--no-build-isolation -e" in plan, f"{changed} changed, `make {target}` would not rebuild"


def test_serve_installs_no_test_tools() -> None:
    plan = subprocess.run(["make", "-n", "-B", ".venv/.installed-serve"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout
    for tool in ("pytest", "ruff", "grpcurl", "npm", "extra test"):
        assert tool not in plan, f"`make serve` installs {tool}"
    test_plan = subprocess.run(["make", "-n", "-B", "test"], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout
    assert "extra test" in test_plan and "npm install" in test_plan


def test_licence_and_ci_settings() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "MIT"
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
    assert "grpcio-tools" not in " ".join(project["dependencies"])
    assert any(r.startswith("grpcio-tools") for r in _pyproject()["build-system"]["requires"])
    ci = (REPO / ".ci" / "run").read_text()
    assert "export PIP_NO_CACHE_DIR=1" in ci and "make test" in ci


def _build_script() -> ModuleType:
    """scripts/llama_cpp.py, which is not part of the package."""
    spec = importlib.util.spec_from_file_location("llama_cpp_build", REPO / "scripts" / "llama_cpp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compiler_flags_of_the_user_keep_the_ones_the_machine_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A -DCMAKE_C_FLAGS in HYSPEC_LLAMA_CMAKE_ARGS gets the AMX switches appended: CMake keeps
    the last definition, so passing both would have dropped one of them."""
    script = _build_script()
    monkeypatch.setattr(script.platform, "machine", lambda: "x86_64")
    no_amx = script.X86_NO_AMX
    assert script.with_arch_flags(["-DGGML_CUDA=ON"]) == [
        f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}", "-DGGML_CUDA=ON"]
    assert script.with_arch_flags(["-DCMAKE_C_FLAGS=-O3 -g", "-D", "CMAKE_CXX_FLAGS:STRING=-O2", "-DX=1"]) == [
        f"-DCMAKE_C_FLAGS=-O3 -g {no_amx}", f"-DCMAKE_CXX_FLAGS:STRING=-O2 {no_amx}", "-DX=1"]
    assert script.with_arch_flags(["-DCMAKE_CXX_FLAGS_RELEASE=-O2"]) == [
        f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}", "-DCMAKE_CXX_FLAGS_RELEASE=-O2"]
    monkeypatch.setattr(script.platform, "machine", lambda: "aarch64")
    assert script.with_arch_flags(["-DCMAKE_C_FLAGS=-O3"]) == ["-DCMAKE_C_FLAGS=-O3"]


def test_a_cached_build_is_reused_only_for_its_tree_and_arguments(tmp_path: Path) -> None:
    """The build cache lives outside the clone and outlives it: a build configured for another
    llama.cpp tree or with other arguments is started afresh, never built on."""
    script = _build_script()
    build, src, configure = tmp_path / "build", tmp_path / "llama.cpp", ["-DCMAKE_BUILD_TYPE=Release", "-DX=1"]
    assert script.stale_reason(build, src, configure) is None  # nothing configured yet
    build.mkdir()
    (build / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={src}\n")
    (build / script.CONFIGURE_RECORD).write_text("\n".join(configure) + "\n")
    assert script.stale_reason(build, src, configure) is None
    assert script.stale_reason(build, src, [*configure, "-DGGML_CUDA=ON"]) == "was configured with other arguments"
    assert script.stale_reason(build, tmp_path / "other", configure) == "was configured for another llama.cpp tree"
    (build / script.CONFIGURE_RECORD).unlink()  # configured before the arguments were recorded
    assert script.stale_reason(build, src, configure) == "was configured with other arguments"
