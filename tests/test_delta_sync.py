"""Quantized delta sync (``rollout.workers.payload=delta``, issue 26 item 2): scale hysteresis, (index,
code) pairs, checksums and repairs. Most tests run the trainer's `DeltaSender` against in-process
`RolloutWorker`s through a loopback (the same `receive` a Ray actor runs, minus the gloo bytes);
one runs a real pool over gloo."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from distributed_fixtures import ray_instance  # noqa: F401 (fixture)
from flashrl.core.config import RolloutConfig
from flashrl.distributed.delta import (
    DeltaSender,
    _words_checksum,
    checksum,
    delta_update,
    hysteresis_scales,
    quantize_with_scales,
)
from flashrl.distributed.dense_delta import apply_values_, diff_values
from flashrl.distributed.worker import RolloutWorker
from flashrl.engine.engine import Engine, EngineConfig
from flashrl.errors import ConfigError, WeightError
from flashrl.model.weights import iter_checkpoint
from flashrl.quant.dispatch import quantize_weight
from flashrl.quant.encode import encode_codes, qmax_of
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.quant.schemes import get_scheme
from flashrl.testing import save_tiny_model

SCHEMES = ("int8", "fp8", "fp8_channel")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def python_checksum(t: torch.Tensor) -> tuple[int, int]:
    """The checksum's definition in plain Python: little-endian int64 words (zero-padded), blocks
    of 512 words, (sum, block-index-weighted sum), both modulo 2**64 as signed ints."""
    data = bytes(bits(t).tolist())
    data += bytes(-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data), 8)]
    blocks = [sum(words[i : i + 512]) for i in range(0, len(words), 512)]
    mod = 2**64

    def signed(v: int) -> int:
        v %= mod
        return v - mod if v >= 2**63 else v

    return signed(sum(blocks)), signed(sum((j + 1) * b for j, b in enumerate(blocks)))


def test_checksum_is_its_python_definition_and_sees_one_changed_code():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (700, 13), dtype=torch.int8, generator=g)
    for t in (codes, codes[1:], codes[3:5], torch.rand(7, 1, generator=g)):  # tails, odd offsets
        assert _words_checksum(t) == python_checksum(t)
    scale = torch.rand(700, 1, generator=g)
    base = checksum(codes, scale)
    for i in (0, 4095, 4096, codes.numel() - 1):
        flipped = codes.clone()
        flipped.view(-1)[i] += 1 if flipped.view(-1)[i] < 127 else -1
        assert checksum(flipped, scale) != base, i
    nudged = scale.clone()
    nudged[5] = torch.nextafter(nudged[5], torch.tensor(2.0))
    assert checksum(codes, nudged) != base
    moved = torch.cat([codes.view(-1)[4096:8192], codes.view(-1)[:4096], codes.view(-1)[8192:]])
    assert checksum(moved.view(700, 13), scale)[:2] != base[:2]  # same bytes, other blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_band_zero_is_the_codes_payload_bit_for_bit(scheme, dtype):
    """Fresh scales and band 0 give quantize_weight's codes and scales at every step, on a tensor
    of several quantization chunks."""
    s = get_scheme(scheme)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(600, 520, generator=g).to(dtype)
    scale, ref = None, None
    for _ in range(6):
        scale, ref, _ = hysteresis_scales(w, s, scale, ref, band=0.0)
        codes = quantize_with_scales(w, scale, s.code_dtype)
        expected, expected_scale = quantize_weight(w, s)
        assert torch.equal(scale, expected_scale)
        assert torch.equal(bits(codes), bits(expected))
        w = w + 1e-2 * torch.randn(w.shape, generator=g).sign().to(dtype)
        w[::7] *= 0.98  # some rows shrink: band 0 must still refresh them


@pytest.mark.parametrize("scheme", ("int8", "fp8_channel"))
def test_hysteresis_keeps_scales_in_band_refreshes_outside_and_never_clips(scheme):
    s = get_scheme(scheme)
    qmax = qmax_of(s.code_dtype)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5, 300, generator=g)
    scale, ref, kept = hysteresis_scales(w, s, None, None, band=0.05)
    assert not kept.any()
    factors = torch.tensor([1.0, 0.97, 0.9, 1.001, 0.9501])  # per row: amax ratio to the old one
    w2 = w * factors[:, None]
    scale2, ref2, kept2 = hysteresis_scales(w2, s, scale, ref, band=0.05)
    assert kept2.squeeze(1).tolist() == [True, True, False, False, True]
    fresh = quantize_weight(w2, s)[1]
    for row, keep in enumerate(kept2.squeeze(1).tolist()):
        want = scale[row] if keep else fresh[row]
        assert torch.equal(scale2[row], want), row
        assert torch.equal(ref2[row], ref[row] if keep else w2[row].abs().amax().reshape(1))
    codes = quantize_with_scales(w2, scale2, s.code_dtype)
    assert (w2 / scale2).abs().max() <= qmax * (1 + 1e-6)  # never above the old amax: no clipping
    reference = encode_codes(w2 / scale2, s.code_dtype, torch.empty_like(codes))
    assert torch.equal(bits(codes), bits(reference))  # x / s, rounded and clamped as always
    # the band is measured from the amax of the last fresh scale, not from the last step's amax:
    # rows 1 and 4 drift out of it in two small steps
    w3 = w2 * torch.tensor([0.96, 0.97, 1.0, 1.0, 0.99])[:, None]
    _, _, kept3 = hysteresis_scales(w3, s, scale2, ref2, band=0.05)
    assert kept3.squeeze(1).tolist() == [True, False, True, True, False]


def test_diff_and_apply_reproduce_the_new_codes():
    g = torch.Generator().manual_seed(3)
    old = torch.randint(-127, 128, (64, 48), dtype=torch.int8, generator=g)
    new = old.clone()
    new.view(-1)[torch.randperm(old.numel(), generator=g)[:50]] = 3
    index, changed = diff_values(old, new)
    assert index.dtype == torch.int32 and index.numel() == int((old != new).sum())
    target = old.clone()
    apply_values_(target, index, changed)
    assert torch.equal(target, new)
    with pytest.raises(WeightError, match="outside"):
        apply_values_(target, torch.tensor([old.numel()], dtype=torch.int32), changed[:1])


# ------------------------------------------------------------------ in-process workers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("delta") / "m", "qwen2", tokenizer=True)


def engine_factory(path, quant="int8"):
    engine_config = EngineConfig(
        dtype="fp32", device="cpu", max_batch=2, max_len=16, progress=False
    )
    return functools.partial(Engine, path, quant, engine_config)


class Replay:
    """A worker's end of a loopback: hands it the tensors the trainer just 'sent'."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def receive(self, metas, sink) -> float:
        assert len(metas) == len(self.tensors)
        for meta, t in zip(metas, self.tensors, strict=True):
            assert meta.shape == tuple(t.shape) and meta.dtype == str(t.dtype)[6:]
            sink(meta, t)
        return 0.0


