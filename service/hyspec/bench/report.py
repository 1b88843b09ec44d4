"""From measured runs to figures: medians, per-pair ratios, the markdown tables, the JSON.

Ratios are hyspec ÷ llama-server per pair (run i of one side against run i of the other,
which ran right after it), then the median of those; a ratio above 1 means hyspec is ahead
on throughput, and behind on time to first token and memory.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from hyspec.bench.runner import HYSPEC, LLAMA, Result, Side
from hyspec.bench.scenarios import SCENARIO_TITLES

# -- figures ------------------------------------------------------------------------------------


def median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def pair_ratios(a: list[float | None], b: list[float | None]) -> list[float]:
    """a[i] / b[i] for every pair where both were measured."""
    return [x / y for x, y in zip(a, b, strict=False) if x is not None and y]


def pair_ratio(a: list[float | None], b: list[float | None]) -> float | None:
    """Median over pairs of a[i] / b[i]."""
    return median(pair_ratios(a, b))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mb(kb: int | None) -> float | None:
    return kb / 1024.0 if kb is not None else None


def _rates(side: Side) -> list[float | None]:
    return [x.tokens_per_second for x in side.runs]


def _median_rate(side: Side) -> float:
    """What makes a side (a configuration) the best: its median tokens/s. Ratios are taken
    against the best side pair by pair: taking the best side of each pair instead would credit
    the others with the luck of whichever side the noise favoured in that pair."""
    return median(_rates(side)) or 0.0


def _best(*sides: Side) -> Side:
    return max(sides, key=_median_rate)


def _versus_summary(r: Result) -> dict[str, Any]:
    h = r.sides[HYSPEC]
    peers = {name: side for name, side in r.sides.items() if name.startswith(LLAMA)}
    best_name = max(peers, key=lambda name: _median_rate(peers[name]))
    ll = peers[best_name]
    best = _rates(ll)
    tps_h = _rates(h)
    ttft_h, ttft_l = [x.ttft_ms for x in h.runs], [x.ttft_ms for x in ll.runs]
    per_pair = pair_ratios(tps_h, best)
    ratio = median(per_pair)
    out: dict[str, Any] = {
        "tokens_per_second": {HYSPEC: median(tps_h), LLAMA: median(best), "ratio": ratio, "per_pair": per_pair,
                              "best_peer": best_name.removeprefix(LLAMA).strip() or r.spec},
        "settings": {name: {"tokens_per_second": median(_rates(side)),
                            "acceptance": median(x.acceptance for x in side.runs),
                            "rollbacks": median(x.rollbacks for x in side.runs)} for name, side in r.sides.items()},
        "ttft_ms": {HYSPEC: median(ttft_h), LLAMA: median(ttft_l), "ratio": pair_ratio(ttft_h, ttft_l)},  # type: ignore[arg-type]
        "acceptance": {HYSPEC: median(x.acceptance for x in h.runs), LLAMA: median(x.acceptance for x in ll.runs)},
        "rollbacks": {HYSPEC: median(x.rollbacks for x in h.runs), LLAMA: None},
        "peak_rss_mb": {HYSPEC: _mb(h.peak_rss_kb), LLAMA: _mb(ll.peak_rss_kb),
                        "ratio": _ratio(h.peak_rss_kb, ll.peak_rss_kb)},  # type: ignore[arg-type]
        "goal_met": None if r.goal is None or ratio is None else ratio >= r.goal,
        "auto": None,
    }
    plain, auto = r.sides.get(f"{HYSPEC} off"), r.sides.get(f"{HYSPEC} auto")
    if plain is not None:
        out["vs_plain_per_pair"] = pair_ratios(tps_h, _rates(plain))
        out["vs_plain"] = median(out["vs_plain_per_pair"])
    if plain is not None and auto is not None:
        fixed = [name for name in r.sides if name.startswith(HYSPEC) and name not in (f"{HYSPEC} off",
                                                                                     f"{HYSPEC} auto")]
        per_pair = pair_ratios(_rates(auto), _rates(_best(plain, *(r.sides[n] for n in fixed))))
        against = median(per_pair)
        out["auto"] = {"tokens_per_second": median(_rates(auto)), "vs_best_fixed": against, "per_pair": per_pair,
                       "vs_llama": pair_ratio(_rates(auto), best), "goal_met": None if against is None
                       else against >= AUTO_GOAL}
    return out


AUTO_GOAL = 0.95  # auto ÷ max(plain, best fixed configuration), in every scenario


def _oracle_target(r: Result) -> str:
    """A controlled-acceptance result's target, named with its rollback where it is not the default."""
    return f"{r.target}, checkpoint + replay" if "checkpoint" in r.name else r.target


