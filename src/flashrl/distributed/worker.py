"""`RolloutWorker`: one rollout backend plus its end of the weight transport (a Ray actor).

The class is plain Python (the pool wraps it with ``ray.remote``), so it also runs in-process in
tests. The backend comes from a picklable zero-argument `factory`, so the worker builds exactly
the backend the single-process trainer would (`flashrl.rl.trainer.make_backend`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flashrl.core.rollout import Rollout, RolloutBackend
from flashrl.core.sampling import SamplingParams
from flashrl.distributed import install
from flashrl.distributed.transport import BucketBroadcast, TensorMeta, make_group
from flashrl.errors import UnsupportedError


class RolloutWorker:
    """Generate shards, receive weights, report stats (see the module doc)."""

    def __init__(self, factory: Callable[[], RolloutBackend], index: int, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.index = index
        self.backend = factory()
        self.is_engine = hasattr(self.backend, "weights")
        self.quantized = install.quantized_names(self.backend) if self.is_engine else {}
        self.dense = install.dense_dtypes(self.backend) if self.is_engine else {}
        self.dense_mirror: dict[str, torch.Tensor] = {}
        """Unquantized weights as last received by a delta update (patched by the next one)."""
        self.broadcast: BucketBroadcast | None = None
        self.totals = dict.fromkeys(
            ("weight_updates", "weight_update_s", "requantize_s", "kv_calibration_s"), 0.0
        )

    def ready(self) -> dict:
        """Who this worker is and which weights it stores quantized (the trainer's plan)."""
        return {
            "index": self.index,
            "pid": os.getpid(),
            "quantized": self.quantized,
            "dense": self.dense,
        }

    def generate(
        self, shards: Sequence[tuple[Sequence[Sequence[int]], SamplingParams]]
    ) -> list[list[Rollout]]:
        """One `generate` call per shard, in order (module doc of `sharding`)."""
        return [self.backend.generate(prompts, params) for prompts, params in shards]

    def join_group(
        self, host: str, port: int, world_size: int, device: str, timeout_s: float, bucket: int
    ) -> int:
        """Join the trainer's weight group as rank ``index + 1``."""
        group = make_group(host, port, self.index + 1, world_size, device, timeout_s)
        self.broadcast = BucketBroadcast(group, device, bucket)
        return self.index

    def receive(self, metas: list[TensorMeta], checksums: bool = False) -> dict[str, Any]:
        """One weight update over the group: validate `metas`, receive and install each tensor, then
        recalibrate fp8 KV scales. Returns seconds (``weight_update_s`` in all, ``requantize_s``
        re-quantizing or, with trainer-quantized codes, writing them, ``kv_calibration_s``) and,
        with `checksums`, ``checksums``: the stored codes' and scales' checksum of every
        quantized weight of the update (a delta update's check, `flashrl.distributed.delta`)."""
        assert self.broadcast is not None, "join_group first"
        start = time.perf_counter()
        if self.is_engine:
            install.validate(self.backend, metas, self.quantized, self.dense)
            mirror = self.dense_mirror if checksums else None  # a delta update keeps the mirror
            sink = install.EngineSink(self.backend, self.dense, mirror)
            requant = self.broadcast.receive(metas, sink)
            kv = self._after_update()
            if checksums:
                names = [m.name for m in metas if m.kind == "scale"]
                sums = install.stored_checksums(self.backend, names)
                dense = [m.name for m in metas if m.kind in ("tensor", "values")]
                sums |= install.mirror_checksums(self.dense_mirror, dense)
                return {**self._record(start, requant, kv), "checksums": sums}
        else:
            if any(m.kind != "tensor" for m in metas):
                raise UnsupportedError(
                    "rollout.workers.payload=codes and delta need the built-in engine; use stream"
                )
            received: list[tuple[str, torch.Tensor]] = []
            self.broadcast.receive(metas, lambda m, t: received.append((m.name, t.clone())))
            out = self.backend.update_weights(received)
            requant, kv = out.get("requantize_s", 0.0), out.get("kv_calibration_s", 0.0)
        return self._record(start, requant, kv)

    def _after_update(self) -> float:
        engine = self.backend
        engine.kv.weights_changed()
        return engine.calibrate_kv() if engine.kv.stale and len(engine.kv.recent) else 0.0

    def _record(self, start: float, requant: float, kv: float) -> dict[str, float]:
        total = time.perf_counter() - start
        out = {"weight_update_s": total, "requantize_s": requant, "kv_calibration_s": kv}
        for key, value in {"weight_updates": 1.0, **out}.items():
            self.totals[key] += value
        return out

    def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """The backend's own `update_weights` (weights through Ray's object store)."""
        return self.backend.update_weights(named)

    def stats(self) -> dict[str, float]:
        """The backend's `stats()` plus this worker's weight-update totals (``worker/...``)."""
        return {**self.backend.stats(), **{f"worker/{k}": v for k, v in self.totals.items()}}

    def state(self) -> dict[str, torch.Tensor]:
        """The engine's weights, codes and scales, and its calibrated fp8 KV scales if any (for
        tests comparing workers bit for bit)."""
        out = {k: v.clone() for k, v in self.backend.model.state_dict().items()}
        scales = self.backend.kv_scales
        if scales is not None:
            out |= {"kv_scales.k": scales.k.clone(), "kv_scales.v": scales.v.clone()}
        return out

    def ping(self) -> int:
        return self.index