def loopback(worker: RolloutWorker, corrupt=None):
    """A `delta.Send` to one in-process worker; `corrupt(metas, tensors)` may edit the wire."""

    def send(metas, tensors):
        wire = [t.clone() for t in tensors]
        if corrupt is not None:
            corrupt(metas, wire)
        worker.broadcast = Replay(wire)
        sent = {"sent_bytes": float(sum(t.numel() * t.element_size() for t in wire)), "send_s": 0.0}
        return sent, [worker.receive(metas, checksums=True)]

    return send


def adam_like_step(named, g, lr, bump=False):
    """Every weight moves by +-lr x its RMS (the size of an Adam step); with `bump`, the first
    row of about one 2-D weight in five grows by 10% (its amax leaves the band upwards)."""
    out = []
    for name, t in named:
        t = t + lr * t.pow(2).mean().sqrt() * torch.randn(t.shape, generator=g).sign()
        if bump and t.dim() == 2 and torch.rand((), generator=g) < 0.2:
            t[0] *= 1.1
        out.append((name, t))
    return out


def quantized_state(worker):
    return {k: v for k, v in worker.state().items() if k.endswith(("weight", "weight_scale"))}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), k


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_fifty_delta_steps_equal_a_full_sync_with_the_same_scales(tiny, quant):
    """Over 52 Adam-like steps, a worker fed deltas stores exactly the codes and scales of a worker
    fed every code each step (same hysteresis), and those are x / s of the trainer's weights."""
    named = [(n, t.float()) for n, t in iter_checkpoint(tiny)]
    delta_worker = RolloutWorker(engine_factory(tiny, quant), 0)
    full_worker = RolloutWorker(engine_factory(tiny, quant), 1)
    quantized = delta_worker.quantized
    assert len(quantized) >= 8
    delta, full = DeltaSender(band=0.05, full_every=20), DeltaSender(band=0.05, full_every=1)
    g = torch.Generator().manual_seed(4)
    fractions, ratios = [], []
    for step in range(52):
        if step:
            named = adam_like_step(named, g, lr=1e-3, bump=step in (10, 30, 45))
        out, _ = delta_update(delta, named, quantized, loopback(delta_worker))
        ref, _ = delta_update(full, named, quantized, loopback(full_worker))
        assert out["delta_repaired"] == 0 and out["delta_full"] == float(step % 20 == 0)
        assert_same_state(quantized_state(delta_worker), quantized_state(full_worker))
        fractions.append(out["delta_changed_frac"])
        ratios.append(out["sent_bytes"] / ref["sent_bytes"])
        if step % 10 == 3:  # the codes are the reference encoding of the trainer's weights
            state, weights = quantized_state(delta_worker), dict(named)
            m = delta.mirrors["model.layers.1.mlp.down_proj.weight"]
            assert torch.equal(
                state["layers.1.mlp.down_proj.weight_scale"].reshape(m.scale.shape), m.scale
            )
            w = weights["model.layers.1.mlp.down_proj.weight"]
            expected = encode_codes(w / m.scale, m.codes.dtype, torch.empty_like(m.codes))
            assert torch.equal(bits(state["layers.1.mlp.down_proj.weight"]), bits(expected))
    deltas = [r for i, r in enumerate(ratios) if i % 20]
    assert 0 < min(fractions[1:20]) and max(fractions[1:10]) < 0.2  # codes change, few of them
    assert max(deltas) < 1.0 and ratios[0] == 1.0 and ratios[20] == 1.0


