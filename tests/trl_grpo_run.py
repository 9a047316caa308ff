"""An unmodified TRL ``GRPOTrainer`` (vLLM colocate mode) on a tiny local model, with a callback that
checks the vLLM engine after every weight sync. Run by tests/test_trl_integration.py in a fresh
process (one vLLM engine per process; ``FLASHRL_CONFIG`` is read when vLLM loads its plugins):

    FLASHRL_CONFIG=int8 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        python tests/trl_grpo_run.py MODEL_DIR OUT.json --steps 3

TRL syncs at the start of each step, before generating (``GRPOTrainer._generate_single_turn``:
``vllm_generation.sync_weights()`` whenever ``global_step`` changed). So the weights the trainer
holds at ``on_step_begin`` are the ones the engine holds at ``on_step_end``. The callback (TRL's
public callback API; nothing in TRL is wrapped) records per step:

- whether every flashrl-quantized vLLM linear layer holds exactly (bit for bit) the codes and
  scales of ``QuantLinear(...).requantize_`` applied to the trainer's weights in the engine dtype
  (fused q/k/v and gate/up with their shard sizes), and whether it still matches the *initial*
  checkpoint's quantization;
- the engine's logprobs of a seeded sample from a fixed prompt against a ``transformers`` model
  holding the trainer's weights, quantized with ``flashrl.quant.quantize_`` in the engine dtype,
  and against the same for the initial weights;
- flashrl's direct-load counters.

The JSON is written even when training fails (``error`` holds the traceback), so the test can say why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

import torch

PROMPT = "12+7="
"""The fixed prompt the engine samples from at the end of every step."""
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
"""vLLM's (Qwen2/Llama) linear layers per decoder layer and the checkpoint tensors each fuses, in order."""


def engine_model(trainer) -> torch.nn.Module:
    """The vLLM model TRL's colocate mode loads weights into (the same path TRL 1.16 uses)."""
    return trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def compare_codes(
    vllm_model, weights: dict[str, torch.Tensor], scheme: str, dtype: torch.dtype
) -> dict[str, Any]:
    """Compare every vLLM linear layer's codes, scales and bias with flashrl's quantization of `weights`."""
    from flashrl.quant.linear import QuantLinear

    layers = vllm_model.model.layers
    mismatched: list[str] = []
    checked = 0
    for i, layer in enumerate(layers):
        for vllm_name, parts in FUSED.items():
            module = layer.get_submodule(vllm_name)
            names = [f"model.layers.{i}.{part}" for part in parts]
            fused = torch.cat([weights[f"{n}.weight"] for n in names]).to(dtype)
            ref = QuantLinear(
                fused.shape[1],
                fused.shape[0],
                scheme,
                shard_sizes=[weights[f"{n}.weight"].shape[0] for n in names],
                dtype=dtype,
            )
            ref.requantize_(fused)
            codes = getattr(module, "weight", None)
            scale = getattr(module, "weight_scale", None)
            ok = (
                codes is not None
                and scale is not None
                and codes.dtype == ref.weight.dtype
                and torch.equal(codes.view(torch.uint8), ref.weight.view(torch.uint8))
                and torch.equal(scale.reshape(ref.weight_scale.shape), ref.weight_scale)
            )
            if f"{names[0]}.bias" in weights:
                bias = torch.cat([weights[f"{n}.bias"] for n in names]).to(dtype)
                ok = ok and module.bias is not None and torch.equal(module.bias, bias)
            checked += 1
            if not ok:
                mismatched.append(f"model.layers.{i}.{vllm_name}")
    return {"checked": checked, "mismatched": mismatched}


def reference_logprobs(
    model_dir: str,
    weights: dict[str, torch.Tensor],
    scheme: str,
    dtype: torch.dtype,
    ids: list[int],
    n_prompt: int,
) -> list[float]:
    """Logprobs of ``ids[n_prompt:]`` under a transformers model holding `weights`, quantized like the engine."""
    import transformers

    from flashrl.quant import quantize_

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    model = model.to(dtype).eval()
    if scheme != "bf16":
        quantize_(model, scheme)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[t - 1, ids[t]]) for t in range(n_prompt, len(ids))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    scheme = os.environ.get("FLASHRL_CONFIG", "bf16")
    result: dict[str, Any] = {"scheme": scheme, "steps": [], "error": None}
    start = time.perf_counter()
    try:
        run(args, scheme, result)
    except Exception:  # reported through the JSON, then the exit code
        result["error"] = traceback.format_exc()
    result["seconds"] = time.perf_counter() - start
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.out)
    return 1 if result["error"] else 0


