"""The table `flashrl profile` prints: per-layer errors (the worst tensors when there are many),
end-to-end mismatch before and after skipping, and the recommendation per scheme."""

from __future__ import annotations

from typing import Any

from flashrl.utils import format_table

MAX_TABLE_LAYERS = 40
"""The stdout table lists at most this many tensors (the worst); the JSON has all."""


def fmt(value: float | None, digits: int = 3) -> str:
    """A number in `digits` significant digits; "n/a" for None (not measured)."""
    if value is None:
        return "n/a"
    return f"{value:.{digits}g}" if value != 0 else "0"


def _layer_table(doc: dict[str, Any]) -> list[str]:
    schemes, threshold = doc["settings"]["schemes"], doc["settings"]["threshold"]
    layers = doc["layers"]
    if len(layers) > MAX_TABLE_LAYERS:
        worst = sorted(layers, key=lambda e: -max(e["errors"][s]["output_error"] for s in schemes))
        keep = {id(e) for e in worst[:MAX_TABLE_LAYERS]}
        layers = [e for e in layers if id(e) in keep]
        lines = [
            f"per-layer relative errors of the {MAX_TABLE_LAYERS} worst of "
            f"{len(doc['layers'])} tensors (all in the JSON; * = output error above the "
            f"threshold {threshold:g})"
        ]
    else:
        lines = [f"per-layer relative errors (* = output error above the threshold {threshold:g})"]
    rows = []
    for entry in layers:
        row = {
            "layer": entry["name"],
            "shape": "x".join(map(str, entry["shape"])),
            "w amax/rms": f"{entry['weight_amax_ratio']:.1f}",
        }
        for s in schemes:
            e = entry["errors"][s]
            row[f"{s} weight"] = fmt(e["weight_error"])
            flag = " *" if e["output_error"] > threshold else ""
            row[f"{s} output"] = fmt(e["output_error"]) + flag
        rows.append(row)
    columns = ["layer", "shape", "w amax/rms"] + [
        f"{s} {k}" for s in schemes for k in ("weight", "output")
    ]
    return lines + [format_table(rows, columns)]


def _mismatch_row(
    label: str, mismatch: dict[str, Any], weight_bytes: int | None, bf16_tok_s: float | None = None
) -> dict[str, str]:
    exact, sampled = mismatch.get("exact") or {}, mismatch.get("sampled") or {}
    kv = mismatch.get("kv_cache") or {}
    tok_s = mismatch.get("decode_tok_s")  # absent in older profiles
    return {
        "decode tok/s": f"{tok_s:.1f}" if tok_s else "-",
        "vs bf16": f"{tok_s / bf16_tok_s:.2f}" if tok_s and bf16_tok_s else "-",
        "config": label,
        "kv kl": fmt(kv.get("kl")) if kv else "-",
        "kl": fmt(exact.get("kl")) if exact else "-",
        "kl max": fmt(exact.get("kl_max")) if exact else "-",
        "probs diff max": fmt(exact.get("rollout_probs_diff_max")) if exact else "-",
        "top1 agree": fmt(exact.get("top1_agreement"), 4) if exact else "-",
        "sampled kl": fmt(sampled.get("kl")) if sampled else "-",
        "sampled k3_kl": fmt(sampled.get("k3_kl")) if sampled else "-",
        "sampled probs diff max": fmt(sampled.get("rollout_probs_diff_max")) if sampled else "-",
        "weights MiB": f"{weight_bytes / 2**20:.2f}" if weight_bytes else "",
    }