def test_a_corrupted_delta_is_detected_and_repaired(tiny, caplog):
    named = [(n, t.float()) for n, t in iter_checkpoint(tiny)]
    worker = RolloutWorker(engine_factory(tiny), 0)
    reference = RolloutWorker(engine_factory(tiny), 1)
    sender, full = DeltaSender(band=0.05, full_every=0), DeltaSender(band=0.05, full_every=1)

    def flip_a_code(metas, wire):
        for meta, t in zip(metas, wire, strict=True):
            if meta.kind == "changed" and t.numel():
                t[0] = 5 if t[0] != 5 else 6
                return

    g = torch.Generator().manual_seed(5)
    delta_update(sender, named, worker.quantized, loopback(worker))
    delta_update(full, named, worker.quantized, loopback(reference))
    named = adam_like_step(named, g, lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="flashrl.distributed.delta"):
        out, _ = delta_update(sender, named, worker.quantized, loopback(worker, flip_a_code))
    delta_update(full, named, worker.quantized, loopback(reference))
    assert out["delta_repaired"] == 1 and out["delta_full"] == 0
    assert "checksum mismatch" in caplog.text and "resending them whole" in caplog.text
    assert_same_state(quantized_state(worker), quantized_state(reference))
    # the receiver's stored codes changed behind the sync's back: found at the next sync
    layer = worker.backend.weights.modules["layers.0.self_attn.qkv_proj"]
    layer.weight[70, 3] = -layer.weight[70, 3] + 1
    caplog.clear()
    named = adam_like_step(named, g, lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="flashrl.distributed.delta"):
        out, _ = delta_update(sender, named, worker.quantized, loopback(worker))
    delta_update(full, named, worker.quantized, loopback(reference))
    assert out["delta_repaired"] == 1 and "'model.layers.0.self_attn.k_proj.weight'" in caplog.text
    assert_same_state(quantized_state(worker), quantized_state(reference))


