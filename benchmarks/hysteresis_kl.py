"""What delta sync's scale hysteresis costs in mismatch, along a real training trajectory (issue 26).

    OMP_NUM_THREADS=1 python benchmarks/hysteresis_kl.py --traj DIR --points 0,15,20,25,30,35,40

A delta sync keeps a row's int8 scale while its amax stays within ``[(1 - band) * ref, ref]``
(`flashrl.distributed.delta`), so the codes stay on a grid up to `band` coarser than fresh scales
would give, and a frozen grid is what makes rollouts lag a trainer. This replays the trainer's fp32
master weights saved along a real run (``DIR/step-N.safetensors``, N > 0; step 0 is the model's
own checkpoint) into in-process int8 rollout workers, one per band, through the real delta path
(`delta_sync` -> `RolloutWorker.receive`; band 0 is the ``codes`` payload, fresh scales, bit for
bit), and at each point measures every worker against an fp32 engine holding the same master
weights: full-vocabulary KL(fp32 || worker) in fp64 and top-1 agreement at every position of
prompt + response (`flashrl.tools.profile_metrics.distribution_mismatch`), on `--prompts`
calibration prompts with `--tokens` response tokens sampled from the fp32 engine at that point
(temperature 1, EOS ignored). Also per point: the fraction of codes that changed and of scales kept.

The points are checkpoints (every 5 steps of the run), not every step: hysteresis decides at each
point, so a scale can stay frozen over five steps' drift at once, which is if anything harsher
than syncing every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from _common import device_name, format_table, write_json
from bench_delta_sync import loopback
from flashrl.core.sampling import SamplingParams
from flashrl.distributed.delta import DeltaSender, delta_sync
from flashrl.distributed.worker import RolloutWorker
from flashrl.engine import Engine, EngineConfig
from flashrl.model.weights import iter_checkpoint
from flashrl.rl.data import render_prompt
from flashrl.rl.presets import resolve_model
from flashrl.tools.calibration_prompts import CALIBRATION_PROMPTS
from flashrl.tools.profile_metrics import distribution_mismatch


def master_at(model_dir: Path, traj: Path, point: int) -> list[tuple[str, torch.Tensor]]:
    """The trainer's fp32 master weights at `point` (0: the checkpoint itself, upcast)."""
    if point == 0:
        return [(n, t.float()) for n, t in iter_checkpoint(model_dir)]
    return sorted(
        (n, t.float()) for n, t in load_file(str(traj / f"step-{point}.safetensors")).items()
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--traj", required=True, help="directory of step-N.safetensors master weights")
    p.add_argument("--points", default="0,15,20,25,30,35,40")
    p.add_argument("--bands", default="0,0.05,0.2")
    p.add_argument("--quant", default="int8")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/hysteresis_kl.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    base = EngineConfig(device="cpu", max_batch=args.prompts, max_len=512, progress=False, seed=0)
    reference = Engine(model_dir, "bf16", dataclasses.replace(base, dtype="fp32"))
    bands = [float(b) for b in args.bands.split(",")]
    factory = functools.partial(
        Engine, model_dir, args.quant, dataclasses.replace(base, dtype="bf16")
    )
    workers = {b: RolloutWorker(factory, i, args.threads) for i, b in enumerate(bands)}
    senders = {b: DeltaSender(b, full_every=0) for b in bands}
    texts = [render_prompt(reference.tokenizer, t) for t in CALIBRATION_PROMPTS[: args.prompts]]
    prompts = [reference.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rows = []
    for point in (int(x) for x in args.points.split(",")):
        start = time.perf_counter()
        master = master_at(model_dir, Path(args.traj), point)
        reference.update_weights(master)
        params = SamplingParams(
            temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=point
        )
        seqs = [r.prompt_ids + r.response_ids for r in reference.generate(prompts, params)]
        row: dict = {"step": point}
        for band, worker in workers.items():
            out, _ = delta_sync(
                senders[band], master, worker.quantized, loopback(worker, {}), worker.dense
            )
            m = distribution_mismatch(reference, worker.backend, seqs)
            tag = f"b{band:g}"
            row[f"kl_{tag}"], row[f"top1_{tag}"] = m["kl"], m["top1_agreement"]
            row[f"changed_{tag}"] = out["delta_changed_frac"]
            row[f"kept_{tag}"] = out["delta_kept_scales_frac"]
        row["s"] = time.perf_counter() - start
        rows.append(row)
        print(format_table([row], list(row)), flush=True)
    cols = list(rows[0])
    print(format_table(rows, cols))
    result = {
        "args": vars(args),
        "model": str(model_dir),
        "rows": rows,
        "machine": f"shared, noisy 2-core CPU ({device_name(torch.device('cpu'))})",
    }
    print("wrote", write_json(args.out, result))


if __name__ == "__main__":
    main()
