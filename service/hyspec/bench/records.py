"""What either side reports: one request's run, and a batch of concurrent ones."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Run:
    """One request's outcome, as either side reports it."""

    tokens: list[int]
    tokens_per_second: float  # decode rate after the first token, as the engine measures it
    ttft_ms: float  # submit (hyspec) or prompt start (llama-server) to the first token
    drafted: int = 0
    accepted: int = 0
    rollbacks: int | None = None  # None: the side does not report it
    replayed: int | None = None
    wall_s: float = 0.0  # request sent to result received, as the caller sees it
    cached_tokens: int = 0  # prompt tokens taken from a prefix cache

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


@dataclass
class Batch:
    """Requests run together: their runs, the wall time of the whole and the rollback timers."""

    runs: list[Run]
    wall_s: float
    timers: dict[str, float]