def test_a_repair_that_fails_again_stops_the_run(tiny):
    named = [(n, t.float()) for n, t in iter_checkpoint(tiny)]
    worker = RolloutWorker(engine_factory(tiny), 0)
    sender = DeltaSender(band=0.05, full_every=0)
    delta_update(sender, named, worker.quantized, loopback(worker))

    def always(metas, wire):
        for meta, t in zip(metas, wire, strict=True):
            if meta.kind == "scale":
                t.mul_(2)

    named = adam_like_step(named, torch.Generator().manual_seed(6), lr=1e-3)
    with pytest.raises(WeightError, match="still differ after a full resend"):
        delta_update(sender, named, worker.quantized, loopback(worker, always))
    assert sender.needs_full  # an unconfirmed sync makes the next one full


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"band": 1.0},
            r"rollout.workers.delta_scale_band=1.0 is invalid; allowed: a number >= 0 and < 1",
        ),
        ({"band": -0.1}, r"delta_scale_band=-0.1"),
        (
            {"full_every": -1},
            r"rollout.workers.delta_full_every=-1 is invalid; allowed: an integer >= 0",
        ),
    ],
)
def test_sender_settings_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DeltaSender(**kwargs)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"rollout.workers.payload": "xor"}, "allowed: stream, codes, delta"),
        (
            {"rollout.workers.delta_scale_band": 1.5},
            r"rollout.workers.delta_scale_band=1.5 is out of range; allowed: a number",
        ),
        (
            {"rollout.workers.delta_scale_band": float("nan")},
            r"rollout.workers.delta_scale_band=nan is not a number",
        ),
        (
            {"rollout.workers.delta_full_every": -2},
            r"rollout.workers.delta_full_every=-2 is invalid",
        ),
        (  # the trainer rounds the codes to nearest: stochastic sync rounding would be lost
            {
                "rollout.sync_rounding": "stochastic",
                "rollout.workers.count": "1",
                "rollout.workers.payload": "delta",
            },
            "rollout.workers.payload=delta sends codes the trainer rounds",
        ),
    ],
)
def test_config_errors_name_the_delta_field(overrides, match):
    from flashrl.rl.config_build import build_config

    with pytest.raises(ConfigError, match=match):
        build_config("tiny-cpu", None, overrides)


# ------------------------------------------------------------------ over gloo, on Ray


@pytest.mark.ray
@pytest.mark.usefixtures("ray_instance")
def test_gloo_delta_sync_band_zero_matches_an_in_process_update(tiny, caplog):
    """band 0 over a real pool: after every step each worker stores what an in-process
    `update_weights` stores; deltas carry fewer bytes than codes; a worker whose weights were
    changed outside the sync is repaired at the next one, with a warning."""
    from flashrl.distributed.config import WorkersConfig
    from flashrl.distributed.pool import WorkerPool

    named = [(n, t.float()) for n, t in iter_checkpoint(tiny)]
    reference = engine_factory(tiny)()
    config = WorkersConfig(
        count=2, payload="delta", delta_scale_band=0.0, delta_full_every=3, timeout=120,
        bucket_mb=4099 / 2**20,  # a bucket boundary inside most tensors
    )  # fmt: skip
    pool = WorkerPool(engine_factory(tiny), config)
    quantized = pool.quantized
    g = torch.Generator().manual_seed(7)
    stats = []
    try:
        for step in range(5):
            if step == 4:  # behind the sync's back: the workers load other weights
                pool.call("update_weights", [(n, -t) for n, t in named if "down" in n])
            with caplog.at_level(logging.WARNING, logger="flashrl.distributed.delta"):
                out = pool.update_weights(named)
            reference.update_weights(named)
            stats.append(out)
            expected = reference.model.state_dict()
            for state in pool.call("state"):
                for k, v in expected.items():
                    assert torch.equal(bits(state[k]), bits(v)), (step, k)
            named = adam_like_step(named, g, lr=1e-3)
    finally:
        pool.shutdown()
    assert [s["delta_full"] for s in stats] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert [s["delta_repaired"] for s in stats] == [0, 0, 0, 0, 2]  # two down_proj weights
    assert "checksum mismatch" in caplog.text and "worker(s) [0, 1]" in caplog.text
    full, code_bytes = stats[0]["sent_bytes"], sum(t.numel() for n, t in named if n in quantized)
    assert stats[3]["sent_bytes"] == full  # a full sync: the codes payload's bytes
    assert full - stats[1]["sent_bytes"] > 0.5 * code_bytes  # most code bytes stay home


# ------------------------------------------------------------------------------------ dense deltas


def dense_engine_factory(path, skip=()):
    config = RolloutConfig(quant="int8", skip=tuple(DEFAULT_SKIP) + tuple(skip))
    engine_config = EngineConfig(
        dtype="bf16", device="cpu", max_batch=2, max_len=16, progress=False
    )
    return functools.partial(Engine, path, config, engine_config)


def dense_state(worker):
    """Everything a worker stores unquantized: embeddings, norms, biases, skipped layers."""
    return {k: v for k, v in worker.state().items() if v.dtype.is_floating_point
            and not k.endswith(("weight_scale", "row_scale", "smooth")) and v.dtype.itemsize > 1}  # fmt: skip


QKV0 = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]


