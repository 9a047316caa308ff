"""MoE models in the built-in engine: decode throughput per scheme, re-quantization time of a whole
weight update against a plain copy of the same tensors, and the bytes of the expert weights.

Configs (random weights at the named dimensions, `flashrl.tools.moe_configs`): ``tiny-moe`` (the
`tiny-moe-cpu` preset's model: hidden 128, 4 layers, 8 experts, top-2) and ``mid-moe-bench``
(hidden 1024, 8 layers, 32 experts, top-4), or any name of `flashrl bench --random-weights`.

Columns:
- ``decode_tok_s``: generated tokens per second of decode steps (greedy, `--batch` sequences,
  `--output-len` tokens after a `--prompt-len` prompt; the second of two generate calls);
- ``op_share``: the share of a decode step's wall time spent inside torch ops (torch.profiler self
  CPU time of every op over a few steps / their wall time); 1 - op_share is Python overhead;
- ``expert_gemms``: expert GEMM calls per decode step (quantized: two per expert with tokens per
  MoE layer; unquantized: two grouped GEMMs per MoE layer);
- ``update_s`` / ``requant_s``: `Engine.update_weights` of the whole model (the fused 3-D names a
  `transformers` 5.x trainer sends) / its re-quantization part; ``copy_s``: copying the same
  tensors into preallocated buffers of their dtype (the floor of any in-place update);
- ``expert_mib`` / ``weight_mib``: bytes of the expert weights (codes + scales) / of the model.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py [--configs tiny-moe,mid-moe-bench]
        [--quant bf16,int8,fp8_channel] [--batch 16] [--device cpu] [--out results/moe.json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import profile

from _common import device_name, format_table, time_fn, write_json
from flashrl.engine import Engine, EngineConfig, SamplingParams
from flashrl.model.moe import grouped_mm_available
from flashrl.quant.experts import DenseExperts, QuantExperts
from flashrl.rl.presets import TINY_MOE_MODEL
from flashrl.tools.bench import random_model_dir
from flashrl.tools.moe_configs import MOE_RANDOM_CONFIGS

TINY = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=104, **TINY_MOE_MODEL
)


def model_dir(name: str, root: Path) -> Path:
    if name == "tiny-moe":
        import json

        root.mkdir(parents=True, exist_ok=True)
        raw = dict(TINY, rms_norm_eps=1e-6, hidden_act="silu", bos_token_id=1, eos_token_id=2)
        (root / "config.json").write_text(json.dumps(raw))
        return root
    return random_model_dir(name, root)


def fused_update(engine: Engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A whole random update under the names a transformers 5.x model holds in memory: per-expert
    tensors stacked into ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    moe = engine.model_config.moe
    gate, up, down = moe.expert_names
    per_name = dict(engine.random_weights(seed=seed))
    out = [(n, t) for n, t in per_name.items() if ".experts." not in n]
    for layer in moe.sparse_layers:
        p = f"model.layers.{layer}.{moe.checkpoint_block}.experts."
        experts = range(moe.num_experts)
        gate_up = [torch.cat([per_name[f"{p}{e}.{gate}.weight"], per_name[f"{p}{e}.{up}.weight"]])
                   for e in experts]  # fmt: skip
        hf = f"model.layers.{layer}.mlp.experts."
        out.append((hf + "gate_up_proj", torch.stack(gate_up)))
        out.append(
            (hf + "down_proj", torch.stack([per_name[f"{p}{e}.{down}.weight"] for e in experts]))
        )
    return out


def expert_gemms_per_step(engine: Engine, batch: int) -> int:
    """Expert GEMM calls of one decode step: two grouped GEMMs per MoE layer for unquantized
    experts (`grouped_mm_available`), else two per expert with tokens."""
    blocks = engine.model.moe_blocks()
    probe = torch.empty(0, dtype=engine.dtype, device=engine.device)
    if isinstance(blocks[0].experts.gate_up_proj, DenseExperts) and grouped_mm_available(probe):
        return 2 * len(blocks)
    counts = []
    engine.model.set_routing_observer(lambda i, ids: counts.append(ids[:batch].unique().numel()))
    cache = engine.runner.ensure_cache()
    engine.decode(cache, list(range(5, 5 + batch)), [8] * batch)
    engine.model.set_routing_observer(None)
    return 2 * sum(counts)


def op_share(engine: Engine, batch: int, steps: int = 4) -> float:
    """Share of decode-step wall time inside torch ops (see the module docstring)."""
    cache = engine.runner.ensure_cache()
    tokens, positions = list(range(5, 5 + batch)), [8] * batch
    engine.decode(cache, tokens, positions)
    with profile() as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.decode(cache, tokens, positions)
        wall = time.perf_counter() - start
    inside = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    return inside / wall


def bench_one(name: str, scheme: str, args: argparse.Namespace, root: Path) -> dict:
    path = model_dir(name, root / name)
    device = torch.device(args.device)
    max_len = args.prompt_len + args.output_len
    engine_config = EngineConfig(
        dtype="bf16",
        device=device,
        progress=False,
        load_weights=False,
        max_batch=args.batch,
        max_len=max_len,
    )
    engine = Engine(path, rollout_config=scheme, engine_config=engine_config)
    engine.init_random_weights_()
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.batch)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine.generate(prompts, params)
    before = engine.stats()
    engine.generate(prompts, params)
    after = engine.stats()
    tokens = after["generated_tokens"] - before["generated_tokens"] - args.batch  # minus prefill
    decode_s = after["decode_s"] - before["decode_s"]
    update = fused_update(engine, seed=1)
    result = engine.update_weights(update)
    buffers = [torch.empty_like(t) for _, t in update]
    copy_s = time_fn(lambda: [b.copy_(t) for b, (_, t) in zip(buffers, update)], device, 1, 3)
    experts = [m for m in engine.model.modules() if isinstance(m, QuantExperts | DenseExperts)]
    return dict(
        config=name,
        scheme=scheme,
        batch=args.batch,
        decode_tok_s=tokens / decode_s,
        op_share=op_share(engine, args.batch),
        expert_gemms=expert_gemms_per_step(engine, args.batch),
        update_s=result["weight_update_s"],
        requant_s=result["requantize_s"],
        copy_s=copy_s,
        requant_vs_copy=result["requantize_s"] / copy_s,
        expert_mib=sum(m.nbytes() for m in experts) / 2**20,
        weight_mib=engine.weight_nbytes() / 2**20,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default="tiny-moe,mid-moe-bench")
    parser.add_argument("--quant", default="bf16,int8,fp8_channel")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="results/moe.json")
    args = parser.parse_args()
    names = [c for c in args.configs.split(",") if c]
    for name in names:
        if name != "tiny-moe" and name not in MOE_RANDOM_CONFIGS:
            raise SystemExit(
                f"--configs: {name!r} is not tiny-moe or {', '.join(MOE_RANDOM_CONFIGS)}"
            )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for scheme in args.quant.split(","):
                rows.append(bench_one(name, scheme, args, Path(tmp)))
                print(format_table([rows[-1]], list(rows[-1])), flush=True)
    print(format_table(rows, list(rows[0])))
    print(f"device: {device_name(torch.device(args.device))}")
    if args.out:
        out = write_json(Path(__file__).parent / args.out, dict(args=vars(args), rows=rows))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
