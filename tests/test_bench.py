"""`hyspec bench --quick` end to end on the tiny models, against llama-server.

Checks the report's shape and the same-tokens verdicts; asserts no speed figure (timed
tests on a shared machine measure the machine, not the code).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hyspec.bench.peer import default_binary
from hyspec.bench.runner import child_env
from hyspec.bench.worker import WorkerConfig, _serve
from hyspec.drafters.suffix import SuffixDrafter

MAX_TOKENS = 32
PAIRS = 2


def _quick_bench(out: Path, *args: str) -> list[str]:
    """`hyspec bench --quick ARGS` against the built llama-server, its models and reports in ``out``
    (run it with ``child_env()``: no HYSPEC_* flag twin of ours may reach it)."""
    binary = Path(os.environ.get("HYSPEC_LLAMA_SERVER", default_binary()))
    assert binary.is_file(), f"llama-server not built ({binary}): run `make llama-server` (make test does)"
    return [sys.executable, "-m", "hyspec", "bench", "--quick", "--llama-server", str(binary),
            "--models-dir", str(out / "models"), "--out", str(out / "report.json"),
            "--markdown", str(out / "report.md"), *args]


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(_quick_bench(out, "--max-tokens", str(MAX_TOKENS), "--pairs", str(PAIRS)),
                          capture_output=True, text=True, timeout=540, env=child_env())
    assert proc.returncode == 0, f"hyspec bench --quick failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), proc


def test_report_has_every_quick_scenario(quick_report: tuple[dict[str, Any], str, Any]) -> None:
    report, _, _ = quick_report
    assert report["quick"] is True
    assert {"machine", "settings", "results", "goals", "elapsed_s"} <= report.keys()
    assert report["settings"]["max_tokens"] == MAX_TOKENS and report["settings"]["pairs"] == PAIRS
    results = report["results"]
    assert {r["number"] for r in results} == {1, 2, 3, 4, 6, 7, 8, 9, 10, 11}
    assert {r["kind"] for r in results} == {"versus", "oracle", "streams", "service", "cache"}
    for r in results:
        assert r["error"] is None, r
        assert r["summary"], r


def test_every_scenario_produced_the_same_tokens(quick_report: tuple[dict[str, Any], str, Any]) -> None:
    report, _, _ = quick_report
    for r in report["results"]:
        assert r["exact"] is True, (r["name"], r["same_tokens"], r["comparisons"])
        assert r["same_tokens"].startswith("yes"), r["same_tokens"]
        for name, side in r["sides"].items():
            assert side["runs"], (r["name"], name)
            for run in side["runs"]:
                assert len(run["tokens"]) == (r["max_tokens"] or MAX_TOKENS), (r["name"], name)


def test_both_sides_ran_alternating_pairs(quick_report: tuple[dict[str, Any], str, Any]) -> None:
    report, _, _ = quick_report
    for r in report["results"]:
        if r["kind"] == "versus":
            # hyspec's own mode; plain and auto beside every speculative one; llama-server's
            # n-gram types beside hyspec's n-gram.
            expected = {"off": {"hyspec", "llama-server"},
                        "ngram": {"hyspec", "hyspec off", "hyspec auto", "llama-server ngram-simple",
                                  "llama-server ngram-map-k", "llama-server ngram-mod"},
                        "draft": {"hyspec", "hyspec off", "hyspec auto", "llama-server"}}[r["spec"]]
            if r["number"] == 11:
                expected = expected | {"hyspec ngram"}
            assert set(r["sides"]) == expected, r["name"]
            # The trained pair's answers are twice the bench's length, and its pairs twice as many
            # (a fast model, timed longer).
            length = 2 * MAX_TOKENS if r["number"] == 11 else MAX_TOKENS
            pairs = 2 * PAIRS if r["number"] == 11 else PAIRS
            assert r["max_tokens"] == length and r["pairs"] == pairs, r["name"]
            assert r["starts"] == 2  # the default: every process started twice, half the pairs each
            for side in r["sides"].values():
                assert len(side["runs"]) == pairs and side["peak_rss_kb"] > 0
                assert len(side["pids"]) == pairs and len(set(side["pids"])) == 2
            s = r["summary"]
            assert set(s["tokens_per_second"]) == {"hyspec", "llama-server", "ratio", "per_pair", "best_peer"}
            assert len(s["tokens_per_second"]["per_pair"]) == pairs
            assert s["tokens_per_second"]["ratio"] is not None and s["ttft_ms"]["ratio"] is not None
            assert s["peak_rss_mb"]["ratio"] is not None
            assert set(s["settings"]) == expected
            if r["spec"] == "off":
                assert s["acceptance"] == {"hyspec": None, "llama-server": None} and s["auto"] is None
            else:
                assert s["auto"]["vs_best_fixed"] is not None and s["auto"]["vs_llama"] is not None
            if r["spec"] == "draft":
                # llama-server's draft model drafts every step; hyspec's only where it pays, so it
                # reports an acceptance exactly when it drafted.
                assert s["acceptance"]["llama-server"] is not None
                drafted = any(run["drafted"] for run in r["sides"]["hyspec"]["runs"])
                assert (s["acceptance"]["hyspec"] is not None) == drafted
        elif r["kind"] == "cache":
            assert set(r["sides"]) == {"hyspec cache", "hyspec no cache", "llama-server cache"}
            turns = r["summary"]["turns"]
            assert len(turns) == r["turns"] and all(t["cache_vs_no_cache"] is not None for t in turns)
            for side in r["sides"].values():
                assert len(side["runs"]) == PAIRS * r["turns"] * (2 if r["number"] == 10 else 1)
            # Later turns (and streams after the warm-up) start from the cache; without it, never.
            reused = [run["cached_tokens"] for k, run in enumerate(r["sides"]["hyspec cache"]["runs"])
                      if r["number"] == 10 or k % r["turns"]]
            assert reused and all(n > 100 for n in reused), reused
            assert all(run["cached_tokens"] == 0 for run in r["sides"]["hyspec no cache"]["runs"])
        elif r["kind"] == "streams":
            assert set(r["sides"]) == {"hyspec ×1", "llama-server ×1", "hyspec ×4", "llama-server ×4"}
            assert len(r["sides"]["hyspec ×4"]["runs"]) == 4 * PAIRS
            assert set(r["summary"]["aggregate_tokens_per_second"]) == {"1", "4"}
        elif r["kind"] == "service":
            assert set(r["sides"]) == {"in-process", "gRPC"}
            assert r["summary"]["overhead"] is not None


def test_controlled_acceptance_keeps_the_output_and_counts_rollbacks(
        quick_report: tuple[dict[str, Any], str, Any]) -> None:
    report, _, _ = quick_report
    oracle = [r for r in report["results"] if r["kind"] == "oracle"]
    assert len(oracle) == 3  # the hybrid target (snapshot ring, then checkpoint + replay) and the attention one
    for r in oracle:
        settings = r["summary"]["settings"]
        assert set(settings) == {"plain", "α=0.6", "α=0.6 auto"}
        assert settings["α=0.6 auto"]["vs_best_fixed"] is not None
        assert settings["plain"]["acceptance"] is None and settings["plain"]["rollbacks"] == 0
        spec = settings["α=0.6"]
        assert 0.0 < spec["acceptance"] < 1.0 and spec["rollbacks"] > 0
    ring, hybrid = [r for r in oracle if r["target"].startswith("LFM2")]
    attention = next(r for r in oracle if r["target"].startswith("llama"))
    # Only the hybrid target with checkpoints replays after a rollback; attention trims its KV,
    # and so does the hybrid with a snapshot ring (the default).
    assert "checkpoint" in hybrid["name"] and "checkpoint" not in ring["name"]
    assert hybrid["summary"]["settings"]["α=0.6"]["replayed_tokens"] > 0
    assert ring["summary"]["settings"]["α=0.6"]["replayed_tokens"] == 0
    assert attention["summary"]["settings"]["α=0.6"]["replayed_tokens"] == 0


def test_markdown_tables_and_same_tokens_column(quick_report: tuple[dict[str, Any], str, Any]) -> None:
    _, markdown, proc = quick_report
    assert markdown.strip() in proc.stdout  # printed and written alike
    lines = markdown.splitlines()
    header = next(line for line in lines if line.startswith("| # | scenario"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    same = columns.index("same tokens")
    body = lines[lines.index(header) + 2:]
    rows = body[:next((i for i, line in enumerate(body) if not line.startswith("|")), len(body))]
    assert len(rows) == 5  # scenarios 1, 2, 3, 8 and 11
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(columns) and cells[same].startswith("yes"), row
    for title in ("scenario 4", "scenario 6", "scenario 7", "scenario 9", "scenario 10", "### Goals"):
        assert title in markdown
    assert f"scenario 11 kjv-target (trained) Q8_0 {2 * MAX_TOKENS} tokens; the others {MAX_TOKENS}." in markdown
    assert f"scenario 11 kjv-target (trained) Q8_0 {2 * PAIRS} pairs; the others {PAIRS}." in markdown
    # Both sides load the weights alike (a llama-server refusing --load-mode would have failed the run).
    assert "both sides read the weights into memory (llama-server: --load-mode none)" in markdown
    auto = next(line for line in lines if line.startswith("`α auto` rows"))
    assert ", checkpoint + replay α=0.6 " in auto  # each target named as in its table, rollback and all


# -- the controlled-acceptance drafter, on its own (no model) -----------------------------------


def _item(seq: int, history: list[int], max_len: int) -> Any:
    from hyspec.drafters import DraftItem

    return DraftItem(seq=seq, history=history, max_len=max_len)


def _tokens(drafter: Any, item: Any) -> list[int]:
    [draft] = drafter.propose([item])
    return draft.tokens


def test_oracle_drafts_the_reference_for_the_whole_length_asked() -> None:
    from hyspec.drafters.oracle import OracleDrafter

    prompt, reference = [1, 2, 3], list(range(100, 140))
    always = OracleDrafter(alpha=1.0)
    always.add_reference(prompt, reference)
    # history = prompt + the 5 tokens accepted so far: the draft continues at reference[5]
    assert _tokens(always, _item(0, prompt + reference[:5], 8)) == reference[5:13]
    assert _tokens(always, _item(0, prompt + reference[:38], 8)) == reference[38:40]  # the reference ends
    never = OracleDrafter(alpha=0.0)
    never.add_reference(prompt, reference)
    draft = _tokens(never, _item(0, prompt + reference[:5], 8))
    assert len(draft) == 8 and all(t != r for t, r in zip(draft, reference[5:13], strict=True))  # it cannot know
    assert _tokens(never, _item(1, [9, 9, 9, 9], 8)) == []  # a prompt it has no reference for


def test_oracle_acceptance_is_alpha_and_divergence_stops_drafting() -> None:
    from hyspec.drafters.oracle import OracleDrafter

    prompt, reference = [5, 6], list(range(1000, 1100))
    drafter = OracleDrafter()
    drafter.add_reference(prompt, reference)
    drafted = accepted = 0
    for seed in range(30):
        drafter.set_alpha(0.6, seed)
        for done in range(1, 90):
            draft = _tokens(drafter, _item(seed, prompt + reference[:done], 8))
            drafted += len(draft)
            accepted += sum(1 for k, token in enumerate(draft) if token == reference[done + k])
    assert abs(accepted / drafted - 0.6) < 0.03
    drafter.release(0)
    assert _tokens(drafter, _item(0, prompt + [7, 7], 8)) == []  # off the reference: nothing to propose
    assert drafter.diverged == 1
    assert _tokens(drafter, _item(0, prompt + reference[:3], 8)) == []  # stays off until released


def test_oracle_drafts_on_from_a_continuation_registered_where_the_output_left_its_reference() -> None:
    from hyspec.drafters.oracle import OracleDrafter

    prompt, reference = [5, 6], list(range(1000, 1040))
    drafter = OracleDrafter(alpha=1.0)
    drafter.add_reference(prompt, reference)
    output = reference[:10] + [7]  # a near-tie broken the other way at output token 10
    drafter.add_reference(prompt + output, list(range(2000, 2029)))  # the plain run from there
    assert _tokens(drafter, _item(0, prompt + reference[:4], 3)) == reference[4:7]
    assert _tokens(drafter, _item(0, prompt + output, 3)) == [2000, 2001, 2002]  # the step after it left
    assert _tokens(drafter, _item(0, prompt + output + [2000, 2001], 3)) == [2002, 2003, 2004]
    assert drafter.diverged == 0
    assert _tokens(drafter, _item(0, prompt + output + [2000, 9], 3)) == []  # off that one too
    assert drafter.diverged == 1


class _PlainWorker:
    """A worker's reference calls and plain runs over a made-up target: after any history, the
    next token is the sum of the last two, modulo 97."""

    def __init__(self) -> None:
        self.registered: dict[tuple[int, ...], list[int]] = {}
        self.plain_runs = 0

    def call(self, op: str, **args: Any) -> None:
        assert op == "reference"
        self.registered[tuple(args["prompt"])] = args["tokens"]

    def run(self, prompts: list[list[int]], *, spec: str, max_tokens: int, draft_max: int) -> Any:
        from hyspec.bench.records import Batch, Run

        assert spec == "off" and len(prompts) == 1
        self.plain_runs += 1
        history = list(prompts[0])
        for _ in range(max_tokens):
            history.append((history[-1] + history[-2]) % 97)
        return Batch([Run(tokens=history[len(prompts[0]):], tokens_per_second=1.0, ttft_ms=1.0)], 1.0, {})


def test_bench_registers_the_plain_continuation_from_where_an_output_left_the_known_ones() -> None:
    from hyspec.bench.runner import _References

    worker = _PlainWorker()
    prompt = [1, 2]
    reference = worker.run([prompt], spec="off", max_tokens=30, draft_max=0).runs[0].tokens
    references = _References(worker, prompt, reference, 30)  # type: ignore[arg-type]
    assert worker.registered == {(1, 2): reference}
    assert not references.extend(reference) and worker.plain_runs == 1
    # Off at output token 8, then (from the continuation registered there) off again at 20.
    first = reference[:8] + [50]
    first += worker.run([prompt + first], spec="off", max_tokens=30 - 9, draft_max=0).runs[0].tokens
    worker.plain_runs = 0
    assert references.extend(first) and worker.plain_runs == 1
    assert worker.registered[tuple(prompt + first[:9])] == first[9:]
    assert not references.extend(first) and worker.plain_runs == 1  # followed now: nothing to run
    second = first[:20] + [3]
    second += worker.run([prompt + second], spec="off", max_tokens=30 - 21, draft_max=0).runs[0].tokens
    worker.plain_runs = 0
    assert references.extend(second) and worker.plain_runs == 1
    assert worker.registered[tuple(prompt + second[:21])] == second[21:]
    assert not references.extend(reference[:29] + [0])  # off at the last token: nothing left to draft
    assert len(worker.registered) == 3


def test_oracle_settings_with_the_same_seed_meet_the_same_wrong_positions() -> None:
    """Whatever lengths a setting drafts, and in whatever order, an output position is right or
    wrong for every setting given the seed: a pair's settings differ in policy, not in luck."""
    from hyspec.drafters.oracle import OracleDrafter

    prompt, reference = [5, 6], list(range(1000, 1100))

    def right_positions(lengths: list[int]) -> dict[int, bool]:
        drafter = OracleDrafter(alpha=0.5, seed=7)
        drafter.add_reference(prompt, reference)
        seen: dict[int, bool] = {}
        done = 1
        for n in lengths * 40:
            if done + n > 90:
                break
            draft = _tokens(drafter, _item(0, prompt + reference[:done], n))
            seen.update({done + k: token == reference[done + k] for k, token in enumerate(draft)})
            done += 1 + n // 2
        return seen

    fixed, varied = right_positions([8]), right_positions([1, 3, 8, 2])
    common = fixed.keys() & varied.keys()
    assert len(common) > 40 and all(fixed[j] == varied[j] for j in common)
    assert 0 < sum(fixed.values()) < len(fixed)  # both kinds occur


