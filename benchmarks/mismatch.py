"""Rollout/trainer mismatch on a real model, per scheme, KV-cache dtype and response length.

    python benchmarks/mismatch.py                       # SmolLM2-135M, 5 schemes x {bf16, fp8} KV, 64 and 256 tokens
    python benchmarks/mismatch.py --quant int8 --kv bf16 --lengths 64,256,1024 --prompts 8 --threads 1
    python benchmarks/mismatch.py --quant int8,int8+sq0.5,int8_g64 --kv bf16 --out results/mismatch_levers.json

A variant is a scheme name, optionally with ``+sqA``: online smoothing with exponent A
(``rollout.smooth``), calibrated by a short generate on other prompts (the next `--prompts`
calibration prompts) before the measured one, as a training run calibrates on the previous step.

The reference is the trainer's precision: an fp32 engine on the same checkpoint (bf16 values, held
exactly). Each (scheme, KV dtype) engine generates once, temperature 1, EOS ignored, up to the
longest length, from the chat-templated calibration prompts (`flashrl.tools.calibration_prompts`);
each length L is then measured on the first L response tokens of the same samples:

- ``kl``, ``k3_kl``: `flashrl.correction.mismatch_metrics` of the sampled logprobs against the fp32
  engine's rescoring (what `flashrl train` logs as rollout_corr/kl and k3_kl);
- ``max_abs_dlogp``: the largest |sampled logprob - fp32 logprob| of one token;
- ``exact_kl``, ``top1``: full-vocabulary KL(fp32 || engine) in fp64 and top-1 agreement at every
  position of prompt + first L response tokens, no KV cache
  (`flashrl.tools.profile_metrics.distribution_mismatch`);
- ``tokens_per_s``: decode throughput of that generation (noisy on a shared machine).

Rows are written to the JSON after each (scheme, KV) pair and pairs already there are skipped, so
an interrupted run continues; a figure of k3 KL against length per scheme goes next to it (k3: the
k1 mean can be negative on a finite sample).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from _common import device_name, format_table, write_json
from flashrl.core.config import RolloutConfig
from flashrl.core.sampling import SamplingParams
from flashrl.correction import mismatch_metrics
from flashrl.engine import Engine, EngineConfig
from flashrl.rl.data import render_prompt
from flashrl.rl.presets import resolve_model
from flashrl.tools.calibration_prompts import CALIBRATION_PROMPTS
from flashrl.tools.profile_metrics import distribution_mismatch

COLUMNS = ["scheme", "kv", "length", "kl", "k3_kl", "max_abs_dlogp", "exact_kl", "top1",
           "tokens_per_s"]  # fmt: skip


def prompts_for(engine: Engine, count: int) -> list[list[int]]:
    texts = [render_prompt(engine.tokenizer, t) for t in CALIBRATION_PROMPTS[:count]]
    return [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def measure(engine: Engine, reference: Engine, prompts, lengths, seed) -> list[dict]:
    params = SamplingParams(temperature=1.0, max_tokens=max(lengths), ignore_eos=True, seed=seed)
    start = time.perf_counter()
    rollouts = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.response_ids) for r in rollouts)
    scored = [reference.score(r.prompt_ids, r.response_ids) for r in rollouts]
    rows = []
    for length in lengths:
        lp_roll = torch.tensor([r.logprobs[:length] for r in rollouts])
        lp_ref = torch.tensor([s[:length] for s in scored])
        mask = torch.ones_like(lp_roll, dtype=torch.bool)
        m = mismatch_metrics(lp_ref, lp_roll, mask)
        exact = distribution_mismatch(
            reference, engine, [r.prompt_ids + r.response_ids[:length] for r in rollouts]
        )
        rows.append({
            "length": length, "kl": m["kl"], "k3_kl": m["k3_kl"],
            "max_abs_dlogp": float((lp_roll - lp_ref).abs().max()),
            "exact_kl": exact["kl"], "top1": exact["top1_agreement"],
            "tokens_per_s": tokens / elapsed,
        })  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure (pip install 'flashrl[plot]')")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["scheme"], r["kv"]) for r in rows}):
        pts = sorted((r["length"], r["k3_kl"]) for r in rows if (r["scheme"], r["kv"]) == key)
        ax.plot(*zip(*pts), marker="o", label=f"{key[0]} / KV {key[1]}")
    ax.set(xscale="log", yscale="log", xlabel="response tokens", ylabel="sampled k3 KL to fp32")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--quant", default="bf16,int8,fp8,fp8_channel,fp8_block")
    parser.add_argument("--kv", default="bf16,fp8")
    parser.add_argument("--lengths", default="64,256")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="results/mismatch_smollm2.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = sorted(int(n) for n in args.lengths.split(","))
    model_dir = resolve_model(args.model)
    out = Path(args.out)
    done = json.loads(out.read_text())["rows"] if out.exists() else []
    max_len = 128 + max(lengths)
    reference = Engine(
        model_dir, "bf16", EngineConfig(dtype="fp32", max_len=max_len, progress=False)
    )
    prompts = prompts_for(reference, args.prompts)
    for scheme in args.quant.split(","):
        for kv in args.kv.split(","):
            if any(r["scheme"] == scheme and r["kv"] == kv for r in done):
                continue
            name, _, sq = scheme.partition("+sq")
            config = RolloutConfig(quant=name, kv_cache_dtype=kv, smooth=float(sq) if sq else None)
            engine_config = EngineConfig(dtype="bf16", max_len=max_len, progress=False)
            engine = Engine(model_dir, config, engine_config)
            if config.smooth is not None:
                other = prompts_for(reference, 2 * args.prompts)[args.prompts :]
                engine.generate(other, SamplingParams(max_tokens=16, seed=args.seed + 1))
            for row in measure(engine, reference, prompts, lengths, args.seed):
                done.append({"scheme": scheme, "kv": kv, **row})
            payload = {
                "device": device_name(torch.device("cpu")),
                "model": args.model,
                "prompts": len(prompts),
                "threads": torch.get_num_threads(),
                "rows": done,
            }
            write_json(out, payload)  # fmt: skip
            print(f"{scheme} / KV {kv}: done", flush=True)
    print(format_table(done, COLUMNS))
    plot(done, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