def run(args: argparse.Namespace, scheme: str, result: dict[str, Any]) -> None:
    import trl
    import vllm
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from vllm import SamplingParams, TokensPrompt

    result["versions"] = {
        "trl": trl.__version__,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
    }

    def reward_alternating(completions: list, **kwargs: Any) -> list[float]:
        """0, 1, 0, 1, ...: the two completions of a group always differ, so every step has a gradient."""
        return [float(i % 2) for i in range(len(completions))]

    class SyncCheck(TrainerCallback):
        def __init__(self) -> None:
            self.trainer = None
            self.initial: dict[str, torch.Tensor] = {}
            self.synced: dict[str, torch.Tensor] = {}

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.initial = snapshot(model)

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            # What TRL pushes into vLLM in this step, before generating (steps_per_generation is 1 here,
            # so TRL generates, and syncs, in every step).
            self.synced = snapshot(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            from flashrl.vllm_backend import direct_load

            llm = self.trainer.vllm_generation.llm
            dtype = llm.llm_engine.model_config.dtype
            vllm_model = engine_model(self.trainer)
            tok = self.trainer.processing_class
            prompt_ids = tok(PROMPT)["input_ids"]
            out = llm.generate(
                [TokensPrompt(prompt_token_ids=prompt_ids)],
                SamplingParams(
                    temperature=1.0,
                    max_tokens=6,
                    logprobs=0,
                    seed=state.global_step,
                    ignore_eos=True,
                ),
                use_tqdm=False,
            )[0].outputs[0]
            ids = prompt_ids + list(out.token_ids)
            engine_lp = [float(step[t].logprob) for step, t in zip(out.logprobs, out.token_ids)]
            ref_now = reference_logprobs(
                model_dir, self.synced, scheme, dtype, ids, len(prompt_ids)
            )
            ref_init = reference_logprobs(
                model_dir, self.initial, scheme, dtype, ids, len(prompt_ids)
            )
            moved = max(float((self.synced[n] - self.initial[n]).abs().max()) for n in self.initial)
            result["steps"].append(
                {
                    "global_step": state.global_step,
                    "engine_dtype": str(dtype),
                    "weights_moved_max": moved,
                    "codes_current": compare_codes(vllm_model, self.synced, scheme, dtype),
                    "codes_initial": compare_codes(vllm_model, self.initial, scheme, dtype),
                    "lp_diff_current": sum(abs(a - b) for a, b in zip(engine_lp, ref_now))
                    / len(engine_lp),
                    "lp_diff_initial": sum(abs(a - b) for a, b in zip(engine_lp, ref_init))
                    / len(engine_lp),
                    "direct_load": direct_load.load_stats(vllm_model),
                }
            )

    model_dir = args.model_dir
    dataset = Dataset.from_dict({"prompt": ["12+7=", "3+4=", "9+9=", "5+1="] * 4})
    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_out"),
        use_vllm=True,
        vllm_mode="colocate",
        use_cpu=True,
        bf16=False,
        max_completion_length=8,
        num_generations=2,
        per_device_train_batch_size=2,
        max_steps=args.steps,
        # Large on purpose: after one step the weights move far beyond quantization and bf16 noise, so
        # "the engine follows the current weights, not the initial ones" is a clear-cut comparison.
        learning_rate=3e-2,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    check = SyncCheck()
    trainer = GRPOTrainer(
        model=args.model_dir,
        reward_funcs=reward_alternating,
        args=config,
        train_dataset=dataset,
        callbacks=[check],
    )
    check.trainer = trainer
    result["quantization"] = trainer.vllm_generation.llm.llm_engine.model_config.quantization
    result["train"] = trainer.train().metrics


if __name__ == "__main__":
    sys.exit(main())