# -- the report's ratios, on made-up runs (no model) ------------------------------------------


def _side(rates: list[float]) -> Any:
    from hyspec.bench.records import Run
    from hyspec.bench.runner import Side

    return Side(runs=[Run(tokens=[1], tokens_per_second=r, ttft_ms=1.0) for r in rates],
                batches=[1.0] * len(rates), peak_rss_kb=1)


def test_ratios_are_taken_against_the_configuration_with_the_best_median() -> None:
    from hyspec.bench.report import summarize
    from hyspec.bench.runner import Result

    # Two llama-server types and hyspec's plain and fixed modes trade places pair by pair; the
    # best type (ngram-mod) and the best setting (fixed) are the ones with the best median.
    r = Result("versus", 2, "n-gram", "t", "ngram", sides={
        "hyspec": _side([10.0, 10.0, 10.0]),
        "hyspec off": _side([9.0, 11.0, 9.0]),
        "hyspec auto": _side([10.0, 10.0, 10.0]),
        "llama-server ngram-simple": _side([12.0, 8.0, 8.0]),
        "llama-server ngram-mod": _side([9.0, 10.0, 10.0]),
    })
    s = summarize(r)
    assert s["tokens_per_second"]["best_peer"] == "ngram-mod"
    assert s["tokens_per_second"]["ratio"] == pytest.approx(1.0)  # per pair 10/9, 10/10, 10/10
    # Per-pair maxima (12, 11, 10 and 10, 11, 10) would have read 0.83 and 0.91.
    assert s["auto"]["vs_best_fixed"] == pytest.approx(1.0)
    assert s["auto"]["vs_llama"] == pytest.approx(1.0)


