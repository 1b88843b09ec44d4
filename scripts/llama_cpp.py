#!/usr/bin/env python3
"""Fetch, verify and build the pinned llama.cpp tree, cached outside the clone.

The pin is the llama.cpp tree vendored in the PyPI sdist of llama-cpp-python (see
README "Building"). It is fetched with the ordinary pip client, sha256-checked, unpacked
once into ``$HYSPEC_CACHE`` (default ``~/.cache/hyspec``) and built there, so a fresh
clone, CI and rebuilds reuse it. ``LLAMA_CPP_DIR`` points at a checkout of your own instead.

Sub-commands:
  source   print the llama.cpp source directory (fetching it if needed)
  libs     build + install static libllama/ggml (PIC) and print the install prefix
  server   build llama-server from the same tree and print the binary's path

Extra CMake arguments for llama.cpp (``-DGGML_CUDA=ON`` ...) are passed with ``--cmake-arg``
or ``HYSPEC_LLAMA_CMAKE_ARGS``; each distinct set gets its own build directory.

Standard library only: it runs before the project's virtualenv has anything in it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PIN_PACKAGE = "llama-cpp-python"
PIN_VERSION = "0.3.36"
PIN_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PIN_COMMIT = "0c1e57098bba"
SDIST_NAME = f"llama_cpp_python-{PIN_VERSION}.tar.gz"

LIBS_ARGS = [
    "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
SERVER_ARGS = [
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
# ggml's AMX kernels in the pinned tree crash at their first tile instruction (SIGSEGV in
# ldtilecfg inside ggml_backend_amx_mul_mat, llama.cpp issue #20824) on CPUs that have AMX, in
# any matrix product of a quantized model. GGML_NATIVE's -march=native turns them on there, so
# both builds (ours and the llama-server we compare with) leave them out; an explicit -mno-*
# wins over -march=native whatever the order.
X86_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def arch_flags() -> dict[str, str]:
    """Compiler flags this machine's builds need, by CMake variable."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return {"CMAKE_C_FLAGS": X86_NO_AMX, "CMAKE_CXX_FLAGS": X86_NO_AMX}
    return {}


def with_arch_flags(extra: list[str]) -> list[str]:
    """``arch_flags`` as definitions, then ``extra``. A definition of the same variable in
    ``extra`` (``-DCMAKE_C_FLAGS=-O3``) gets them appended instead: CMake keeps the last
    definition, so a user's flags would otherwise drop ours (and bring the AMX crash back)."""
    flags = arch_flags()
    merged: list[str] = []
    args = iter(extra)
    for arg in args:
        if arg == "-D":  # "-D NAME=VALUE", two arguments
            arg = "-D" + next(args, "")
        name, _, value = arg.removeprefix("-D").partition("=")
        variable = name.partition(":")[0]  # -DNAME:TYPE=VALUE
        if arg.startswith("-D") and variable in flags:
            arg = f"-D{name}={value} {flags.pop(variable)}"
        merged.append(arg)
    return [f"-D{variable}={value}" for variable, value in flags.items()] + merged


CONFIGURE_RECORD = "hyspec-configure-args.txt"  # in each build directory: what it was configured with


def log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("HYSPEC_CACHE", Path.home() / ".cache" / "hyspec")).expanduser()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_sdist(cache: Path) -> Path:
    """Download the pinned sdist with pip (no host named: pip's configured index)."""
    sdist = cache / "src" / SDIST_NAME
    if sdist.exists() and sha256(sdist) == PIN_SHA256:
        return sdist
    sdist.parent.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PIN_PACKAGE}=={PIN_VERSION} sdist with pip (once)")
    with tempfile.TemporaryDirectory(dir=sdist.parent) as tmp:
        subprocess.run(
            # pip prepares the sdist's metadata in an isolated build environment whose build
            # requirements come as wheels (a ":all:" here would build CMake itself from source,
            # and --no-build-isolation would depend on what this interpreter has installed).
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PIN_PACKAGE,
             f"{PIN_PACKAGE}=={PIN_VERSION}", "-d", tmp],
            check=True,
        )
        got = Path(tmp) / SDIST_NAME
        actual = sha256(got)
        if actual != PIN_SHA256:
            raise SystemExit(f"sha256 mismatch for {SDIST_NAME}: got {actual}, want {PIN_SHA256}")
        got.replace(sdist)
    return sdist


