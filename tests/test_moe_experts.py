"""Quantized MoE experts: `QuantExperts` against `QuantLinear` (bit-exact per expert), and
`Engine.update_weights` of expert tensors against a fresh engine loaded from the new checkpoint.

Every comparison here is exact (raw bytes of every parameter and buffer, or `torch.equal`): the
same quantizer runs on the same slices, so there is no tolerance to state.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from flashrl.engine import Engine
from flashrl.errors import WeightError
from flashrl.model.weights import iter_checkpoint
from flashrl.quant import gemm
from flashrl.quant.experts import DenseExperts, QuantExperts, make_experts
from flashrl.quant.linear import QuantLinear, make_linear
from flashrl.testing import MOE_FAMILIES
from shorthand import build_engine

SCHEMES = ["bf16", "int8", "fp8", "fp8_channel", "fp8_block", "int8_g128", "int8_g64"]
QUANT_SCHEMES = SCHEMES[1:]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def engine(path, **kwargs):
    kwargs.setdefault("dtype", "fp32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("progress", False)
    kwargs.setdefault("max_len", 64)
    return build_engine(path, **kwargs)


def snapshot(e: Engine) -> dict[str, torch.Tensor]:
    """Raw bytes of every weight, code, scale and norm (not the RoPE tables, sized by max_len)."""
    tensors = dict(e.model.named_parameters(remove_duplicate=False))
    tensors |= dict(e.model.named_buffers(remove_duplicate=False))
    return {n: raw(t).clone() for n, t in tensors.items() if not n.startswith("rotary.")}


def assert_same(a: Engine, b: Engine) -> None:
    sa, sb = snapshot(a), snapshot(b)
    assert sa.keys() == sb.keys()
    differ = [name for name in sa if not torch.equal(sa[name], sb[name])]
    assert not differ, f"differ from a fresh engine: {differ[:5]}"


def pointers(e: Engine) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in [*e.model.named_buffers(), *e.model.named_parameters()]}


def write_checkpoint(path, tensors: dict[str, torch.Tensor], like) -> str:
    """A checkpoint directory holding `tensors` with the config of checkpoint `like`."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(like / "config.json", path / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def perturbed(base, path, seed: int):
    """A transformers model of `base` with every weight perturbed, saved to `path`."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    hf.save_pretrained(path)
    return hf, path


# ------------------------------------------------------------------ QuantExperts vs QuantLinear


@pytest.mark.parametrize("scheme", QUANT_SCHEMES)
def test_quant_experts_bit_identical_to_quant_linear(scheme, gen):
    """Expert e of a stacked gate/up (two shards, partial 128-blocks) holds the codes and scales a
    `QuantLinear` with the same shards gets from expert e's weight, and computes the same output;
    per-expert and per-shard updates give the same bytes as one fused [E, 2I, H] update."""
    experts, hidden, inter = 3, 160, 72
    w = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05
    w[1, :inter] *= 30  # experts and shards with very different ranges
    stacked = QuantExperts(experts, hidden, 2 * inter, scheme, (inter, inter), torch.float32)
    stacked.requantize_(w)
    x = torch.randn(5, hidden, generator=gen)
    for e in range(experts):
        ref = QuantLinear(
            hidden, 2 * inter, scheme, shard_sizes=(inter, inter), dtype=torch.float32
        )
        ref.requantize_(w[e])
        assert torch.equal(raw(stacked.weight[e]), raw(ref.weight))
        assert torch.equal(stacked.weight_scale[e], ref.weight_scale)
        if ref.row_scale is not None:
            assert torch.equal(stacked.row_scale[e], ref.row_scale)
        assert torch.equal(stacked.linear(x, e), ref(x))
        assert torch.equal(stacked.dequantized_weight(e), ref.dequantized_weight())
    pieces = QuantExperts(experts, hidden, 2 * inter, scheme, (inter, inter), torch.float32)
    for e in reversed(range(experts)):
        pieces.requantize_(w[e, inter:], expert=e, shard=1)
        pieces.requantize_(w[e, :inter], expert=e, shard=0)
    assert torch.equal(raw(pieces.weight), raw(stacked.weight))
    assert torch.equal(pieces.weight_scale, stacked.weight_scale)
    changed = pieces.requantize_(w[:, inter:].flip(-1), shard=1, count_changed=True)
    assert 0 < changed <= experts * inter * hidden
    assert torch.equal(raw(pieces.weight[:, :inter]), raw(stacked.weight[:, :inter]))


def test_dense_experts_and_argument_errors(gen):
    dense = make_experts(2, 8, 6, "bf16", (3, 3), torch.float32)
    assert isinstance(dense, DenseExperts)
    w = torch.randn(2, 6, 8, generator=gen)
    dense.requantize_(w)
    ref = make_linear(8, 6, "bf16", dtype=torch.float32)
    ref.requantize_(w[1])
    x = torch.randn(4, 8, generator=gen)
    assert torch.equal(dense.linear(x, 1), ref(x))
    stacked = make_experts(2, 8, 6, "int8", (3, 3), torch.float32)
    with pytest.raises(Exception, match="expected"):
        stacked.requantize_(torch.zeros(2, 3, 8), shard=None)
    with pytest.raises(Exception, match="expert 2 out of range"):
        stacked.requantize_(torch.zeros(3, 8), expert=2, shard=0)
    bad = torch.randn(3, 8)
    bad[1, 1] = float("nan")
    with pytest.raises(Exception, match="non-finite"):
        stacked.requantize_(bad, expert=0, shard=1)


# ------------------------------------------------------------------ Engine.update_weights


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """Per family: (base checkpoint, perturbed transformers model, perturbed checkpoint)."""
    from flashrl.testing import save_tiny_model

    out = {}
    for family in MOE_FAMILIES:
        root = tmp_path_factory.mktemp(f"moe-{family}")
        base = save_tiny_model(root / "base", family, seed=1)
        hf, path = perturbed(base, root / "new", seed=2)
        out[family] = (base, hf, path)
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("names", ["fused", "per_expert"])
def test_expert_update_equals_fresh_engine(scheme, family, names, moe_pair):
    """A whole update, shuffled, by the trainer's in-memory names (`named_parameters()`, fused 3-D
    experts) or by the checkpoint's per-expert names, equals a fresh engine of the new checkpoint;
    no storage moves."""
    base, hf, new = moe_pair[family]
    e = engine(base, rollout_config=scheme)
    before = pointers(e)
    if names == "fused":
        items = list(hf.named_parameters())
        assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in items)
    else:
        items = list(iter_checkpoint(new))
        assert any(".experts.3." in n for n, _ in items)
    random.Random(0).shuffle(items)
    result = e.update_weights(items, count_changed=True)
    assert pointers(e) == before, "storage moved during update_weights"
    assert_same(e, engine(new, rollout_config=scheme))
    if scheme != "bf16":
        assert 0 < result["codes_changed_frac"] <= 1


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_partial_and_single_expert_updates(scheme, family, moe_pair, tmp_path):
    """One expert's gate alone, another expert's up and down in separate calls, the router, and a
    fused down_proj of one layer: equal to a fresh engine of the checkpoint holding exactly those
    new tensors."""
    base, hf, new = moe_pair[family]
    old = dict(iter_checkpoint(base))
    fresh = dict(iter_checkpoint(new))
    c = engine(base).model_config.moe
    block = f"model.layers.{c.sparse_layers[-1]}.{c.checkpoint_block}."
    gate, up, down = c.expert_names
    single = [
        [(f"{block}experts.5.{gate}.weight", fresh[f"{block}experts.5.{gate}.weight"])],
        [(f"{block}experts.2.{up}.weight", fresh[f"{block}experts.2.{up}.weight"])],
        [(f"{block}experts.2.{down}.weight", fresh[f"{block}experts.2.{down}.weight"])],
        [(f"{block}gate.weight", fresh[f"{block}gate.weight"])],
    ]
    layer0 = c.sparse_layers[0]
    fused_name = f"model.layers.{layer0}.mlp.experts.down_proj"
    fused = dict(hf.named_parameters())[fused_name].detach()
    expected = dict(old)
    for call in single:
        expected.update(call)
    prefix0 = f"model.layers.{layer0}.{c.checkpoint_block}.experts."
    for i in range(c.num_experts):
        expected[f"{prefix0}{i}.{down}.weight"] = fresh[f"{prefix0}{i}.{down}.weight"]
    assert torch.equal(expected[f"{prefix0}3.{down}.weight"], fused[3])  # the fused layout
    want = engine(write_checkpoint(tmp_path / "expected", expected, base), rollout_config=scheme)
    e = engine(base, rollout_config=scheme)
    for call in reversed(single):
        e.update_weights(call)
    e.update_weights([(fused_name, fused)])
    assert_same(e, want)


@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8_block"])
def test_bad_expert_updates_leave_engine_unchanged(scheme, moe_pair):
    """A NaN in one expert (per-expert or fused), a wrong fused shape, an expert index beyond E:
    a `WeightError` naming the tensor, and every engine byte unchanged (valid tensors came first)."""
    base, hf, _ = moe_pair["qwen3_moe"]
    e = engine(base, rollout_config=scheme)
    before = snapshot(e)
    params = dict(hf.named_parameters())
    good = [(n, params[n].detach()) for n in ("model.layers.0.mlp.experts.gate_up_proj",)]
    nan_fused = params["model.layers.2.mlp.experts.down_proj"].detach().clone()
    nan_fused[4, 7, 3] = float("nan")
    nan_one = torch.randn(48, 64)
    nan_one[0, 0] = float("inf")
    cases = [
        ("model.layers.2.mlp.experts.down_proj", nan_fused, "non-finite"),
        ("model.layers.0.mlp.experts.7.up_proj.weight", nan_one, "non-finite"),
        ("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 48, 64), "shape"),
        ("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(48, 64), "unexpected"),
        ("model.layers.1.mlp.experts.0.up_proj.weight", torch.zeros(48, 64), "unexpected"),
    ]
    for name, tensor, message in cases:
        with pytest.raises(WeightError, match=message) as err:
            e.update_weights([*good, (name, tensor)])
        assert name in str(err.value)
        after = snapshot(e)
        assert all(torch.equal(before[k], after[k]) for k in before), name


def test_moe_checkpoint_missing_expert_is_refused(moe_pair, tmp_path):
    base = moe_pair["mixtral"][0]
    tensors = dict(iter_checkpoint(base))
    del tensors["model.layers.1.block_sparse_moe.experts.6.w3.weight"]
    with pytest.raises(Exception, match="experts.6.w3"):
        engine(write_checkpoint(tmp_path / "broken", tensors, base))
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_grouped_experts_equal_per_expert_linear(scheme, gen):
    """`grouped_experts` (per-token schemes quantize each projection's input once for all experts)
    gives the bits of running every expert's `linear` on its rows, then weighting and summing; the
    bf16 scheme's grouped GEMMs agree to bf16 rounding (measured: equal on this CPU)."""
    from flashrl.model.moe import grouped_experts

    e, h, i, tokens, k = 6, 64, 40, 19, 2
    gate_up = make_experts(e, h, 2 * i, scheme, (i, i), torch.bfloat16)
    down = make_experts(e, i, h, scheme, None, torch.bfloat16)
    gate_up.requantize_(torch.randn(e, 2 * i, h, generator=gen) * 0.1)
    down.requantize_(torch.randn(e, h, i, generator=gen) * 0.1)
    x = torch.randn(tokens, h, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen).bfloat16()
    got = grouped_experts(x, ids, weights, gate_up, down)
    order = torch.argsort(ids.reshape(-1), stable=True)
    xs, sorted_ids = x[order // k], ids.reshape(-1)[order]
    out = torch.empty(tokens * k, h, dtype=x.dtype)
    for expert in sorted_ids.unique().tolist():
        rows = (sorted_ids == expert).nonzero()[:, 0]
        g, u = gate_up.linear(xs[rows], expert).split(i, dim=-1)
        out[rows] = down.linear(torch.nn.functional.silu(g) * u, expert)
    weighted = torch.empty_like(out)
    weighted[order] = out * weights.reshape(-1)[order, None]
    want = weighted.view(tokens, k, h).sum(1)
    if scheme == "bf16":  # grouped_mm vs per-expert GEMMs: kernels may sum in another order
        assert (got.float() - want.float()).abs().max() <= 0.01 * want.abs().max()
    else:
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", QUANT_SCHEMES)
def test_cuda_experts_equal_cpu_and_logits_follow(scheme, moe_pair):
    """On CUDA (Triton quantizer, `_int_mm` / `_scaled_mm`): expert codes and scales equal the CPU
    ones bit for bit, and the engine's fp32 logits stay within 0.1 of the CPU engine's (GEMM
    kernels differ; unmeasured on GPU so far)."""
    base = moe_pair["qwen3_moe"][0]
    cpu = engine(base, rollout_config=scheme)
    cuda = engine(base, rollout_config=scheme, device="cuda")
    for name, t in cpu.model.named_buffers():
        if ".experts." in name:
            assert torch.equal(raw(t), raw(dict(cuda.model.named_buffers())[name].cpu())), name
    ids = list(range(5, 40))
    assert (cpu.logits(ids) - cuda.logits(ids).cpu()).abs().max() < 0.1


@pytest.mark.parametrize("scheme", ["fp8", "fp8_channel"])
def test_fp8_expert_gemms_get_16_byte_aligned_scales(scheme, moe_pair, monkeypatch):
    """cuBLASLt's fp8 GEMM refuses scales that do not start on a 16-byte boundary (the MoE CUDA
    test failed so on an H100 and an H200); an expert's scale, or some tokens' rows of a per-token
    scale, are slices that can start anywhere, so every `_scaled_mm` must get aligned ones."""
    from flashrl.quant import dispatch

    for kind, cuda_gemm in (("fp8_tensorwise", gemm.fp8_tensorwise_cuda),
                            ("fp8_rowwise", gemm.fp8_rowwise_cuda)):  # fmt: skip
        monkeypatch.setitem(dispatch.GEMMS, (kind, "cpu"), cuda_gemm)  # the CUDA calls, on CPU
    seen, real = [], torch._scaled_mm

    def recording(a, b, scale_a, scale_b, **kw):
        seen.append((scale_a.data_ptr() % 16, scale_b.data_ptr() % 16))
        return real(a, b, scale_a, scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    e = engine(moe_pair["qwen3_moe"][0], rollout_config=scheme)
    e.logits(list(range(5, 40)))
    assert len(seen) > 10 and all(offsets == (0, 0) for offsets in seen), seen
