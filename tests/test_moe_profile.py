"""`flashrl profile` on an MoE model: one entry per expert tensor with weight and output errors,
routers left out (never quantized), and a skip recommendation that the engine applies."""

from __future__ import annotations

import torch

from flashrl.core.config import RolloutConfig
from flashrl.engine import Engine, EngineConfig
from flashrl.quant.experts import DenseExperts, QuantExperts
from flashrl.quant.linear import QuantLinear
from flashrl.tools.profile import ProfileConfig, run_profile
from flashrl.tools.profile_experts import expert_linear
from flashrl.tools.profile_metrics import recommend_skip


def test_profile_reports_every_expert(tiny_models):
    path = tiny_models("qwen2_moe")
    doc = run_profile(
        ProfileConfig(model=str(path), quant="int8,fp8_block", device="cpu", max_new_tokens=4)
    ).to_dict()
    names = {e["name"] for e in doc["layers"]}
    fp32 = EngineConfig(dtype="fp32", device="cpu", progress=False)
    moe = Engine(path, engine_config=fp32).model_config.moe
    for layer in moe.sparse_layers:
        for e in range(moe.num_experts):
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{leaf}" in names
        assert f"model.layers.{layer}.mlp.gate" not in names
        assert f"model.layers.{layer}.mlp.shared_expert_gate" not in names
        assert f"model.layers.{layer}.mlp.shared_expert.down_proj" in names
    experts = [e for e in doc["layers"] if ".experts." in e["name"]]
    assert all(e["engine_layer"].endswith(".mlp.experts") for e in experts)
    for entry in experts:
        for scheme in ("int8", "fp8_block"):
            err = entry["errors"][scheme]
            assert 0 < err["weight_error"] < 0.1 and 0 < err["output_error"] < 0.2
    # a recommendation flags the layer's experts; the engine then keeps them (only them) in bf16
    flagged = recommend_skip(doc["layers"], "int8", threshold=0.0)
    skip = [n for f in flagged for n in f["names"] if ".experts." in n][:1]
    engine = Engine(path, RolloutConfig(quant="int8", skip=skip), fp32)
    layer = int(skip[0].split(".")[2])
    assert isinstance(engine.model.layers[layer].mlp.experts.down_proj, DenseExperts)
    others = [i for i in moe.sparse_layers if i != layer]
    assert all(
        isinstance(engine.model.layers[i].mlp.experts.down_proj, QuantExperts) for i in others
    )


def test_expert_weight_error_is_the_engines(tiny_models, gen):
    """The profile's per-expert quantization is the engine's: QuantLinear from `expert_linear`
    holds the codes of the engine's QuantExperts for that expert."""
    path = tiny_models("mixtral")
    fp32 = EngineConfig(dtype="fp32", device="cpu", progress=False)
    ref = Engine(path, engine_config=fp32)
    q = Engine(path, rollout_config="fp8", engine_config=fp32)
    dense = ref.model.layers[1].mlp.experts.gate_up_proj
    stacked = q.model.layers[1].mlp.experts.gate_up_proj
    for e in (0, 5):
        linear = QuantLinear.from_linear(expert_linear(dense, e), "fp8", dense.shard_sizes)
        assert torch.equal(linear.weight.view(torch.uint8), stacked.weight[e].view(torch.uint8))
        assert torch.equal(linear.weight_scale, stacked.weight_scale[e])