def _oracle_summary(r: Result) -> dict[str, Any]:
    plain = median(x.tokens_per_second for x in r.sides["plain"].runs)
    rows = {}
    for label, side in r.sides.items():
        tps = median(x.tokens_per_second for x in side.runs)
        walls = side.batches
        timers = side.timers
        rollbacks = median(x.rollbacks for x in side.runs)
        checkpoint = median(t.get("checkpoint_ms", 0.0) for t in timers)
        restore = median(t.get("restore_ms", 0.0) for t in timers)
        replay = median(t.get("replay_ms", 0.0) for t in timers)
        total = sum(v or 0.0 for v in (checkpoint, restore, replay))
        wall_ms = (median(walls) or 0.0) * 1000.0
        rows[label] = {
            "tokens_per_second": tps, "vs_plain": _ratio(tps, plain),
            "acceptance": median(x.acceptance for x in side.runs), "rollbacks": rollbacks,
            "replayed_tokens": median(x.replayed for x in side.runs),
            "checkpoint_ms": checkpoint, "restore_ms": restore, "replay_ms": replay,
            "rollback_ms_total": total,
            "ms_per_rollback": ((restore or 0.0) + (replay or 0.0)) / rollbacks if rollbacks else None,
            "share_of_time": total / wall_ms if wall_ms else None,
        }
    for label in list(rows):
        if label.endswith(" auto"):
            fixed = r.sides[label.removesuffix(" auto")]
            per_pair = pair_ratios(_rates(r.sides[label]), _rates(_best(r.sides["plain"], fixed)))
            against = median(per_pair)
            rows[label]["vs_best_fixed"], rows[label]["per_pair"] = against, per_pair
            rows[label]["goal_met"] = None if against is None else against >= AUTO_GOAL
    return {"settings": rows}


def _cache_summary(r: Result) -> dict[str, Any]:
    """Median TTFT per turn (a conversation) or over the streams (shared prompt), per side."""
    names = list(r.sides)
    runs = {name: r.sides[name].runs for name in names}
    n_turns = r.turns
    turns = []
    for t in range(n_turns):
        ttft = {name: [x.ttft_ms for k, x in enumerate(runs[name]) if k % n_turns == t] for name in names}
        cache, nocache, peer = (ttft[n] for n in names)
        turns.append({**{name: median(v) for name, v in ttft.items()},
                      "cache_vs_no_cache": pair_ratio(cache, nocache),  # type: ignore[arg-type]
                      "cache_vs_llama": pair_ratio(cache, peer)})  # type: ignore[arg-type]
    return {"turns": turns, "peak_rss_mb": {name: _mb(r.sides[name].peak_rss_kb) for name in names}}


def _streams_summary(r: Result) -> dict[str, Any]:
    rows = {}
    counts = sorted({int(name.rsplit("×", 1)[1]) for name in r.sides})
    for n in counts:
        h, ll = r.sides[f"{HYSPEC} ×{n}"].aggregate_rates(), r.sides[f"{LLAMA} ×{n}"].aggregate_rates()
        rows[str(n)] = {HYSPEC: median(h), LLAMA: median(ll), "ratio": pair_ratio(h, ll)}  # type: ignore[arg-type]
    top = rows[str(counts[-1])]["ratio"]
    return {"aggregate_tokens_per_second": rows,
            "peak_rss_mb": {HYSPEC: _mb(r.sides[f"{HYSPEC} ×1"].peak_rss_kb),
                            LLAMA: _mb(r.sides[f"{LLAMA} ×1"].peak_rss_kb)},
            "goal_met": None if r.goal is None or top is None else top >= r.goal}


def _service_summary(r: Result) -> dict[str, Any]:
    inproc, remote = r.sides["in-process"], r.sides["gRPC"]
    overhead = pair_ratio(remote.batches, inproc.batches)  # type: ignore[arg-type]
    overhead = overhead - 1.0 if overhead is not None else None

    def side(s: Side) -> dict[str, Any]:
        wall = median(s.batches)
        tokens = median(len(x.tokens) for x in s.runs)
        return {"wall_s": wall, "end_to_end_tokens_per_second": _ratio(tokens, wall),
                "decode_tokens_per_second": median(x.tokens_per_second for x in s.runs),
                "ttft_ms": median(x.ttft_ms for x in s.runs), "peak_rss_mb": _mb(s.peak_rss_kb)}

    return {"in-process": side(inproc), "gRPC": side(remote), "overhead": overhead,
            "goal_met": None if overhead is None else overhead < 0.03}


