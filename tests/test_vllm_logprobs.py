"""Cross-engine agreement of rollout logprobs: vLLM's processed logprobs for the sequences it
sampled versus a `transformers` fp32 recomputation (and flashrl's built-in engine) that replays
the same temperature / top-k / top-p (`flashrl.core.sampling.replay_processed_logprobs`).

Two settings:

- fp32 engines: the semantics. vLLM in float32 must agree with the fp32 references to float
  rounding for bf16 (unquantized) and, for int8, with the same model quantized by
  `flashrl.quant.quantize_` (identical weight codes; activation codes can flip where the two
  forwards differ in the last fp32 bits, which moves a logprob by up to ~1e-2 on rare tokens).
- bf16 engines: the usual rollout setting. bf16 activations alone move logprobs by a few 1e-2 on
  this deliberately sharp tiny model (weights ~ N(0, 0.2^2)); int8 adds quantization error.
Tolerances (max and mean |delta logprob| over sampled tokens) are stated in TOLERANCES.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from flashrl.vllm_backend.testing import apply_test_env  # noqa: E402

apply_test_env()  # in-process engines, 1 GiB KV cache, no FLASHRL_CONFIG from the caller

from flashrl.core.sampling import replay_processed_logprobs  # noqa: E402
from flashrl.quant import quantize_  # noqa: E402
from flashrl.vllm_backend import engine_kwargs  # noqa: E402
from flashrl.vllm_backend.testing import save_tiny_vllm_model  # noqa: E402

PROMPTS = ["Hello world", "The quick brown fox", "1+1=", "abc def"]
SAMPLING = {
    "T0.7": dict(temperature=0.7),
    "T0.7_p0.9": dict(temperature=0.7, top_p=0.9),
    "T0.7_k20_p0.9": dict(temperature=0.7, top_k=20, top_p=0.9),
}
TOLERANCES = {
    # (engine dtype, scheme): bounds on |delta logprob| over sampled tokens: max, mean, 98th
    # percentile, and the fraction of sampled tokens outside the reference's replayed support.
    ("float32", "bf16"): dict(max=3e-2, mean=1e-3, q98=1e-4, outside=0.01),
    ("float32", "int8"): dict(max=3e-2, mean=1e-3, q98=1e-4, outside=0.01),
    ("bfloat16", "bf16"): dict(max=0.3, mean=0.05, q98=0.2, outside=0.05),
    ("bfloat16", "int8"): dict(max=0.6, mean=0.1, q98=0.4, outside=0.05),
}
"""Why fp32 has a max above float rounding: top-k/top-p truncation is discontinuous. Where a token
sits on the top-p boundary within fp32 rounding, one engine keeps it and the other drops it, and
every logprob of that step moves by the boundary token's probability (seen: 3e-3). int8 adds rare
activation-code flips (seen: 2e-2 on 1 of 192 tokens). The 98th percentile stays at rounding level."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_vllm_model(
        tmp_path_factory.mktemp("vllm_lp") / "model", family="qwen3", seed=0, initializer_range=0.2
    )


def hf_reference(model_dir, scheme: str, dtype: str):
    """The `transformers` model in fp32; for int8 its linear layers quantized by flashrl from the
    weights the engine holds (rounded to bf16 first when the engine runs in bf16)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if scheme != "bf16":
        if dtype == "bfloat16":
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        quantize_(model, scheme)
    return model


def sampled_sequences(llm, params: dict) -> list[tuple[list[int], list[int], list[float]]]:
    sp = vllm.SamplingParams(n=2, max_tokens=24, seed=11, logprobs=0, ignore_eos=True, **params)
    return [
        (
            list(o.prompt_token_ids),
            list(c.token_ids),
            [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)],
        )
        for o in llm.generate(PROMPTS, sp, use_tqdm=False)
        for c in o.outputs
    ]


def deltas(sequences, reference, params: dict) -> tuple[torch.Tensor, int]:
    """|vLLM - reference| over tokens inside the reference's replayed support, and how many fell outside."""
    diffs, outside = [], 0
    for prompt, response, logprobs in sequences:
        ref = reference(prompt, response, params)
        finite = ref.isfinite()
        outside += int((~finite).sum())
        diffs.append((torch.tensor(logprobs, dtype=torch.float64) - ref.double())[finite].abs())
    return torch.cat(diffs), outside


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_processed_logprobs_match_recomputation(model_dir, scheme, dtype):
    from flashrl.engine import Engine, EngineConfig

    hf = hf_reference(model_dir, scheme, dtype)

    @torch.no_grad()
    def hf_score(prompt, response, params):
        logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        return replay_processed_logprobs(
            logits,
            torch.tensor(response),
            params["temperature"],
            params.get("top_k", 0),
            params.get("top_p", 1.0),
        )

    engine_config = EngineConfig(
        dtype="fp32" if dtype == "float32" else "bf16", device="cpu", progress=False
    )
    builtin = Engine(model_dir, rollout_config=scheme, engine_config=engine_config)

    def builtin_score(prompt, response, params):
        return torch.tensor(builtin.score(prompt, response, **params))

    llm = vllm.LLM(
        str(model_dir),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=128,
        seed=0,
        max_num_seqs=16,
        **engine_kwargs(scheme),
    )
    tol = TOLERANCES[(dtype, scheme)]
    report = []
    try:
        for label, params in SAMPLING.items():
            sequences = sampled_sequences(llm, params)
            tokens = sum(len(r) for _, r, _ in sequences)
            for ref_name, reference in (
                ("transformers_fp32", hf_score),
                ("flashrl_engine", builtin_score),
            ):
                diff, outside = deltas(sequences, reference, params)
                q98 = torch.quantile(diff, 0.98)
                report.append(
                    f"{dtype}/{scheme}/{label} vs {ref_name}: max {diff.max():.2e} mean {diff.mean():.2e} "
                    f"q98 {q98:.2e} outside support {outside}/{tokens}"
                )
                if dtype == "bfloat16" and ref_name == "flashrl_engine":
                    continue  # two different bf16 implementations: reported, bounded by the fp32 comparison
                assert (
                    diff.max() <= tol["max"]
                    and diff.mean() <= tol["mean"]
                    and q98 <= tol["q98"]
                    and outside <= tol["outside"] * tokens
                ), f"{report[-1]}; tolerances {tol}"
    finally:
        print("\n".join(report))
        llm.llm_engine.engine_core.shutdown()
        gc.collect()