@pytest.mark.parametrize("tied", [True, False])
def test_dense_weights_travel_as_deltas_and_store_what_a_full_sync_stores(tmp_path, tied):
    """bf16 workers: the embedding, norms, biases and a skipped (bf16) q/k/v travel as changed
    values after the first sync, and the worker stores bit for bit what a plain update of the
    trainer's fp32 weights stores (nearest rounding), tied embeddings and fused shards included."""
    path = save_tiny_model(tmp_path / "m", "qwen2", tokenizer=True, tie_word_embeddings=tied)
    named = [(n, t.float()) for n, t in iter_checkpoint(path)]
    worker = RolloutWorker(dense_engine_factory(path, QKV0), 0)
    plain = RolloutWorker(dense_engine_factory(path, QKV0), 1)
    assert worker.dense["model.embed_tokens.weight"] == "bfloat16"
    assert worker.dense["model.layers.0.self_attn.q_proj.weight"] == "bfloat16"
    assert "model.layers.1.self_attn.q_proj.weight" not in worker.dense  # quantized
    assert ("lm_head.weight" in worker.dense) == (not tied)
    sender = DeltaSender(band=0.05, full_every=0)
    g = torch.Generator().manual_seed(7)
    seen = []
    for step in range(6):
        if step:
            named = adam_like_step(named, g, lr=3e-4)
        send, metas = loopback(worker), []

        def record(metas_, tensors, send=send, metas=metas):
            metas.extend(metas_)
            return send(metas_, tensors)

        out, _ = delta_update(sender, named, worker.quantized, record, worker.dense)
        plain.update_weights(named)
        assert out["delta_repaired"] == 0
        a, b = dense_state(worker), dense_state(plain)
        assert a.keys() == b.keys() and len(a) >= 10
        for k in a:
            assert torch.equal(bits(a[k]), bits(b[k])), (step, k)
        kinds = {m.kind for m in metas if m.name in worker.dense}
        seen.append((kinds, out["delta_dense_changed_frac"]))
    assert seen[0][0] == {"tensor"} and seen[0][1] == 1.0
    assert all("values" in kinds and frac < 0.5 for kinds, frac in seen[1:]), seen
    embed = next(m for m in metas if m.name == "model.embed_tokens.weight")
    assert embed.kind in ("index", "values")


def test_a_corrupted_dense_delta_is_repaired(tmp_path, caplog):
    path = save_tiny_model(tmp_path / "m", "qwen2", tokenizer=True)
    named = [(n, t.float()) for n, t in iter_checkpoint(path)]
    worker, plain = (RolloutWorker(dense_engine_factory(path), i) for i in (0, 1))
    sender = DeltaSender(band=0.05, full_every=0)
    delta_update(sender, named, worker.quantized, loopback(worker), worker.dense)

    def flip_a_value(metas, wire):
        for meta, t in zip(metas, wire, strict=True):
            if meta.kind == "values" and t.numel():
                t[0] = -t[0] + 1
                return

    named = adam_like_step(named, torch.Generator().manual_seed(8), lr=3e-4)
    with caplog.at_level(logging.WARNING, logger="flashrl.distributed.delta"):
        out, _ = delta_update(
            sender, named, worker.quantized, loopback(worker, flip_a_value), worker.dense
        )
    plain.update_weights(named)
    assert out["delta_repaired"] == 1 and "checksum mismatch" in caplog.text
    a, b = dense_state(worker), dense_state(plain)
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), k


def test_dense_delta_pieces_refuse_what_they_cannot_apply(tiny):
    from flashrl.distributed.dense_delta import apply_values_, diff_values
    from flashrl.distributed.install import validate
    from flashrl.distributed.transport import TensorMeta

    old = torch.tensor([1.0, 2.0, 0.0, 4.0]).bfloat16()
    new = old.clone()
    new[1], new[2] = 3.0, -0.0  # -0.0 == 0.0, but its bits differ: it travels
    index, values = diff_values(old, new)
    assert index.tolist() == [1, 2] and values.tolist() == [3.0, 0.0]
    apply_values_(old, index, values)
    assert torch.equal(bits(old), bits(new))
    with pytest.raises(WeightError, match="outside the 4 values"):
        apply_values_(old, torch.tensor([1, 4]), values)
    with pytest.raises(WeightError, match="has torch.float32 values; stored torch.bfloat16"):
        apply_values_(old, index, values.float())
    worker = RolloutWorker(engine_factory(tiny), 0)
    bad = TensorMeta("model.norm.weight", "values", "bfloat16", (3,))
    with pytest.raises(WeightError, match="expected 1-D float32"):
        validate(worker.backend, [bad], worker.quantized, worker.dense)
    with pytest.raises(WeightError, match="not stored unquantized here"):
        validate(worker.backend, [bad], worker.quantized, {})