def _mismatch_table(doc: dict[str, Any]) -> list[str]:
    schemes, kv = doc["settings"]["schemes"], doc.get("kv_cache")
    first = next(iter(doc["schemes"].values()), None)
    bf16_bytes = first["memory"]["weight_bytes_bf16"] if first else None
    base = doc["baseline"]
    speed = base.get("decode_tok_s")
    rows = [_mismatch_row("bf16 (floor: cached vs no-cache)", base, bf16_bytes, speed)]
    for s in schemes:
        entry = doc["schemes"][s]
        rows.append(_mismatch_row(s, entry["mismatch"], entry["memory"]["weight_bytes"], speed))
        kept = len(entry["recommended_skip"])
        if entry["mismatch_after_skip"] is not None:
            rows.append(
                _mismatch_row(
                    f"{s} + {kept} tensor(s) kept in bf16",
                    entry["mismatch_after_skip"],
                    entry["memory"]["weight_bytes_after_skip"],
                    speed,
                )
            )
        if entry.get("mismatch_after_smooth") is not None:
            label = f"{s}{f' + {kept} in bf16' if kept else ''} + smoothing"
            rows.append(
                _mismatch_row(
                    f"{label} (a = {entry['recommended_smooth']:g})",
                    entry["mismatch_after_smooth"],
                    entry["memory"]["weight_bytes_after_skip"],
                    speed,
                )
            )
    if kv:
        rows.append(_mismatch_row(f"bf16 weights + {kv['dtype']} KV", kv["kv_only"], None))
    columns = ["config", "kl", "kl max", "probs diff max", "top1 agree"] + (["kv kl"] if kv else [])
    lines = [
        "end to end vs the bf16 engine. kl, kl max, probs diff max, top1 agree: weights only, "
        "exact over the full vocabulary at every calibration position",
        "(no-cache forwards); kv kl: the KV cache only, exact, teacher-forced; sampled *: "
        "everything, on the config's own rollouts (what training logs at step 0)",
        format_table(
            rows,
            columns
            + ["sampled kl", "sampled k3_kl", "sampled probs diff max", "weights MiB"]
            + ["decode tok/s", "vs bf16"],
        ),
        "decode tok/s: while the config sampled its calibration responses (one run at the "
        "profile's small batch: a rough cost, not a benchmark)",
    ]
    if kv:
        lines.append(
            f"KV cache {kv['dtype']} (scales: {kv['kv_scale']}): {kv['bytes_per_token']} "
            f"bytes per token, {kv['bytes_per_token_bf16']} in bf16"
        )
    return lines


def _advice(entry: dict[str, Any]) -> str:
    """What the profile recommends for one scheme, and what it tried and rejected."""
    flagged, chosen = entry["flagged"], entry["recommended_skip"]
    if not flagged:
        parts = [f"no layer above the threshold (max output error {entry['output_error_max']:.3g})"]
    elif chosen:
        parts = [f"keep {len(chosen)} tensor(s) in bf16: {', '.join(chosen)} "
                 f"({len(flagged)} flagged layer(s) tried end to end)"]  # fmt: skip
    else:
        parts = [f"{len(flagged)} flagged layer(s) tried end to end; keeping any in bf16 did not "
                 "lower the KL: quantize them all"]  # fmt: skip
    smoothing = entry.get("smoothing")
    if smoothing and smoothing.get("reason"):
        parts.append(f"smoothing not tried ({smoothing['reason']})")
    elif smoothing:
        verdict = "use it" if smoothing["kept"] else "not lower: leave it off"
        parts.append(f"smoothing a = {smoothing['alpha']:g}: KL {fmt(smoothing['kl'])}, {verdict}")
    return "; ".join(parts)


def recommended_mismatch(entry: dict[str, Any]) -> dict[str, Any]:
    """The mismatch of a scheme's recommended config (skip list, then smoothing, when chosen)."""
    return entry.get("mismatch_after_smooth") or entry["mismatch_after_skip"] or entry["mismatch"]


def _ranking(doc: dict[str, Any]) -> str:
    """One line over several profiled schemes: each recommended config by exact KL, with its
    decode speed, so the trade between mismatch and speed is read off one place."""
    base = doc["baseline"].get("decode_tok_s")
    parts = []
    for s in doc["settings"]["schemes"]:
        m = recommended_mismatch(doc["schemes"][s])
        speed = (
            f", {m['decode_tok_s'] / base:.2f}x bf16 decode"
            if m.get("decode_tok_s") and base
            else ""
        )
        parts.append((m["exact"]["kl"], f"{s} (KL {fmt(m['exact']['kl'])}{speed})"))
    return "lowest mismatch first (recommended configs): " + ", ".join(
        text for _, text in sorted(parts)
    )


def format_profile(doc: dict[str, Any]) -> str:
    """The readable summary printed by `flashrl profile`, from the JSON document."""
    model, calibration = doc["model"], doc["calibration"]
    lines = [
        f"model {model['path']} ({model['family']}, {model['num_layers']} layers) on "
        f"{doc['device_name']}; calibration: {calibration['source']}, "
        f"{calibration['num_sequences']} sequences, {calibration['positions']} positions"
    ]
    if calibration.get("note"):
        lines.append(f"note: {calibration['note']}")
    lines += ["", *_layer_table(doc), "", *_mismatch_table(doc), ""]
    for s in doc["settings"]["schemes"]:
        lines.append(f"{s}: {_advice(doc['schemes'][s])}")
    if len(doc["settings"]["schemes"]) > 1:
        lines.append(_ranking(doc))
    return "\n".join(lines)
