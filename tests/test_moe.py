"""MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral) in the built-in engine against `transformers` 5.x, on
tiny random checkpoints saved with `save_pretrained` and loaded through the real loader.

Tolerances: fp32 engine logits equal transformers' to 1e-4 absolute (measured <= 3e-7: the same
ops, GEMMs grouped by expert in another order); bf16 logits to 0.1 absolute (bf16 rounding through
three layers, plus the rare expert that a bf16 near-tie routes differently; measured about 0.03).
Routing at fp32: the engine's top-k ids equal transformers' on every token whose k-th and (k+1)-th
router probabilities differ by more than 1e-5 (a closer tie may flip with summation order).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from flashrl.engine import SamplingParams
from flashrl.errors import ConfigError
from flashrl.model.config import ModelConfig
from flashrl.testing import MOE_FAMILIES
from shorthand import build_engine


def hf_model(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def engine(path, **kwargs):
    kwargs.setdefault("dtype", "fp32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("progress", False)
    return build_engine(path, **kwargs)


def random_ids(length, gen, vocab=256):
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def test_tiny_moe_configs_parse(tiny_models):
    """Which layers are sparse, and the routing rule, as transformers builds them."""
    q3 = ModelConfig.from_model_dir(tiny_models("qwen3_moe")).moe
    assert q3.sparse_layers == (0, 2) and q3.norm_topk_prob and q3.weights_in_router_dtype
    q2 = ModelConfig.from_model_dir(tiny_models("qwen2_moe")).moe
    assert q2.shared_expert_intermediate_size == 96 and not q2.norm_topk_prob
    mx = ModelConfig.from_model_dir(tiny_models("mixtral")).moe
    assert mx.checkpoint_block == "block_sparse_moe" and not mx.weights_in_router_dtype
    for family in MOE_FAMILIES:
        hf = hf_model(tiny_models(family))
        sparse = tuple(
            i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")
        )
        assert sparse == ModelConfig.from_model_dir(tiny_models(family)).moe.sparse_layers


def test_moe_config_errors():
    base = dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_experts=4,
        moe_intermediate_size=16,
    )
    with pytest.raises(ConfigError, match="num_experts_per_tok=8"):
        ModelConfig.from_dict({**base, "num_experts_per_tok": 8})
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        ModelConfig.from_dict({**base, "num_experts_per_tok": 2, "mlp_only_layers": "1"})
    sparse = ModelConfig.from_dict({**base, "num_experts_per_tok": 2, "decoder_sparse_step": 2})
    assert sparse.moe.sparse_layers == (1,)


VARIANTS = [(f, {}) for f in MOE_FAMILIES] + [
    ("mixtral", {"sliding_window": 8}),
    ("qwen2_moe", {"decoder_sparse_step": 2, "qkv_bias": False, "norm_topk_prob": True}),
    ("qwen3_moe", {"num_experts_per_tok": 3, "norm_topk_prob": False, "mlp_only_layers": []}),
]


@pytest.mark.parametrize(
    "family,overrides", VARIANTS, ids=lambda v: v if isinstance(v, str) else "-".join(v) or "base"
)
def test_moe_logits_match_transformers(family, overrides, tiny_models, gen):
    path = tiny_models(family, **overrides)
    ids = torch.tensor([random_ids(40, gen)])
    with torch.no_grad():
        ref32 = hf_model(path)(ids).logits[0]
        ref16 = hf_model(path, torch.bfloat16)(ids).logits[0].float()
    assert (engine(path).logits(ids[0]) - ref32).abs().max() < 1e-4
    assert (engine(path, dtype="bf16").logits(ids[0]) - ref16).abs().max() < 0.1


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_routing_matches_transformers(family, tiny_models, gen):
    """The top-k expert ids of every MoE layer and token equal transformers' at fp32."""
    path = tiny_models(family)
    hf, eng = hf_model(path), engine(path)
    ids = torch.tensor([random_ids(64, gen)])
    ref, probs = {}, {}
    hooks = []
    for i, layer in enumerate(x for x in hf.model.layers if hasattr(x.mlp, "experts")):

        def hook(module, args, output, i=i):
            ref[i] = output[2]
            probs[i] = torch.softmax(output[0].float(), -1).sort(-1, descending=True).values

        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        hf(ids)
    got = {}
    eng.model.set_routing_observer(lambda index, top: got.__setitem__(index, top.clone()))
    eng.logits(ids[0])
    k = eng.model_config.moe.top_k
    assert sorted(got) == sorted(ref) and len(got) >= 2
    for i in ref:
        clear = (probs[i][:, k - 1] - probs[i][:, k]) > 1e-5
        assert clear.float().mean() > 0.9
        assert torch.equal(got[i][clear], ref[i][clear])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_greedy_generation_equals_transformers(family, tiny_models, gen):
    path = tiny_models(family)
    hf = hf_model(path)
    prompts = [random_ids(n, gen) for n in (3, 11, 7)]
    outs = engine(path, max_batch=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out.response_ids == ref


def test_skip_keeps_experts_in_high_precision(tiny_models, gen):
    """``skip=("*.experts",)``: experts stay unquantized (the router always is), attention is
    quantized; logits then differ from the bf16 engine only through attention."""
    from flashrl.quant.experts import DenseExperts, QuantExperts
    from flashrl.quant.linear import DenseLinear, QuantLinear

    path = tiny_models("qwen2_moe")
    e = engine(path, rollout_config="int8", skip=("*.experts",))
    block = e.model.layers[0].mlp
    assert isinstance(block.experts.gate_up_proj, DenseExperts)
    assert isinstance(block.gate, DenseLinear) and isinstance(block.shared_expert_gate, DenseLinear)
    assert isinstance(block.shared_expert.gate_up_proj, QuantLinear)
    assert isinstance(e.model.layers[0].self_attn.qkv_proj, QuantLinear)
    quantized = engine(path, rollout_config="int8").model.layers[0].mlp.experts.down_proj
    assert isinstance(quantized, QuantExperts)


def test_moe_decode_compile_is_refused_with_a_clear_message(tiny_models):
    e = engine(tiny_models("qwen3_moe"), decode_compile="default", max_len=64)
    with pytest.raises(Exception, match="decode_compile=None"):
        e.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_skipping_one_expert_tensor_keeps_that_layers_experts_dense(family, tiny_models):
    """As for a fused layer: a skip entry naming one expert's tensor (what `flashrl profile` and
    `flashrl setup` write) keeps all experts of that layer in high precision, and only that layer."""
    from flashrl.quant.experts import DenseExperts, QuantExperts

    path = tiny_models(family)
    e0 = engine(path)
    moe = e0.model_config.moe
    first, last = moe.sparse_layers[0], moe.sparse_layers[-1]
    name = f"model.layers.{first}.mlp.experts.3.down_proj"
    e = engine(path, rollout_config="int8", skip=(name,))
    assert isinstance(e.model.layers[first].mlp.experts.gate_up_proj, DenseExperts)
    assert isinstance(e.model.layers[last].mlp.experts.gate_up_proj, QuantExperts)
