"""Rollout/trainer mismatch of an MoE model with and without routing replay, per rollout scheme.

The `tiny-moe-cpu` preset's model (Qwen3-MoE: 4 layers, 8 experts, top-2; built on first use) rolls
out `--batches` batches of the preset's task (16 prompts x 8 samples, temperature 1, 6 tokens) in a
bf16 engine with each scheme; a fp32 `transformers` trainer recomputes the logprobs with its own
routing and with the engine's routing replayed (`flashrl.rl.routing_replay`). Columns:

- ``k3_kl`` / ``k3_kl_replay``: k3 KL(rollout || trainer) per token (`flashrl.correction` metric);
- ``kl`` / ``kl_replay``: mean log-ratio (rollout - trainer), the k1 estimate;
- ``routing_diff``: share of (token, MoE layer) top-k id sets where the trainer's own routing picks
  other experts than the engine did (what replay removes).

    OMP_NUM_THREADS=1 python benchmarks/bench_moe_replay.py [--quant bf16,int8,fp8] [--batches 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from _common import device_name, format_table, write_json
from flashrl.correction import compute_correction
from flashrl.engine import Engine, EngineConfig, SamplingParams
from flashrl.engine.routing import RoutingBackend
from flashrl.rl.batch import response_logprobs
from flashrl.rl.data import ArithmeticTask
from flashrl.rl.presets import PRESETS, builtin_model_dir
from flashrl.rl.routing_replay import build_batch, moe_routers, replay_routing


def own_routing(model: torch.nn.Module, batch) -> torch.Tensor:
    """The trainer's own top-k ids [N, L, layers, k] over the batch (no replay)."""
    got = []

    def record(module, args, out):
        got.append(out[2])

    hooks = [r.register_forward_hook(record) for r in moe_routers(model)]
    with torch.no_grad():
        response_logprobs(model, batch, PARAMS)
    for h in hooks:
        h.remove()
    n, width = batch.input_ids.shape
    return torch.stack([ids.view(n, width, -1) for ids in got], dim=2)


PRESET = PRESETS["tiny-moe-cpu"]
PARAMS = SamplingParams(
    temperature=1.0, max_tokens=PRESET["algo.max_response_tokens"], n=PRESET["algo.group_size"]
)


def bench_scheme(scheme: str, path: Path, trainer, args) -> dict:
    engine_config = EngineConfig(
        dtype="bf16", device="cpu", progress=False, max_batch=128, max_len=32
    )
    engine = Engine(path, rollout_config=scheme, engine_config=engine_config)
    backend = RoutingBackend(engine)
    task = ArithmeticTask(seed=0, max_operand=PRESET["data.task_max_operand"], ops="+")
    sums: dict[str, float] = {}
    for step in range(args.batches):
        prompts = [engine.tokenizer(ex.prompt)["input_ids"] for ex in task.batch(step, 16)]
        params = SamplingParams(**{**PARAMS.__dict__, "seed": step})
        rollouts = backend.generate(prompts, params)
        batch = build_batch(rollouts, torch.zeros(len(rollouts)), torch.device("cpu"))
        mask = batch.response_mask
        with torch.no_grad():
            plain, _ = response_logprobs(trainer, batch, params)
            with replay_routing(trainer, batch.routed_experts):
                replayed, _ = response_logprobs(trainer, batch, params)
        for suffix, lp in (("", plain), ("_replay", replayed)):
            metrics = compute_correction(lp, batch.rollout_logprobs, mask).metrics
            for key in ("k3_kl", "kl"):
                sums[key + suffix] = sums.get(key + suffix, 0.0) + metrics[key]
        own, recorded = own_routing(trainer, batch), batch.routed_experts
        valid = recorded[..., 0] >= 0
        same = (own.sort(-1).values == recorded.sort(-1).values).all(-1)
        sums["routing_diff"] = sums.get("routing_diff", 0.0) + (~same[valid]).float().mean().item()
    return dict(scheme=scheme, **{k: v / args.batches for k, v in sums.items()})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quant", default="bf16,int8,fp8,fp8_channel,fp8_block")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--out", default="results/moe_replay.json")
    args = parser.parse_args()
    path = builtin_model_dir("builtin:tiny-moe")
    trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = [bench_scheme(s, path, trainer, args) for s in args.quant.split(",")]
    columns = ["scheme", "k3_kl", "k3_kl_replay", "kl", "kl_replay", "routing_diff"]
    print(format_table(rows, columns))
    print(f"model {path}; device: {device_name(torch.device('cpu'))}")
    if args.out:
        print(
            f"wrote {write_json(Path(__file__).parent / args.out, dict(args=vars(args), rows=rows))}"
        )


if __name__ == "__main__":
    main()