def summarize(r: Result) -> dict[str, Any]:
    if r.error:
        return {}
    return {"versus": _versus_summary, "oracle": _oracle_summary, "streams": _streams_summary,
            "service": _service_summary, "cache": _cache_summary}[r.kind](r)


# -- markdown -----------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _bar(value: float | None, top: float, width: int = 20) -> str:
    if value is None or top <= 0:
        return ""
    return "█" * max(1, round(value / top * width))


def markdown(results: list[Result], summaries: list[dict[str, Any]], goals: list[dict[str, Any]]) -> str:
    out: list[str] = []
    pairs = [(r, s) for r, s in zip(results, summaries, strict=True)]

    versus = [(r, s) for r, s in pairs if r.kind == "versus"]
    if versus:
        out += ["### hyspec vs llama-server, one slot (scenarios 1, 2, 3, 5, 8, 11)", ""]
        rows = []
        for r, s in versus:
            if r.error:
                rows.append([str(r.number), r.name, r.target, r.draft or "", "error", *[""] * 14, r.error])
                continue
            t, f, a, rss, auto = s["tokens_per_second"], s["ttft_ms"], s["acceptance"], s["peak_rss_mb"], s["auto"]
            rows.append([str(r.number), r.name, r.target, r.draft or "—", r.spec,
                         _f(t[HYSPEC]), _f(t[LLAMA]), t["best_peer"], _x(t["ratio"]),
                         _f(auto["tokens_per_second"]) if auto else "—", _x(auto["vs_best_fixed"]) if auto else "—",
                         _f(f[HYSPEC], 0), _f(f[LLAMA], 0), _x(f["ratio"]),
                         _pct(a[HYSPEC]), _pct(a[LLAMA]), _f(s["rollbacks"][HYSPEC], 0),
                         _f(rss[HYSPEC], 0), _f(rss[LLAMA], 0), r.same_tokens])
        out += _table(["#", "scenario", "target", "draft", "hyspec mode", "tok/s hyspec", "tok/s llama",
                       "llama type", "÷", "tok/s auto", "auto ÷ max(plain, fixed)", "TTFT ms hyspec",
                       "TTFT ms llama", "÷", "accept hyspec", "accept llama", "rollbacks", "RSS MB hyspec",
                       "RSS MB llama", "same tokens"], rows)
        out += ["", "÷ is hyspec (its mode in the row) ÷ llama-server (its best type in the row: the best "
                "median tok/s of the types it ran), the median of per-pair ratios: above 1 is ahead on tok/s "
                "and behind on TTFT and peak RSS. auto ÷ max(plain, fixed) is `--spec auto` against the best "
                "of plain and the fixed modes (the best median), pair by pair; each pair runs the settings in "
                "another order. tok/s is the decode rate after the first token, as each side reports it; "
                "TTFT is hyspec's submit-to-first-token and llama-server's prompt time; rollbacks are "
                "hyspec's (llama-server does not report them).", ""]
        out += _own_numbers(versus, "max_tokens", "Answers of their own length", "tokens")
        out += _own_numbers(versus, "pairs", "Pairs of their own number", "pairs")
        many = [(r, s) for r, s in versus if not r.error and len(r.sides) > 2]
        if many:
            out += ["Every setting of the speculative scenarios:", ""]
            rows = [[str(r.number), r.name, r.target, name, _f(v["tokens_per_second"]), _pct(v["acceptance"]),
                     _f(v["rollbacks"], 0)] for r, s in many for name, v in s["settings"].items()]
            out += _table(["#", "scenario", "target", "side", "tok/s", "accepted", "rollbacks"], rows)
            out.append("")

    oracle = [(r, s) for r, s in pairs if r.kind == "oracle"]
    if oracle:
        out += ["### Controlled acceptance, hyspec alone (scenario 4)", ""]
        rows = []
        for r, s in oracle:
            if r.error:
                rows.append([r.target, "error", *[""] * 9, r.error])
                continue
            settings = s["settings"]
            top = max((v["tokens_per_second"] or 0.0) for v in settings.values())
            target = _oracle_target(r)
            for label, v in settings.items():
                rows.append([target, label, _f(v["tokens_per_second"]), _x(v["vs_plain"]), _pct(v["acceptance"]),
                             _f(v["rollbacks"], 0), _f(v["replayed_tokens"], 0),
                             f"{_f(v['checkpoint_ms'], 0)} / {_f(v['restore_ms'], 0)} / {_f(v['replay_ms'], 0)}",
                             _f(v["ms_per_rollback"], 2), _pct(v["share_of_time"]), r.same_tokens,
                             _bar(v["tokens_per_second"], top)])
        out += _table(["target", "setting", "tok/s", "vs plain", "accepted", "rollbacks", "replayed tokens",
                       "ms checkpoint / restore / replay", "ms per rollback", "share of time", "same tokens",
                       "tok/s"], rows)
        out += ["", "`α auto` rows: the same drafts offered to `--spec auto`; ÷ max(plain, fixed α): " + ", ".join(
            f"{_oracle_target(r)} {label.removesuffix(' auto')} {_x(v['vs_best_fixed'])}"
            for r, s in oracle if not r.error for label, v in s["settings"].items() if label.endswith(" auto"))]
        out += ["", "Fixed drafts of draft-max tokens, each token right with probability α (a drafted token "
                "whose predecessors were accepted is accepted with probability α; accepted counts all drafted "
                "tokens, those after a wrong one too); which output positions are drafted wrong is drawn once "
                "per pair, the same for every setting of the pair; the output is the plain run's (same tokens). "
                "Milliseconds are per request; a rollback's cost is "
                "its restore plus the replay decode; share of time is their part of the request's wall time.",
                ""]
        retried = [f"{_oracle_target(r)}: {r.retried}" for r, _ in oracle if r.retried]
        if retried:
            out += ["Runs repeated after their output left the reference at a near-tie (the drafter had "
                    "fallen silent there; the plain continuation from that token was added and the run "
                    "repeated; the output it left behind is checked for exactness too): "
                    + ", ".join(retried) + ".", ""]

    streams = [(r, s) for r, s in pairs if r.kind == "streams"]
    for r, s in streams:
        out += [f"### Concurrent streams, aggregate tokens/s (scenario 6): {r.target}", ""]
        if r.error:
            out += [f"error: {r.error}", ""]
            continue
        rows = [[n, _f(v[HYSPEC]), _f(v[LLAMA]), _x(v["ratio"]), r.same_tokens]
                for n, v in s["aggregate_tokens_per_second"].items()]
        out += _table(["streams", "hyspec", "llama-server", "÷", "same tokens"], rows)
        out.append("")

    service = [(r, s) for r, s in pairs if r.kind == "service"]
    for r, s in service:
        out += [f"### One stream through gRPC and in-process (scenario 7): {r.target}", ""]
        if r.error:
            out += [f"error: {r.error}", ""]
            continue
        rows = []
        for path in ("in-process", "gRPC"):
            v = s[path]
            rows.append([path, _f(v["wall_s"], 3), _f(v["end_to_end_tokens_per_second"]),
                         _f(v["decode_tokens_per_second"]), _f(v["ttft_ms"], 1), _f(v["peak_rss_mb"], 0),
                         _pct(s["overhead"]) if path == "gRPC" else "", r.same_tokens if path == "gRPC" else ""])
        out += _table(["path", "end to end s", "tok/s end to end", "decode tok/s (engine)", "TTFT ms (caller)",
                       "RSS MB", "overhead", "same tokens"], rows)
        out.append("")

    for r, s in [(r, s) for r, s in pairs if r.kind == "cache"]:
        out += [f"### Prefix cache, time to first token (scenario {r.number}): {r.name}, {r.target}", ""]
        if r.error:
            out += [f"error: {r.error}", ""]
            continue
        names = list(r.sides)
        rows = [[str(t + 1), *(_f(v[n], 0) for n in names), _x(v["cache_vs_no_cache"]), _x(v["cache_vs_llama"]),
                 r.same_tokens if t == 0 else ""] for t, v in enumerate(s["turns"])]
        out += _table(["turn", *(f"TTFT ms {n}" for n in names), "cache ÷ no cache", "cache ÷ llama",
                       "same tokens"], rows)
        out += ["", f"Longest prompt {r.prompt_tokens} tokens. hyspec's TTFT is submit to first token; "
                "llama-server's is its prompt time (`cache_prompt: true`, its default context checkpoints).", ""]

    if goals:
        out += ["### Goals", ""]
        out += _table(["goal", "measured", "met"],
                      [[g["goal"], g["measured"], {True: "yes", False: "**no**", None: "—"}[g["met"]]] for g in goals])
        out += ["", "Measured: the median of per-pair ratios (met or not by it), the lowest and highest pair, and "
                "how many pairs reached the goal.", ""]
    return "\n".join(out)