def test_goals_show_each_pair_against_the_goal() -> None:
    """A median on either side of a goal says little when the pairs straddle it: the goal row
    names the pairs' range and how many reached the goal."""
    from hyspec.bench.report import goals, summarize
    from hyspec.bench.runner import Result

    r = Result("versus", 2, "n-gram", "t", "ngram", goal=1.0, sides={
        "hyspec": _side([9.0, 10.0, 12.0, 10.0]),
        "hyspec off": _side([5.0, 5.0, 5.0, 5.0]),
        "hyspec auto": _side([9.0, 9.0, 11.0, 8.0]),
        "llama-server ngram-mod": _side([10.0, 10.0, 10.0, 8.0]),
    })
    s = summarize(r)
    assert s["tokens_per_second"]["per_pair"] == pytest.approx([0.9, 1.0, 1.2, 1.25])
    rows = {g["goal"].split(": ")[-1]: g for g in goals([r], [s])}
    versus = rows["hyspec ngram ÷ llama-server ngram-mod tok/s ≥ 1"]
    assert versus["met"] is True and versus["measured"] == "1.10× (pairs 0.90–1.25, 3 of 4 ≥ 1)"
    auto = rows["auto ÷ max(plain, fixed) ≥ 0.95"]  # against the fixed mode: 1.0, 0.9, 0.92, 0.8
    assert auto["met"] is False and auto["measured"] == "0.91× (pairs 0.80–1.00, 1 of 4 ≥ 0.95)"


