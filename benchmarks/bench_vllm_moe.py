"""flashrl's quantized MoE experts inside vLLM-CPU: decode throughput and weight-sync time.

A random Qwen3-MoE checkpoint (``--preset``: ``tiny`` = the test model, 8 experts of 48, hidden
128, 3 layers; ``mid`` = 32 experts of 256, top-4, hidden 512, 4 layers) is saved locally with the
character tokenizer (nothing is downloaded) and loaded by in-process engines: ``bf16`` (vLLM's own
CPU MoE kernel) and ``flashrl_<scheme>`` (flashrl's reference expert GEMMs on CPU, see
docs/vllm.md). Per row: ``tok_s`` = generated tokens / ``LLM.generate`` wall time (``--batch``
prompts of 16 random ids, ``--output-len`` tokens, T = 1, EOS ignored; median of ``--repeats``
after a warm-up), then `WeightUpdater.update_weights` of the checkpoint's state dict (median of ``--repeats``):
``requant_s`` (quantizing, every layer), ``transfer_s`` (loading, the rest) and ``copy_s``
(``copy_`` of every tensor into a preallocated buffer: the floor of any sync). ``expert_mb``: bytes
of the expert tensors in the engine (codes and scales, or bf16).

    OMP_NUM_THREADS=1 python benchmarks/bench_vllm_moe.py --preset mid --json benchmarks/results/vllm_moe_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import format_table, write_json

PRESETS = {
    "tiny": dict(),
    "mid": dict(
        hidden_size=512,
        moe_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=4,
        mlp_only_layers=[],
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=32,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    parser.add_argument("--rows", default="bf16,int8,fp8_channel")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm

    from flashrl.vllm_backend import WeightUpdater, engine_kwargs
    from flashrl.vllm_backend.testing import load_state_dict, save_tiny_moe_model

    root = Path(tempfile.mkdtemp(prefix="bench-vllm-moe-"))
    path = save_tiny_moe_model(root / args.preset, family="qwen3_moe", **PRESETS[args.preset])
    state = load_state_dict(path)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (16,), generator=gen).tolist()}]
    prompts = prompts * args.batch
    results = []
    for row in args.rows.split(","):
        kwargs = engine_kwargs(row)
        results.append(
            {"row": row, **measure(vllm, kwargs, WeightUpdater, path, state, prompts, args)}
        )
    print(format_table(results, list(results[0])))
    if args.json:
        write_json(args.json, {"preset": args.preset, "args": vars(args), "results": results})


def measure(
    vllm: Any, kwargs: dict, WeightUpdater: Any, path: Path, state: dict, prompts: list, args: Any
) -> dict[str, float]:
    """One row: decode tokens/s, WeightUpdater update split, copy floor, expert bytes."""
    import torch

    params = vllm.SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    llm = vllm.LLM(
        str(path), dtype="bfloat16", max_model_len=128, max_num_seqs=args.batch, seed=0, **kwargs
    )
    model = llm.apply_model(lambda m: m)[0]
    expert_bytes = sum(
        t.numel() * t.element_size()
        for n, t in model.named_parameters()
        if ".experts." in n and "shared" not in n
    )
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    walls = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
    sync = WeightUpdater(llm)
    updates = [sync.update_weights(state.items()) for _ in range(args.repeats)]
    buffers = {n: torch.empty_like(t) for n, t in state.items()}
    copies = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for name, tensor in state.items():
            buffers[name].copy_(tensor)
        copies.append(time.perf_counter() - start)
    llm.llm_engine.engine_core.shutdown()
    return {
        "tok_s": args.batch * args.output_len / statistics.median(walls),
        "requant_s": statistics.median(p["requantize_s"] for p in updates),
        "transfer_s": statistics.median(p["transfer_s"] for p in updates),
        "copy_s": statistics.median(copies),
        "expert_mb": expert_bytes / 2**20,
        "layers_requantized": updates[-1]["layers_requantized"],
    }


if __name__ == "__main__":
    main()
