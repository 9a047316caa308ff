"""Quantized delta update (``rollout.workers.payload=delta``): only the codes that changed cross the wire.

The trainer (`DeltaSender`) keeps a mirror of what every worker stores for each weight the workers
keep quantized: its codes, its fp32 scales and, per scale element, the amax that scale was made
from (`ref_amax`). One update:

1. **Scale hysteresis** (`hysteresis_scales`). A scale element (a row for per-channel schemes such
   as int8 and fp8_channel, the whole tensor for per-tensor fp8) keeps its scale while its new amax
   stays within ``[(1 - band) * ref_amax, ref_amax]``; outside, it gets the fresh scale
   ``max(amax, 1e-10) / qmax`` and `ref_amax` becomes the new amax. Never above `ref_amax`, so no
   value is clipped beyond what a fresh scale clips (``|x| / s <= qmax``); a kept scale keeps the
   row's codes on the same grid, so a small update changes few of them. band 0 keeps a scale only
   when amax equals `ref_amax`, where the fresh scale has the same bits: band 0 *is* the ``codes``
   payload, bit for bit. Block-scaled schemes are refused (as with ``codes``).
2. **Codes** (`quantize_with_scales`): the reference loop of `flashrl.quant.encode`
   (`quantize_chunked`, `encode_codes`) dividing by the given scales, so the codes equal
   `quantize_per_row` / `quantize_per_tensor`'s whenever the scales are equal.
3. **Wire** (`dense_delta.diff_values`): the codes that differ from the mirror, as (flat index, new code) pairs
   (int32 indices, int64 for tensors of 2**31 codes or more), plus the whole scale tensor. A tensor
   whose pairs would outweigh its codes travels whole (kind ``codes``). Every
   ``rollout.workers.delta_full_every``-th update, the first one and every repair send all codes whole; the scales
   follow the same hysteresis, so the result never depends on which updates were full.
4. **Unquantized weights** (`flashrl.distributed.dense_delta`, when the workers report their
   storage dtypes): rounded to that dtype on the trainer; after the first update only the changed
   values travel, as (flat index, value) pairs.
5. **Checksums** (`checksum`): after an update every worker reports a checksum of the codes and scales
   it stores for each weight; the trainer compares them with its mirror's. A mismatch is logged as
   a WARNING and those tensors are sent again whole (`delta_update`); a second mismatch stops the run.

The trainer's extra memory is one byte per quantized parameter (the mirror) plus one tensor's new
codes; a worker's is the received pairs of one tensor. A resumed run starts with fresh scales.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from flashrl.distributed.dense_delta import DenseMirror, diff_values
from flashrl.distributed.transport import TensorMeta, check_finite, codes_scheme
from flashrl.errors import ConfigError, WeightError
from flashrl.quant.encode import (
    abs_max,
    check_float_input,
    qmax_of,
    quantize_chunked,
    scale_from_amax,
)
from flashrl.quant.schemes import QuantScheme

logger = logging.getLogger(__name__)
CHECK_WORDS = 512
"""64-bit words per checksum block (4 KiB)."""
Checksum = tuple[int, int, int, int]


def checksum(codes: torch.Tensor, scale: torch.Tensor) -> Checksum:
    """(sum, block-weighted sum) of the bytes of `codes` and of `scale`, each read as int64 words.

    Sums wrap modulo 2**64 whatever the order they run in, so CPU and CUDA give the same numbers.
    Any single changed byte changes the plain sum; moved blocks change the weighted one. One read
    of memory at about copy speed (no hashing), on the tensors' own device."""
    return _words_checksum(codes) + _words_checksum(scale)