def test_each_scenario_runs_its_pairs_in_orders_of_its_own() -> None:
    """Seeded by the pair alone, every scenario with as many settings ran the same orders, so an
    order's effect repeated across scenarios instead of averaging out."""
    from hyspec.bench.runner import Result, _shuffled

    settings = ["hyspec", "hyspec off", "hyspec auto", "ngram-simple", "ngram-map-k", "ngram-mod"]
    results = [Result("versus", n, name, target, "ngram") for n, name, target in
               ((2, "n-gram", "LFM2 F16"), (2, "n-gram", "LFM2 Q8_0"), (5, "n-gram", "Gemma"), (8, "agentic", "Gemma"))]
    for i in range(3):
        orders = [_shuffled(settings, r, i) for r in results]
        assert all(sorted(o) == sorted(settings) for o in orders)
        assert len({tuple(o) for o in orders}) > 1  # not one order for all
        assert orders == [_shuffled(settings, r, i) for r in results]  # the same again: seeded
    assert len({tuple(_shuffled(settings, results[0], i)) for i in range(5)}) > 1  # nor one for all pairs


def test_agentic_sessions_do_not_repeat_an_earlier_one() -> None:
    """One chain of edits of edits reached a fixed point on Gemma (b64): from its sixth request
    on, each equalled one three pairs earlier, and both sides drafted it from memory. Each
    session now has an opening and an edit of its own: the first is the scenario's prompt."""
    from hyspec.bench.scenarios import AGENTIC_EDITS, PROSE, STREAM_PROMPTS, agentic_session, variant

    distinct = len(STREAM_PROMPTS) * len(AGENTIC_EDITS)
    sessions = [agentic_session(PROSE, i) for i in range(distinct)]
    assert sessions[0] == (variant(PROSE, 0), AGENTIC_EDITS[0])
    assert len({(opening.split(". ", 1)[1], edit) for opening, edit in sessions}) == distinct
    assert all("{answer}" in edit for _, edit in sessions)
    other = agentic_session("Write a haiku about rain. ", 1)[0]
    assert other == variant(PROSE, 1)  # another opening comes first; PROSE then takes its turn
    assert agentic_session("Write a haiku about rain. ", 0)[0] == variant("Write a haiku about rain. ", 0)