def _spread(per_pair: list[float], goal: float) -> str:
    """The pairs' median ratio with their range and how many reached the goal, so that a
    median on either side of a goal inside the pair-to-pair noise reads as such."""
    if not per_pair:
        return _x(None)
    reached = sum(x >= goal for x in per_pair)
    return (f"{_x(median(per_pair))} (pairs {min(per_pair):.2f}–{max(per_pair):.2f}, "
            f"{reached} of {len(per_pair)} ≥ {goal:g})")


def goals(results: list[Result], summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where we want to be, scenario by scenario, against what was measured."""
    out = []
    for r, s in zip(results, summaries, strict=True):
        if r.error:
            continue
        if r.kind == "oracle":
            for label, v in s["settings"].items():
                if label.endswith(" auto"):
                    out.append({"goal": f"4 {_oracle_target(r)}: "
                                        f"auto ÷ max(plain, fixed {label.removesuffix(' auto')}) ≥ {AUTO_GOAL:g}",
                                "measured": _spread(v["per_pair"], AUTO_GOAL),
                                "met": v["goal_met"]})
            continue
        what = f"{r.number} {SCENARIO_TITLES[r.number]}: {r.name}, {r.target}"
        if r.kind == "versus" and r.goal is not None:
            out.append({"goal": f"{what}: hyspec {r.spec} ÷ llama-server {s['tokens_per_second']['best_peer']} "
                                f"tok/s ≥ {r.goal:g}",
                        "measured": _spread(s["tokens_per_second"]["per_pair"], r.goal), "met": s["goal_met"]})
        if r.kind == "versus" and s.get("auto"):
            out.append({"goal": f"{what}: auto ÷ max(plain, fixed) ≥ {AUTO_GOAL:g}",
                        "measured": _spread(s["auto"]["per_pair"], AUTO_GOAL),
                        "met": s["auto"]["goal_met"]})
        if r.kind == "versus" and r.draft and "vs_plain" in s:
            ratio = s["vs_plain"]
            out.append({"goal": f"{what}: hyspec {r.spec} ÷ its plain ≥ 1",
                        "measured": _spread(s["vs_plain_per_pair"], 1.0),
                        "met": None if ratio is None else ratio >= 1.0})
        if r.kind == "cache":
            later = s["turns"][1:] if r.turns > 1 else s["turns"]
            worst_cache = max((t["cache_vs_no_cache"] or 0.0 for t in later), default=None)
            worst_llama = max((t["cache_vs_llama"] or 0.0 for t in later), default=None)
            turns = "turns ≥ 2" if r.turns > 1 else "every stream"
            out.append({"goal": f"{what}: TTFT with ÷ without the cache ≤ 0.15 ({turns}, worst)",
                        "measured": _x(worst_cache), "met": None if worst_cache is None else worst_cache <= 0.15})
            out.append({"goal": f"{what}: TTFT ÷ llama-server's ≤ 1.0 ({turns}, worst)",
                        "measured": _x(worst_llama), "met": None if worst_llama is None else worst_llama <= 1.0})
        elif r.kind == "streams" and r.goal is not None:
            top = list(s["aggregate_tokens_per_second"].items())[-1]
            out.append({"goal": f"6 aggregate tok/s with {top[0]} streams, hyspec ÷ llama-server ≥ {r.goal:g}",
                        "measured": _x(top[1]["ratio"]), "met": s["goal_met"]})
        elif r.kind == "service":
            out.append({"goal": "7 gRPC overhead on one stream < 3%", "measured": _pct(s["overhead"]),
                        "met": s["goal_met"]})
    return out


def to_json(results: list[Result], summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r, s in zip(results, summaries, strict=True):
        item = asdict(r)
        item["summary"] = s
        out.append(item)
    return out


def _own_numbers(versus: list[tuple[Result, dict[str, Any]]], attr: str, title: str, unit: str) -> list[str]:
    """A line naming the scenarios whose ``attr`` is not the usual one (a fast model's short
    request times the machine's hiccups), or nothing."""
    counts = Counter(getattr(r, attr) for r, _ in versus if not r.error)
    if len(counts) < 2:
        return []
    usual = counts.most_common(1)[0][0]
    odd = [f"scenario {r.number} {r.target} {getattr(r, attr)} {unit}" for r, _ in versus
           if not r.error and getattr(r, attr) != usual]
    return [f"{title} (a fast model's short request times the machine's hiccups): " + ", ".join(odd) +
            f"; the others {usual}.", ""]
