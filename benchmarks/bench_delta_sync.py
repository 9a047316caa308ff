"""Quantized delta sync on a real model: how many int8 codes an RL step changes, and the bytes and
time of a delta against bf16 and full codes (issue 26 item 2, `flashrl.distributed.delta`).

    OMP_NUM_THREADS=1 python benchmarks/bench_delta_sync.py                 # SmolLM2-135M, 10 steps
    OMP_NUM_THREADS=1 python benchmarks/bench_delta_sync.py --steps 4 --lr 1e-5 --threads 1

The trainer holds fp32 master weights (the checkpoint's, upcast). Each step moves every weight by
``lr * sign(noise)``, the size of an Adam step at learning rate `lr`, then syncs two in-process
int8 workers (the `RolloutWorker.receive` of a Ray actor, minus the gloo bytes): one with scale
band 0 (fresh scales every step: the ``codes`` payload's bits) and one with band 0.05. The
band-0 worker gets the high-precision tensors (norms, the tied embedding) whole in bf16, as a bf16
trainer sends them; the band-0.05 worker gets them as dense deltas (`flashrl.distributed.
dense_delta`: the fp32 master rounded to the worker's bf16 on the trainer, changed values only).

Per step: the fraction of int8 codes that changed (band 0 / 0.05) and of scales kept, the bytes a
bf16 stream, a full ``codes`` sync and a delta put on the wire (the delta also without its
high-precision tensors: codes and scales only), the trainer's encode time (hysteresis, quantize,
diff, checksum; ``quantize_s`` is plain `quantize_weight` of the same weights, the ``codes``
payload's encode) and the worker's apply time (write pairs and scales, checksum). Every step compares
both workers' codes and scales with the trainer's mirror, bit for bit. Step 0 is the first (full) sync.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from _common import device_name, format_table, write_json
from flashrl.distributed.delta import DeltaSender, delta_update
from flashrl.distributed.dense_delta import bit_view
from flashrl.distributed.install import stored_codes
from flashrl.distributed.worker import RolloutWorker
from flashrl.engine import Engine, EngineConfig
from flashrl.model.weights import iter_checkpoint
from flashrl.quant.dispatch import quantize_weight
from flashrl.quant.schemes import get_scheme
from flashrl.rl.presets import resolve_model


class Replay:
    """A worker's end of an in-process loopback (the tensors the trainer just sent)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def receive(self, metas: list, sink) -> float:
        for meta, t in zip(metas, self.tensors, strict=True):
            sink(meta, t)
        return 0.0


def loopback(worker: RolloutWorker, seen: dict):
    """A `delta.Send` into one in-process worker that records bytes (quantized weights' and the
    rest's apart) and the worker's time."""

    def send(metas, tensors):
        wire = [t.clone() for t in tensors]
        worker.broadcast = Replay(wire)
        sizes = [
            (m.name in worker.quantized, t.numel() * t.element_size()) for m, t in zip(metas, wire)
        ]
        seen["codes_bytes"] = sum(n for quantized, n in sizes if quantized)
        seen["dense_bytes"] = sum(n for quantized, n in sizes if not quantized)
        start = time.perf_counter()
        result = worker.receive(metas, checksums=True)
        seen["apply_s"] = time.perf_counter() - start
        return {"sent_bytes": float(sum(t.numel() * t.element_size() for t in wire))}, [result]

    return send


def payload_bytes(named: list, quantized: dict) -> tuple[int, int]:
    """(bf16 stream bytes, full codes bytes) of `named`: int8 codes + one fp32 scale per row for
    quantized weights, bf16 for everything else."""
    bf16 = sum(2 * t.numel() for _, t in named)
    codes = sum(t.numel() + 4 * t.shape[0] if n in quantized else 2 * t.numel() for n, t in named)
    return bf16, codes