def test_each_mode_of_the_worker_learns_from_its_own_earlier_requests_only(tiny_llama: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's hyspec worker gives each speculation mode a suffix index of its own, as a
    server of its own would have. A request's output reaches its index just after the result
    (on the engine's thread), so the worker switches indexes only once the last command's
    requests are released: the first `auto` request, after an `ngram` one on the same prompt,
    finds nothing of it; each mode's second finds its first. A slow release widens the window
    (in which the `ngram` answer used to reach the `auto` index)."""
    release = SuffixDrafter.release

    def slow_release(self: SuffixDrafter, seq: int, history: list[int] | None = None) -> None:
        time.sleep(0.2)
        release(self, seq, history)

    monkeypatch.setattr(SuffixDrafter, "release", slow_release)
    prompt = [128000] + [300 + (7 * i) % 500 for i in range(40)]
    commands = "".join(json.dumps({"op": "run", "requests": [{"prompt": prompt, "max_tokens": 24, "spec": mode,
                                                              "draft_max": 4}]}) + "\n"
                       for mode in ("ngram", "auto", "ngram", "auto"))
    replies = io.StringIO()
    _serve(WorkerConfig(model=str(tiny_llama), threads=2, ctx=512, draft_max=4, adaptive_draft=False),
           io.StringIO(commands), replies)
    ngram, auto, ngram_again, auto_again = (json.loads(line)["runs"][0] for line in replies.getvalue().splitlines()[1:])
    assert ngram["tokens"] == auto["tokens"] == ngram_again["tokens"] == auto_again["tokens"]
    answered = len(ngram["tokens"]) - 2  # all but the first token (with the prompt) and the last step's own
    assert auto["accepted"] < answered // 2, auto
    for again in (ngram_again, auto_again):
        assert again["accepted"] >= answered // 2, again


class _FakeProcess:
    """A bench process that records what the runner did with it in a shared journal."""

    count = 0

    def __init__(self, name: str, journal: list[tuple[str, str, object]]) -> None:
        _FakeProcess.count += 1
        self.name, self.journal, self.pid = name, journal, 1000 + _FakeProcess.count
        journal.append((name, "start", self.pid))

    def wait_ready(self) -> None:
        self.journal.append((self.name, "ready", self.pid))

    def stop(self) -> None:
        self.journal.append((self.name, "stop", self.pid))

    def peak_rss_kb(self) -> int:
        return self.pid

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [len(word) for word in text.split()]

    def run(self, prompts: list[list[int]], *, max_tokens: int, spec: str = "", draft_max: int = 0) -> Any:
        from hyspec.bench.records import Batch, Run

        self.journal.append((self.name, "run", self.pid))
        return Batch([Run(tokens=[1] * max_tokens, tokens_per_second=10.0, ttft_ms=1.0)], 0.1, {})


@pytest.mark.parametrize("starts", [1, 2, 3])
def test_a_versus_row_splits_its_pairs_among_starts_that_reverse_the_order(
        starts: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two processes doing the same work differ here by a few percent, partly by which started
    first: each start warms up every process and then measures its share of the pairs, the next
    start reverses the order (each llama-server type starts before the worker as often as after
    it, as far from it), and each process starts only once the one before it is ready."""
    from hyspec.bench import runner as bench_runner
    from hyspec.bench.models import ModelSpec
    from hyspec.bench.scenarios import Versus

    journal: list[tuple[str, str, object]] = []
    monkeypatch.setattr(bench_runner, "_Checker", lambda model: type("NoCheck", (), {
        "__call__": lambda self, *a: None, "verdict": lambda self, r: None})())
    target = ModelSpec()
    settings = bench_runner.Settings(llama_server=tmp_path / "llama-server", pairs=5, starts=starts, max_tokens=4)
    runner = bench_runner.Runner(settings, {target: tmp_path / "m.gguf"}, log_dir=tmp_path)
    monkeypatch.setattr(runner, "_worker", lambda config: _FakeProcess("hyspec", journal))
    monkeypatch.setattr(runner, "_peer", lambda t, name, draft: _FakeProcess(name, journal))
    sc = Versus(2, "n-gram", target, "ngram", "one two three")
    result = runner._versus(sc, lambda line: None)

    assert result.starts == starts and result.pairs == 5
    names = ["hyspec", *sc.peers]
    started = [(name, pid) for name, what, pid in journal if what == "start"]
    assert len(started) == starts * len(names)
    for k in range(starts):
        batch = [name for name, _ in started[k * len(names):(k + 1) * len(names)]]
        assert batch == (names if k % 2 == 0 else names[::-1])
    # Each process starts once the one before is ready, and every one is stopped.
    for (name, what, pid), after in itertools.pairwise(journal):
        if what == "start":
            assert after == (name, "ready", pid)
    stops = {pid: n for n, (_, what, pid) in enumerate(journal) if what == "stop"}
    assert sorted(stops) == sorted(pid for _, pid in started)
    for k in range(1, starts):  # a start's processes are gone before the next start begins
        first = journal.index((started[k * len(names)][0], "start", started[k * len(names)][1]))
        assert all(stops[pid] < first for _, pid in started[(k - 1) * len(names):k * len(names)])
    # Each start measures its share of the pairs after a warm-up on every process it started.
    shares = [len(range(5 * k // starts, 5 * (k + 1) // starts)) for k in range(starts)]
    for side_name, side in result.sides.items():
        assert len(side.runs) == 5
        assert [side.pids.count(pid) for pid in dict.fromkeys(side.pids)] == shares, side_name
    for k, (name, pid) in enumerate(started):
        runs = sum(1 for who, what, p in journal if what == "run" and p == pid)
        per_request = len(sc.modes) if name == "hyspec" else 1
        assert runs == per_request * (1 + shares[k // len(names)]), (name, k)


def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def test_sigterm_stops_every_process_the_run_started_and_reports_the_scenarios_that_finished(
        tmp_path: Path) -> None:
    """A run told to stop (SIGTERM, as `timeout` and service managers send) must not leave its
    llama-servers and workers running with their models in memory, and a long run's finished
    scenarios must not be lost."""
    proc = subprocess.Popen(
        _quick_bench(tmp_path, "--scenarios", "1,2", "--max-tokens", "8", "--pairs", "1", "--starts", "1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env())
    assert proc.stderr is not None
    seen: set[int] = set()
    try:
        for line in proc.stderr:  # scenario 1 finished: scenario 2 is starting its processes
            if "done in" in line:
                break
        deadline = time.monotonic() + 120
        while len(seen) < 2 and time.monotonic() < deadline:  # the worker and a llama-server at least
            seen |= _children(proc.pid)
            time.sleep(0.05)
        assert len(seen) >= 2, "scenario 2 started no processes"
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 130, rest[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        # The run waited for each child it stopped: none may be left, not even as a zombie.
        left = [pid for pid in seen if Path(f"/proc/{pid}").exists()]
        for pid in left:  # and none is left to the rest of the suite either way
            os.kill(pid, signal.SIGKILL)
    assert not left
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["interrupted"] is True
    assert [(r["number"], r["error"]) for r in report["results"]] == [(1, None)]
    assert "interrupted" in (tmp_path / "report.md").read_text()
