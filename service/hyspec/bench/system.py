"""What the benchmark reads from the operating system: peak RSS, the machine, free ports."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, TypeVar

_P = TypeVar("_P", bound="ManagedProcess")


def peak_rss_kb(pid: int) -> int | None:
    """The process's peak resident set size (VmHWM) in KiB, None if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def end_process(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """Wait for a process that was asked to stop; kill it when it has not within ``timeout``."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ManagedProcess:
    """A child process used as a context manager: ready on entry (stopped again when that
    fails), stopped on exit. Subclasses start ``proc`` and define wait_ready() and stop()."""

    proc: subprocess.Popen[Any]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def peak_rss_kb(self) -> int | None:
        return peak_rss_kb(self.proc.pid)

    def wait_ready(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _P) -> _P:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError):
        pass
    return None


def load_average() -> float | None:
    """The 1-minute load average, two decimals."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine() -> dict[str, Any]:
    """The machine a run happened on, for the report."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "load_average_at_start": load_average(),
    }
