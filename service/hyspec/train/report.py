"""docs/models.md's tables, from a manifest.json written by ``hyspec train``."""

from __future__ import annotations

import math
from typing import Any


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(manifest: dict[str, Any]) -> str:
    """The models, their loss curves, the checks and samples as markdown tables."""
    models = manifest["models"]
    wall = manifest["wall_seconds"]
    out = ["| model | file | parameters | multiply-adds / token | blocks (attention at) | n_embd / n_ff | heads (kv) "
           "| steps x windows x tokens | held-out ppl | sha256 |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in models:
        s, sch = m["shape"], m["schedule"]
        out.append(_row([
            m["name"], f"`{m['file']}`", f"{m['params']:,}", f"{m['macs_per_token']:,}",
            f"{s['n_layer']} ({', '.join(map(str, s['attn_layers']))})", f"{s['n_embd']} / {s['n_ff']}",
            f"{s['n_head']} ({s['n_head_kv']})", f"{sch['steps']} x {sch['batch']} x {manifest['seq_len']}",
            f"{m['held_out_ppl']:.2f}", f"`{m['sha256']}`",
        ]))
    out += ["", "Loss curves (cross-entropy in nats per token; held-out: a quarter of the held-out windows):", ""]
    for m in models:
        out += [f"**{m['name']}**", "", "| step | training tokens | train loss (since previous row) | held-out loss "
                "| held-out ppl | minutes |", "| --- | --- | --- | --- | --- | --- |"]
        for p in m["curve"]:
            train = "" if p["train_loss"] is None else f"{p['train_loss']:.3f}"
            out.append(_row([p["step"], f"{p['tokens']:,}", train, f"{p['held_out_loss']:.3f}",
                             f"{math.exp(p['held_out_loss']):.1f}", f"{p['seconds'] / 60:.1f}"]))
        out.append("")
    agree, accept = manifest["agreement_held_out_text"], manifest["acceptance_llama_cpp"]
    out += [
        "| check | result |",
        "| --- | --- |",
        _row(["draft's greedy token = target's, held-out text (PyTorch)",
              f"{agree['agree']:.3f} of {agree['positions']:,} positions"]),
        _row([f"greedy acceptance, draft of up to {accept['draft_max']} along the target's greedy text "
              f"({accept['prompts']} held-out prompts, llama.cpp, Q8_0)",
              f"{accept['acceptance']:.3f} accepted / drafted; per-token agreement {accept['agree']:.3f} "
              f"({accept['positions']:,} positions)"]),
    ]
    for m in models:
        for dtype, d in m["logits_vs_torch"].items():
            out.append(_row([f"{m['name']}: llama.cpp {dtype} vs PyTorch logits ({d['positions']} positions)",
                             f"max abs {d['max_abs']:.2e} (relative to the largest logit {d['max_rel']:.1e}); "
                             f"argmax agrees at {d['argmax_agree']:.3f}"]))
    tok = manifest["tokenizer"]
    out += [
        _row(["llama.cpp tokenization vs the trainer's BPE, every held-out chapter",
              f"{tok['held_out_mismatches']} mismatches"]),
        _row(["wall time (data, target, draft, evaluation + export + checks)",
              f"{wall['total'] / 60:.1f} min ({wall['data']:.0f} + {wall['target']:.0f} + {wall['draft']:.0f} + "
              f"{wall['evaluate_export_verify']:.0f} s); CPU {wall.get('cpu_total', float('nan')) / 60:.1f} min "
              f"on {manifest['threads']} threads"]),
        "",
        "Greedy continuations by llama.cpp (Q8_0) of the first words of held-out verses:",
        "",
        "| prompt | target | draft |",
        "| --- | --- | --- |",
    ]
    for s in manifest["samples"]:
        cells = [s["prompt"], s["target"], s["draft"]]
        out.append(_row([c.replace("\n", " / ").replace("|", "\\|").strip() for c in cells]))
    return "\n".join(out) + "\n"