def _words_checksum(t: torch.Tensor) -> tuple[int, int]:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = data.numel() // 8 * 8
    if whole < data.numel() or data.data_ptr() % 8:  # a tail, or a slice not on a word boundary
        padded = torch.zeros(whole + 8, dtype=torch.uint8, device=data.device)
        padded[: data.numel()].copy_(data)
        data = padded if whole < data.numel() else padded[:whole]
    words = data.view(torch.int64)
    full = words.numel() // CHECK_WORDS * CHECK_WORDS
    blocks = words[:full].view(-1, CHECK_WORDS).sum(dim=1)
    if full < words.numel():
        blocks = torch.cat([blocks, words[full:].sum().reshape(1)])
    weights = torch.arange(1, blocks.numel() + 1, dtype=torch.int64, device=blocks.device)
    a, b = torch.stack([blocks.sum(), (blocks * weights).sum()]).tolist()
    return int(a), int(b)


def hysteresis_scales(
    w: torch.Tensor,
    scheme: QuantScheme,
    old_scale: torch.Tensor | None,
    ref_amax: torch.Tensor | None,
    band: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scales `w` is quantized with, the amax each was made from, and which were kept
    (module doc, point 1). Without an old scale every scale is fresh."""
    channel = scheme.weight_granularity == "channel"
    amax = (abs_max(w, dim=-1) if channel else abs_max(w)).float()
    fresh = scale_from_amax(amax, qmax_of(scheme.code_dtype))
    if old_scale is None or ref_amax is None:
        return fresh, amax, torch.zeros_like(amax, dtype=torch.bool)
    keep = (amax <= ref_amax) & (amax >= ref_amax * (1.0 - band))
    return torch.where(keep, old_scale, fresh), torch.where(keep, ref_amax, amax), keep


def quantize_with_scales(
    w: torch.Tensor, scale: torch.Tensor, code_dtype: torch.dtype
) -> torch.Tensor:
    """Codes of a 2-D `w` for given scales ([N, 1] per row or [] per tensor), by the reference
    loop: the same bits as `quantize_per_row` / `quantize_per_tensor` when the scales are equal.
    The caller has checked `w` is finite."""
    check_float_input(w, "weight")
    per_row = scale.dim() == 2

    def scale_chunk_(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
        s = scale[rows] if per_row else scale
        chunk.div_(s)
        return s

    return quantize_chunked(w, code_dtype, None, scale_chunk_, check_finite=False)


@dataclass
class Mirror:
    """What the workers store for one weight, as the trainer believes it."""

    codes: torch.Tensor
    scale: torch.Tensor
    ref_amax: torch.Tensor
    check: Checksum


class DeltaSender:
    """The trainer's side of delta update: the mirror, the plan of each update and its tensors."""

    def __init__(self, band: float = 0.05, full_every: int = 20) -> None:
        if isinstance(band, bool) or not 0.0 <= band < 1.0:
            raise ConfigError(
                f"rollout.workers.delta_scale_band={band!r} is invalid; allowed: a number >= 0 and < 1 "
                f"(0: fresh scales at every update, the codes payload bit for bit)"
            )
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 0:
            raise ConfigError(
                f"rollout.workers.delta_full_every={full_every!r} is invalid; allowed: an integer >= 0 "
                f"(0: full only at the first update and after a checksum mismatch)"
            )
        self.band, self.full_every = band, full_every
        self.mirrors: dict[str, Mirror] = {}
        self.dense: dict[str, DenseMirror] = {}
        self.pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.updates = 0
        self.needs_full = True
        """The next update sends every code (first update; after an update that did not complete)."""
        self.stats: dict[str, float] = {}

    def plan(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        quantized: dict[str, str],
        dense: dict[str, str] | None = None,
    ) -> list[TensorMeta]:
        """Quantize every weight in `quantized` with hysteresis scales, round every weight in
        `dense` (name -> the workers' storage dtype) to that dtype, update the mirrors, and return
        the tensors of this update (module doc); other tensors travel as they are."""
        check_finite(named)
        full = self.needs_full or (self.full_every > 0 and self.updates % self.full_every == 0)
        self.needs_full, self.pending = True, {}  # cleared by `confirm`
        metas: list[TensorMeta] = []
        counts = {"codes": 0, "changed": 0, "scales": 0, "kept": 0, "dense": 0, "dense_changed": 0}
        for name, t in named:
            if name in quantized:
                scheme = codes_scheme(name, quantized[name], "delta")
                metas += self._encode(name, t.detach(), scheme, full, counts)
            elif dense and name in dense:
                metas += self._encode_dense(name, t.detach(), dense[name], full, counts)
            else:
                dtype = str(t.dtype).removeprefix("torch.")
                metas.append(TensorMeta(name, "tensor", dtype, tuple(t.shape)))
        self.stats = {
            "delta_full": float(full),
            "delta_changed_frac": counts["changed"] / max(counts["codes"], 1),
            "delta_kept_scales_frac": counts["kept"] / max(counts["scales"], 1),
            "delta_dense_changed_frac": counts["dense_changed"] / max(counts["dense"], 1),
        }
        return metas

    def _encode_dense(
        self, name: str, t: torch.Tensor, dtype: str, full: bool, counts: dict[str, int]
    ) -> list[TensorMeta]:
        value = t.to(getattr(torch, dtype)).contiguous()
        if value.data_ptr() == t.data_ptr():
            value = value.clone()  # the mirror must not alias the trainer's own weight
        old = self.dense.get(name)
        metas = [TensorMeta(name, "tensor", dtype, tuple(value.shape))]
        counts["dense"] += value.numel()
        if old is not None and (old.value.shape, old.value.device) == (value.shape, value.device):
            index, values = diff_values(old.value, value)
            counts["dense_changed"] += index.numel()
            whole = value.numel() * value.element_size()
            metas = self._pairs(name, index, values, "values", whole, full) or metas
        else:
            counts["dense_changed"] += value.numel()
        self.dense[name] = DenseMirror(value, checksum(value, value[:0]))
        return metas

    def _pairs(
        self,
        name: str,
        index: torch.Tensor,
        values: torch.Tensor,
        kind: str,
        whole_bytes: int,
        full: bool,
    ) -> list[TensorMeta] | None:
        """The (index, `kind`) metas of a delta, kept pending for `tensors`; None when the update is
        full or the pairs would outweigh the whole tensor (it then travels whole)."""
        if full or index.numel() * (index.element_size() + values.element_size()) >= whole_bytes:
            return None
        self.pending[name] = (index, values)
        idx, dtype = (str(t.dtype).removeprefix("torch.") for t in (index, values))
        n = (index.numel(),)
        return [TensorMeta(name, "index", idx, n), TensorMeta(name, kind, dtype, n)]

    def _encode(
        self, name: str, w: torch.Tensor, scheme: QuantScheme, full: bool, counts: dict[str, int]
    ) -> list[TensorMeta]:
        old = self.mirrors.get(name)
        if old is not None and (old.codes.shape != w.shape or old.codes.device != w.device):
            old = None  # a different tensor under this name: start afresh
        scale, ref, kept = hysteresis_scales(
            w,
            scheme,
            None if old is None else old.scale,
            None if old is None else old.ref_amax,
            self.band,
        )
        codes = quantize_with_scales(w, scale, scheme.code_dtype)
        code = str(scheme.code_dtype).removeprefix("torch.")
        tail = [TensorMeta(name, "scale", "float32", tuple(scale.shape))]
        counts["codes"] += codes.numel()
        counts["scales"] += kept.numel()
        counts["kept"] += int(kept.sum())
        metas = [TensorMeta(name, "codes", code, tuple(w.shape))]
        if old is not None:
            index, changed = diff_values(old.codes, codes)
            counts["changed"] += index.numel()
            whole = codes.numel() * codes.element_size()
            metas = self._pairs(name, index, changed, "changed", whole, full) or metas
        else:
            counts["changed"] += codes.numel()
        self.mirrors[name] = Mirror(codes, scale, ref, checksum(codes, scale))
        return metas + tail

    def tensors(
        self, named: Sequence[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]
    ) -> Iterator[torch.Tensor]:
        """The tensors `metas` describes, in order (codes and scales from the mirror)."""
        tensors = dict(named)
        for meta in metas:
            if meta.kind == "tensor" and meta.name in self.dense:
                yield self.dense[meta.name].value
            elif meta.kind == "tensor":
                yield tensors[meta.name].detach()
            elif meta.kind == "codes":
                yield self.mirrors[meta.name].codes
            elif meta.kind == "scale":
                yield self.mirrors[meta.name].scale
            else:
                yield self.pending[meta.name][0 if meta.kind == "index" else 1]

    def full_metas(self, names: Sequence[str]) -> list[TensorMeta]:
        """The tensors of a whole (codes) resend of `names` from the mirror."""
        out = []
        for name in names:
            if name in self.dense:
                v = self.dense[name].value
                out.append(TensorMeta(name, "tensor", str(v.dtype)[6:], tuple(v.shape)))
                continue
            m = self.mirrors[name]
            code = str(m.codes.dtype).removeprefix("torch.")
            out.append(TensorMeta(name, "codes", code, tuple(m.codes.shape)))
            out.append(TensorMeta(name, "scale", "float32", tuple(m.scale.shape)))
        return out

    def mismatches(
        self, metas: Sequence[TensorMeta], reports: Sequence[dict[str, Sequence[int]]]
    ) -> dict[str, list[int]]:
        """Weight name -> the workers whose checksum of a quantized weight of `metas` differs from
        the mirror's (or is missing)."""
        bad: dict[str, list[int]] = {}
        checks = {m.name: self.mirrors[m.name].check for m in metas if m.kind == "scale"}
        checks |= {
            m.name: self.dense[m.name].check
            for m in metas
            if m.kind in ("tensor", "values") and m.name in self.dense
        }
        for i, report in enumerate(reports):
            for name, check in checks.items():
                if tuple(report.get(name, ())) != check:
                    bad.setdefault(name, []).append(i)
        return bad

    def confirm(self) -> None:
        """Every worker matched the mirror: the next update may send a delta."""
        self.updates += 1
        self.needs_full, self.pending = False, {}


Send = Callable[[list[TensorMeta], Iterator[torch.Tensor]], tuple[dict, list[dict]]]
"""Broadcast tensors (metas, tensors) to every worker; returns the send stats (``sent_bytes``) and
each worker's result, whose ``checksums`` maps weight names to `checksum` values."""


def delta_update(
    sender: DeltaSender,
    named: Sequence[tuple[str, torch.Tensor]],
    quantized: dict[str, str],
    send: Send,
    dense: dict[str, str] | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """One delta update through `send`, checked and repaired (module doc, point 5). Returns the
    stats (bytes, seconds, fractions) and the workers' results of the last broadcast."""
    start = time.perf_counter()
    named = [(n, t.detach()) for n, t in named]
    metas = sender.plan(named, quantized, dense)
    plan_s = time.perf_counter() - start
    sent, results = send(metas, sender.tensors(named, metas))
    bad = sender.mismatches(metas, [r.pop("checksums", {}) for r in results])
    total, repaired = sent["sent_bytes"], 0.0
    if bad:
        first = next(iter(bad))
        logger.warning(
            "weight update: %d tensor(s) differ from the trainer's after a delta (checksum "
            "mismatch; first %r on worker(s) %s); resending them whole",
            len(bad),
            first,
            bad[first],
        )
        repair = sender.full_metas(sorted(bad))
        again, results = send(repair, sender.tensors(named, repair))
        total, repaired = total + again["sent_bytes"], float(len(bad))
        still = sender.mismatches(repair, [r.pop("checksums", {}) for r in results])
        if still:
            raise WeightError(
                f"{len(still)} tensor(s) still differ after a full resend (first "
                f"{next(iter(still))!r}); the workers' weights cannot be trusted"
            )
    sender.confirm()
    stats = {"sent_bytes": total, "plan_s": plan_s, "delta_repaired": repaired, **sender.stats}
    return {**stats, "send_s": time.perf_counter() - start - plan_s}, results
