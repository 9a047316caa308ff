"""Weight transport from the trainer to rollout workers, in vLLM's weight-transfer phases.

`init` once (the process group), then per update: `start` (the trainer checks the update and sends
every worker the list of tensors to expect: names, dtypes, shapes; the workers validate it before a
byte moves), `update` (the bytes, streamed), `finish` (each worker reports its times).

Three payloads, one wire format:

- ``stream``: the trainer's parameters as they are (its dtype); each worker re-quantizes;
- ``codes``: the trainer quantizes each weight a worker would quantize once (the same
  `quant.dispatch.quantize_weight` the engine runs, on the same tensor) and sends codes plus
  fp32 scales; the workers copy them in place. About half the bytes of a bf16 stream for 8-bit
  schemes; the codes a worker ends with are the same bits either way.
- ``delta``: like ``codes`` with scale hysteresis, but only the codes that changed since the last
  update travel, as (index, code) pairs, checked by checksums (`flashrl.distributed.delta`).

The bytes of all tensors of an update form one stream cut into buckets of `bucket_bytes`, each sent
with one `broadcast` from rank 0 (the trainer) to ranks 1..N (the workers). A worker's extra
memory is one bucket plus the tensor being assembled; the trainer's is one bucket (plus, with
``codes``, one tensor's codes). The group is a `torch.distributed` process group made from a TCP
store (gloo on CPU, NCCL on CUDA) that is not the default group, so the trainer ranks of a
data-parallel run keep their own default group (docs/distributed.md).
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from flashrl.distributed.config import PAYLOADS
from flashrl.errors import ConfigError, WeightError
from flashrl.quant.dispatch import quantize_weight
from flashrl.quant.schemes import QuantScheme, get_scheme


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of an update on the wire: the HF `name`, what it is (``tensor``: a high-precision
    weight; ``codes`` / ``scale``: a weight quantized on the trainer; ``index`` / ``changed``: the
    flat positions and new values of the codes a delta changes), its dtype and shape."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for the store of a new group)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def make_group(
    host: str, port: int, rank: int, world_size: int, device: str, timeout_s: float
) -> torch.distributed.ProcessGroup:
    """A process group of `world_size` ranks rendezvousing at ``host:port`` (rank 0 hosts the
    store and blocks until every rank joined): gloo for CPU tensors, NCCL for CUDA tensors."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    if device.startswith("cuda"):
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _broadcast(group: torch.distributed.ProcessGroup, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def check_finite(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """A `WeightError` naming the first tensor with NaN or Inf, before anything is sent (so a
    worker never receives an update it would refuse half way)."""
    for name, t in named:
        # amax / amin propagate NaN and Inf: two reductions, no boolean copy of the tensor
        if t.numel() and not bool(torch.isfinite(torch.stack([t.amax(), t.amin()])).all()):
            raise WeightError(f"tensor {name!r} has NaN or Inf values; nothing was sent")


def codes_scheme(name: str, scheme_name: str, payload: str) -> QuantScheme:
    """The scheme the trainer quantizes weight `name` with for `payload` (codes or delta): a
    `ConfigError` for block-scaled schemes, which travel as a stream."""
    scheme = get_scheme(scheme_name)
    if scheme.weight_granularity not in ("channel", "tensor"):
        raise ConfigError(
            f"rollout.workers.payload={payload} supports per-channel and per-tensor schemes; "
            f"{name!r} uses {scheme.name!r} ({scheme.weight_granularity}): use stream"
        )
    return scheme


def plan(
    named: Sequence[tuple[str, torch.Tensor]], payload: str, quantized: dict[str, str]
) -> list[TensorMeta]:
    """The tensors of one ``stream`` or ``codes`` update, in order (``delta``:
    `delta.DeltaSender.plan`). With ``codes``, each name in `quantized` (HF name -> scheme) is
    sent as its codes and scales; everything else (norms, embeddings kept in high precision,
    biases) as it is. Checks every tensor is finite first (`check_finite`)."""
    if payload not in PAYLOADS:
        raise ConfigError(
            f"rollout.workers.payload={payload!r} is invalid; allowed: {', '.join(PAYLOADS)}"
        )
    assert payload != "delta", "delta updates are planned by delta.DeltaSender"
    check_finite(named)
    out = []
    for name, t in named:
        dtype = str(t.dtype).removeprefix("torch.")
        if payload == "codes" and name in quantized:
            scheme = codes_scheme(name, quantized[name], payload)
            code = str(scheme.code_dtype).removeprefix("torch.")
            scale_shape = (t.shape[0], 1) if scheme.weight_granularity == "channel" else ()
            out.append(TensorMeta(name, "codes", code, tuple(t.shape)))
            out.append(TensorMeta(name, "scale", "float32", scale_shape))
        else:
            out.append(TensorMeta(name, "tensor", dtype, tuple(t.shape)))
    return out


def payload_tensors(
    named: Sequence[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta], quantized: dict
) -> Iterator[torch.Tensor]:
    """The tensors `metas` describes, produced one at a time (a weight is quantized only when its
    turn comes, so the trainer never holds a second copy of the model)."""
    tensors = dict(named)
    codes: dict[str, torch.Tensor] = {}
    for meta in metas:
        t = tensors[meta.name].detach()
        if meta.kind == "tensor":
            yield t
        elif meta.kind == "codes":
            q, s = quantize_weight(t, get_scheme(quantized[meta.name]), name=meta.name)
            codes[meta.name] = s
            yield q
        else:
            yield codes.pop(meta.name).reshape(meta.shape)


class BucketBroadcast:
    """The byte stream of one update over `group`, in buckets of `bucket_bytes` (module doc)."""

    def __init__(
        self, group: torch.distributed.ProcessGroup, device: str, bucket_bytes: int
    ) -> None:
        if bucket_bytes < 1:
            raise ConfigError(f"bucket size {bucket_bytes} bytes must be positive")
        self.group, self.device = group, torch.device(device)
        self.bucket = torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device)

    def send(self, tensors: Iterable[torch.Tensor]) -> dict[str, float]:
        """Rank 0: broadcast every tensor's bytes; returns ``sent_bytes`` and ``send_s``."""
        start, fill, sent = time.perf_counter(), 0, 0
        size = self.bucket.numel()
        for t in tensors:
            data = t.contiguous().reshape(-1).view(torch.uint8)
            offset = 0
            while offset < data.numel():
                n = min(size - fill, data.numel() - offset)
                self.bucket[fill : fill + n].copy_(data[offset : offset + n])
                fill, offset = fill + n, offset + n
                if fill == size:
                    _broadcast(self.group, self.bucket)
                    sent, fill = sent + size, 0
        if fill:
            _broadcast(self.group, self.bucket[:fill])
            sent += fill
        return {"sent_bytes": float(sent), "send_s": time.perf_counter() - start}

    def receive(
        self, metas: Sequence[TensorMeta], sink: Callable[[TensorMeta, torch.Tensor], None]
    ) -> float:
        """Ranks 1..N: receive the stream `metas` describes and hand each tensor to `sink` as soon
        as it is complete; returns the seconds spent in `sink` (re-quantizing / installing)."""
        size, total = self.bucket.numel(), sum(m.nbytes for m in metas)
        pending, sink_s = list(metas), 0.0
        current = torch.empty(pending[0].nbytes if pending else 0, dtype=torch.uint8)
        have = received = 0
        while received < total:
            n = min(size, total - received)
            chunk = self.bucket[:n]
            _broadcast(self.group, chunk)
            received += n
            used = 0
            while used < n:
                take = min(n - used, current.numel() - have)
                current[have : have + take].copy_(chunk[used : used + take])
                have, used = have + take, used + take
                while pending and have == current.numel():
                    meta = pending.pop(0)
                    tensor = current.view(getattr(torch, meta.dtype)).reshape(meta.shape)
                    mark = time.perf_counter()
                    sink(meta, tensor)
                    sink_s += time.perf_counter() - mark
                    current = torch.empty(pending[0].nbytes if pending else 0, dtype=torch.uint8)
                    have = 0
        return sink_s