def source_dir() -> Path:
    """The llama.cpp source: LLAMA_CPP_DIR, or the pinned tree unpacked in the cache."""
    override = os.environ.get("LLAMA_CPP_DIR")
    if override:
        path = Path(override).expanduser().resolve()
        if not (path / "include" / "llama.h").exists():
            raise SystemExit(f"LLAMA_CPP_DIR={path} does not look like a llama.cpp checkout")
        return path
    cache = cache_dir()
    dest = cache / f"llama.cpp-{PIN_COMMIT}"
    if (dest / "include" / "llama.h").exists():
        return dest
    sdist = fetch_sdist(cache)
    log(f"unpacking {sdist.name}")
    prefix = f"llama_cpp_python-{PIN_VERSION}/vendor/llama.cpp/"
    with tempfile.TemporaryDirectory(dir=cache) as tmp, tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(tmp, members=members, filter="data")
        shutil.move(str(Path(tmp) / prefix), dest)
    return dest


def build_key(kind: str, extra: list[str]) -> str:
    """One build directory per kind and set of extra CMake arguments."""
    extra_tag = hashlib.sha1(" ".join(extra).encode()).hexdigest()[:8] if extra else "cpu"
    return f"{kind}-{extra_tag}"


def configured_source(build: Path) -> str | None:
    cache = build / "CMakeCache.txt"
    if not cache.exists():
        return None
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            return line.split("=", 1)[1]
    return None


def configured_args(build: Path) -> list[str] | None:
    """The arguments ``build`` was configured with (None before they were recorded)."""
    record = build / CONFIGURE_RECORD
    return record.read_text().splitlines() if record.exists() else None


def stale_reason(build: Path, src: Path, configure: list[str]) -> str | None:
    """Why the configured ``build`` cannot be reused for ``src`` and ``configure`` (None: it
    can, or nothing is configured there yet)."""
    if not (build / "CMakeCache.txt").exists():
        return None
    if configured_source(build) not in (None, str(src)):
        return "was configured for another llama.cpp tree"
    if configured_args(build) != configure:
        return "was configured with other arguments"
    return None


def cmake_build(kind: str, base_args: list[str], extra: list[str], targets: list[str], install: bool) -> Path:
    src = source_dir()
    key = build_key(kind, extra)
    build = cache_dir() / "build" / key
    prefix = cache_dir() / "prefix" / key
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_INSTALL_PREFIX={prefix}", *base_args, *with_arch_flags(extra)]
    reason = stale_reason(build, src, configure)
    if reason is not None:
        log(f"{build} {reason}: starting it afresh")
        shutil.rmtree(build)
    if not (build / "CMakeCache.txt").exists():
        log(f"configuring {kind} build in {build} (first time: several minutes)")
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *generator, *configure],
                       check=True, stdout=sys.stderr)
        (build / CONFIGURE_RECORD).write_text("\n".join(configure) + "\n")
    jobs = str(os.cpu_count() or 2)
    cmd = ["cmake", "--build", str(build), "-j", jobs]
    for target in targets:
        cmd += ["--target", target]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    if install:
        subprocess.run(["cmake", "--install", str(build)], check=True, stdout=subprocess.DEVNULL)
        return prefix
    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["source", "libs", "server"])
    parser.add_argument("--cmake-arg", action="append", default=[], help="extra CMake argument for llama.cpp")
    parser.add_argument("--out", type=Path, help="also write the printed path to this file")
    args = parser.parse_args()
    extra = shlex.split(os.environ.get("HYSPEC_LLAMA_CMAKE_ARGS", "")) + [a for a in args.cmake_arg if a]
    if args.command == "source":
        result = source_dir()
    elif args.command == "libs":
        result = cmake_build("libs", LIBS_ARGS, extra, [], install=True)
    else:
        result = cmake_build("server", SERVER_ARGS, extra, ["llama-server"], install=False) / "bin" / "llama-server"
    print(result)
    if args.out:
        args.out.write_text(str(result))


if __name__ == "__main__":
    main()