def adam_like(named: list, gen: torch.Generator, lr: float) -> None:
    for _, t in named:
        t.add_(torch.randn(t.shape, generator=gen).sign_().mul_(lr))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--steps", type=int, default=10, help="updates after the first (full) sync")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/delta_update.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    engine_config = EngineConfig(
        dtype="bf16", device="cpu", max_batch=1, max_len=16, progress=False
    )
    factory = functools.partial(Engine, model_dir, "int8", engine_config)
    workers = {band: RolloutWorker(factory, i, args.threads) for i, band in enumerate((0.0, 0.05))}
    quantized = workers[0.0].quantized
    senders = {band: DeltaSender(band, full_every=0) for band in workers}
    master = [(n, t.float()) for n, t in iter_checkpoint(model_dir)]
    bf16_bytes, codes_bytes = payload_bytes(master, quantized)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for step in range(args.steps + 1):
        if step:
            adam_like(master, gen, args.lr)
        named = [(n, t if n in quantized else t.bfloat16()) for n, t in master]
        row: dict = {"step": step}
        for band, worker in workers.items():
            seen: dict = {}
            if band:  # the fp32 master as it is: rounded to the worker's dtypes by the sender
                out, _ = delta_update(
                    senders[band], master, quantized, loopback(worker, seen), worker.dense
                )
            else:
                out, _ = delta_update(senders[band], named, quantized, loopback(worker, seen))
            check_mirror(worker, senders[band])
            tag = "b0" if band == 0 else "b05"
            row[f"changed_{tag}"] = out["delta_changed_frac"]
            if band:
                row["kept_scales"] = out["delta_kept_scales_frac"]
                row["dense_changed"] = out["delta_dense_changed_frac"]
                row["delta_codes_bytes"] = seen["codes_bytes"]
                row["delta_dense_bytes"] = seen["dense_bytes"]
                row["delta_bytes"] = out["sent_bytes"]
                row["encode_s"], row["apply_s"] = out["plan_s"], seen["apply_s"]
            else:
                row["delta_b0_codes_bytes"] = seen["codes_bytes"]
                row["dense_whole_bytes"] = seen["dense_bytes"]
        row["quantize_s"] = quantize_time(named, quantized)
        row["bf16_bytes"], row["codes_bytes"] = bf16_bytes, codes_bytes
        row["codes_over_delta"] = codes_quantized(named, quantized) / row["delta_codes_bytes"]
        rows.append(row)
        print(
            f"step {step}: changed {row['changed_b05']:.5f}, {row['delta_bytes']:.0f} B", flush=True
        )
    cols = ["step", "changed_b0", "changed_b05", "kept_scales", "dense_changed", "bf16_bytes"]
    cols += ["codes_bytes", "delta_bytes", "delta_codes_bytes", "delta_dense_bytes"]
    cols += ["dense_whole_bytes", "codes_over_delta", "encode_s", "apply_s"]
    cols += ["quantize_s"]
    print(format_table(rows, cols))
    n_quantized = sum(t.numel() for n, t in master if n in quantized)
    result = {
        "args": vars(args),
        "model": str(model_dir),
        "params": sum(t.numel() for _, t in master),
        "quantized_params": n_quantized,
        "rows": rows,
        "machine": f"shared, noisy 2-core CPU ({device_name(torch.device('cpu'))})",
    }
    print("wrote", write_json(args.out, result))


def quantize_time(named: list, quantized: dict) -> float:
    """Seconds of `quantize_weight` over every quantized weight: the ``codes`` payload's encode."""
    start = time.perf_counter()
    for n, t in named:
        if n in quantized:
            quantize_weight(t, get_scheme(quantized[n]))
    return time.perf_counter() - start


def codes_quantized(named: list, quantized: dict) -> int:
    """Bytes of the quantized weights' codes and scales in a full sync."""
    return sum(t.numel() + 4 * t.shape[0] for n, t in named if n in quantized)


def check_mirror(worker: RolloutWorker, sender: DeltaSender) -> None:
    """The worker stores exactly the trainer's mirror (codes and scales) for every weight, and
    keeps exactly its dense values."""
    for name, m in sender.mirrors.items():
        codes, scale = stored_codes(worker.backend, name)
        same = torch.equal(codes, m.codes) and torch.equal(scale.reshape(m.scale.shape), m.scale)
        assert same, f"worker differs from the trainer's mirror at {name}"
    for name, d in sender.dense.items():
        kept = worker.dense_mirror[name]
        assert torch.equal(bit_view(kept), bit_view(d.value)), name


if __name__ == "__main__":
    main()
