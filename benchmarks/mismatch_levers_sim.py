"""Where int8's mismatch comes from, and what each lever could give: simulated quantization on a real model.

    python benchmarks/mismatch_levers_sim.py                 # SmolLM2-135M, every lever below
    python benchmarks/mismatch_levers_sim.py --variants "W8A8,A8 g64" --threads 1

Every linear layer of an fp32 engine (bf16 weights held exactly; the LM head excepted, as
flashrl keeps it) computes its output from fake-quantized operands in fp32, through a forward hook:
weights int8 per output channel, activations int8 per token or per group of columns, optionally
SmoothQuant-smoothed (factors from per-channel activation maxima on *other* calibration prompts),
with some input channels kept unquantized, or with some layer types left alone. The number is the
full-vocabulary KL(engine || fp32) per position, teacher-forced on responses the fp32 engine
sampled (`flashrl.tools.profile_metrics.distribution_mismatch`, the ``exact_kl`` of
benchmarks/mismatch.py). This isolates the quantization error from bf16 activations and from the
GEMM kernels; the real engine's numbers are benchmarks/mismatch.py's. Writes a table and JSON
(default results/mismatch_levers_sim.json), a variant at a time (rerun skips done variants).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _common import device_name, format_table, write_json
from flashrl.core.sampling import SamplingParams
from flashrl.engine import Engine, EngineConfig
from flashrl.quant.linear import DenseLinear
from flashrl.rl.presets import resolve_model
from flashrl.tools.profile_metrics import distribution_mismatch
from mismatch import prompts_for

VARIANTS = {  # name -> fake-quant settings (w/a: quantize weights/activations; ag: activation group)
    "W8A8": {},
    "W8 only": {"a": False},
    "A8 only": {"w": False},
    "W8A8 g128": {"ag": 128},
    "W8A8 g64": {"ag": 64},
    "W8A8 g32": {"ag": 32},
    "SQ 0.3": {"alpha": 0.3},
    "SQ 0.5": {"alpha": 0.5},
    "SQ 0.7": {"alpha": 0.7},
    "SQ 0.85": {"alpha": 0.85},
    "SQ 0.5 qkv/gate_up only": {"alpha": 0.5, "sq_only": ("qkv_proj", "gate_up_proj")},
    "SQ 0.5 o/down only": {"alpha": 0.5, "sq_only": ("o_proj", "down_proj")},
    "SQ 0.5 g128": {"alpha": 0.5, "ag": 128},
    "SQ 0.5 g64": {"alpha": 0.5, "ag": 64},
    "outliers 8": {"outliers": 8},
    "outliers 32": {"outliers": 32},
    "g64 + outliers 8": {"ag": 64, "outliers": 8},
    "skip down_proj": {"skip": ("down_proj",)},
    "skip qkv_proj": {"skip": ("qkv_proj",)},
    "skip gate_up_proj": {"skip": ("gate_up_proj",)},
    "skip o_proj": {"skip": ("o_proj",)},
}
COLUMNS = ["variant", "exact_kl", "top1", "kl_max"]


def fake_quant(t: torch.Tensor, group: int | None = None, qmax: float = 127.0) -> torch.Tensor:
    """Symmetric int8 round trip per row of the last dim, or per `group` columns (zero-padded)."""
    shape, k = t.shape, t.shape[-1]
    if group:
        pad = (-k) % group
        t = F.pad(t, (0, pad)).reshape(*shape[:-1], (k + pad) // group, group)
    s = t.abs().amax(-1, keepdim=True).clamp_min(1e-10) / qmax
    out = (t / s).round().clamp(-qmax, qmax) * s
    return out.reshape(*shape[:-1], -1)[..., :k]


def simulated_output(module: DenseLinear, x: torch.Tensor, c: dict, act_amax: torch.Tensor):
    w, xf = module.weight.float(), x.float()
    if c.get("alpha") is not None:
        a = c["alpha"]
        s = act_amax.clamp_min(1e-5) ** a / w.abs().amax(0).clamp_min(1e-5) ** (1 - a)
        w, xf = w * s, xf / s
    keep = act_amax.topk(c["outliers"]).indices if c.get("outliers") else None
    if keep is not None:
        xo, wo = xf[..., keep].clone(), w[:, keep].clone()
        xf, w = xf.clone(), w.clone()
        xf[..., keep], w[:, keep] = 0, 0
    if c.get("w", True):
        w = fake_quant(w)
    if c.get("a", True):
        xf = fake_quant(xf, c.get("ag"))
    y = xf @ w.t()
    if keep is not None:
        y = y + xo @ wo.t()
    if module.bias is not None:
        y = y + module.bias.float()
    return y.to(x.dtype)


def install(engine: Engine, settings: dict, amax: dict[str, torch.Tensor]) -> list:
    """Hook every linear layer the variant quantizes (all but the LM head and `skip`); `sq_only`
    limits smoothing to the layers it names."""
    handles = []
    for name, m in engine.model.named_modules():
        skipped = any(p in name for p in settings.get("skip", ()))
        if not isinstance(m, DenseLinear) or name == "lm_head" or skipped:
            continue
        c = {k: v for k, v in settings.items() if k != "sq_only"}
        if "sq_only" in settings and not any(p in name for p in settings["sq_only"]):
            c.pop("alpha", None)
        hook = lambda mod, inp, out, c=c, n=name: simulated_output(mod, inp[0], c, amax[n])  # noqa: E731
        handles.append(m.register_forward_hook(hook))
    return handles


def calibrate(engine: Engine, sequences) -> dict[str, torch.Tensor]:
    """Per-input-channel max|x| of every linear layer over `sequences`."""
    amax: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(mod, inp, out):
            a = inp[0].detach().float().reshape(-1, inp[0].shape[-1]).abs().amax(0)
            amax[name] = torch.maximum(amax[name], a) if name in amax else a

        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in engine.model.named_modules()
               if isinstance(m, DenseLinear)]  # fmt: skip
    for seq in sequences:
        engine.logits(seq)
    for h in handles:
        h.remove()
    return amax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="results/mismatch_levers_sim.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    engine_config = EngineConfig(dtype="fp32", max_len=256, progress=False)
    ref = Engine(model_dir, "bf16", engine_config)
    eng = Engine(model_dir, "bf16", engine_config)
    both = prompts_for(ref, 2 * args.prompts)
    sampled = [
        ref.generate(part, SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=seed))
        for seed, part in enumerate((both[: args.prompts], both[args.prompts :]))
    ]  # fmt: skip
    evaluate, calib = ([r.prompt_ids + r.response_ids for r in rs] for rs in sampled)
    amax = calibrate(eng, calib)
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    for name in (v.strip() for v in args.variants.split(",")):
        if any(r["variant"] == name for r in rows):
            continue
        handles = install(eng, VARIANTS[name], amax)
        start = time.perf_counter()
        m = distribution_mismatch(ref, eng, evaluate)
        for h in handles:
            h.remove()
        rows.append({"variant": name, "exact_kl": m["kl"], "top1": m["top1_agreement"],
                     "kl_max": m["kl_max"], "seconds": time.perf_counter() - start})  # fmt: skip
        payload = {"device": device_name(torch.device("cpu")), "model": args.model,
                   "prompts": args.prompts, "tokens": args.tokens, "rows": rows}  # fmt: skip
        write_json(out, payload)
        print(f"{name}: exact KL {m['kl']:.4f}", flush=True)
    print(format_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
