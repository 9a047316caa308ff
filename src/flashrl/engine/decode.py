"""The decode step of `Engine`: shape buckets, static inputs, opt-in `torch.compile` / CUDA graphs.

One decode step advances the active sequences, which the engine keeps in KV-cache slots 0..B-1, by
one token each. This module runs the model part of that step (token ids and positions in, fp32
logits out); the scheduler (`flashrl.engine.scheduler`) and the sampler stay outside it.

**Buckets.** A captured CUDA graph (or a compiled kernel with static shapes) serves one shape only,
so with buckets on, a step of B sequences whose longest one has L cached tokens (the new one
included) runs at

- batch ``batch_bucket(B)``: 1, 2, 4, 8, then powers of two and their midpoints
  (12, 16, 24, 32, 48, 64, 96, 128, 192, 256, ...), capped at ``max_batch``: at most a third of the
  rows are padding above 8;
- attended length ``kv_bucket(L)``: L rounded up to a multiple of `KV_BUCKET` (256), capped at
  ``max_len``.

Padding rows b = B..bucket-1 take token 0 at position 0 of slot b, which no sequence owns (the
active set is slots 0..B-1, and a prompt admitted later into slot b is prefilled over positions
0..T-1, overwriting it). A padding row attends to that one key only, so it never reads a live
slot, and `ForwardBatch.row_mask` zeroes its input to every linear layer, so it adds exact zeros to
every GEMM and to the per-tensor activation amax of the `fp8` scheme, and is left out of the fp8 KV
clipping counters; its logits are dropped before sampling. Keys beyond a row's position (the padded
length) are masked as before. Real rows therefore compute what they compute unpadded, up to the
kernels themselves, which may sum in another order at another shape. Measured on the CPU build of
torch 2.13 (fp32 engines, tests/test_engine_compile.py): batch padding alone is bit-identical for
the int8 / fp8 GEMMs and within 1e-6 for fp32 GEMMs (kernel choice by row count); attention over a
padded key range moves logits in the last fp32 bits (<= 4e-7), which a quantized activation or fp8
KV code can turn into a flipped code and, rarely, another sampled token: the same caveat as any
change of batch size or kernel. bf16 engines: within bf16 rounding.

Buckets cost compute on the CPU (padded rows and keys are computed, then dropped): they are on by
default only when the step is compiled, which needs them (docs/engine.md has the measurements).

**Compile.** ``compile=`` one of `COMPILE_MODES` wraps the padded forward in ``torch.compile``
(``fullgraph=True``: a graph break raises instead of silently running part of the step eagerly; a
compile error raises). Dynamo's automatic dynamic shapes compile the step a few times (the first
shape, then code generic in the batch and the attended length, plus torch's own specializations
such as batch 1), not once per bucket; buckets bound the number of distinct shapes, which is what
CUDA graphs need. ``reduce-overhead`` (CUDA only) and ``max-autotune`` on CUDA capture CUDA graphs,
one per shape, through torch's CUDA graph trees. Inputs live in one static ``[3, bucket]`` int64
buffer per batch bucket (tokens, positions, row mask), filled by one host-to-device copy per step;
the KV cache tensors, their scales and
counters and every weight are marked as static addresses, so a graph reads and writes them in
place and sees in-place weight updates (`QuantLinear.requantize_` keeps storage) and KV scale
updates (`KVCache.set_scales`) without re-capture. If torch skips CUDA graphs for a compiled step
(for example because a mutated input is not static), the step raises: that would be a silent
fallback to an uncaptured step.
"""

from __future__ import annotations

import torch

from flashrl.engine.kv_cache import KVCache
from flashrl.errors import ConfigError, UnsupportedError
from flashrl.model.batch import ForwardBatch
from flashrl.model.decoder import Decoder

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""`torch.compile` modes the decode step accepts (torch's names)."""
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes that capture CUDA graphs on a CUDA device."""
KV_BUCKET = 256
"""The attended KV length is padded to a multiple of this many positions."""
RECOMPILE_LIMIT = 64
"""Dynamo's per-function compile limit while a compiled decode step runs. The step's code is
shared by every engine in the process (each engine adds a few entries); hitting the limit raises
(``fail_on_recompile_limit_hit``) instead of torch's default, which is to run eagerly from then
on."""


def batch_bucket(batch: int, max_batch: int) -> int:
    """The padded batch size for `batch` active sequences (see the module docstring)."""
    if not 1 <= batch <= max_batch:
        raise ValueError(f"batch={batch} must be in [1, max_batch={max_batch}]")
    power = 1 << (batch - 1).bit_length()  # the smallest power of two >= batch
    bucket = power if power <= 8 or batch > power * 3 // 4 else power * 3 // 4
    return min(bucket, max_batch)


def batch_buckets(max_batch: int) -> list[int]:
    """Every batch bucket an engine of `max_batch` slots can use, ascending."""
    return sorted({batch_bucket(b, max_batch) for b in range(1, max_batch + 1)})


def kv_bucket(length: int, max_len: int) -> int:
    """The padded attended length for a longest sequence of `length` cached positions."""
    if not 1 <= length <= max_len:
        raise ValueError(f"length={length} must be in [1, max_len={max_len}]")
    return min(-(-length // KV_BUCKET) * KV_BUCKET, max_len)


def check_compile_mode(mode: str | None, device: torch.device) -> str | None:
    """Validate ``EngineConfig(decode_compile=...)``: None (eager) or one of `COMPILE_MODES`."""
    if mode is None or mode is False:
        return None
    if mode not in COMPILE_MODES:
        raise ConfigError(
            f"decode_compile={mode!r} is invalid; allowed: None (eager), {', '.join(COMPILE_MODES)}"
        )
    if mode == "reduce-overhead" and device.type != "cuda":
        raise UnsupportedError(
            "decode_compile='reduce-overhead' captures CUDA graphs and needs a "
            f"CUDA device; this engine runs on {device.type}: use 'default' "
            "(or None for eager)"
        )
    return mode


class DecodeStep:
    """Runs the model part of a decode step: `(cache, tokens, positions) -> fp32 logits [B, vocab]`.

    `buckets` pads the batch and the attended length (module docstring); `compile` (a mode of
    `COMPILE_MODES`, None for eager) compiles the padded forward and implies `buckets`.
    """

    def __init__(
        self,
        model: Decoder,
        max_batch: int,
        max_len: int,
        device: torch.device,
        compile: str | None = None,
        buckets: bool = False,
    ) -> None:
        self.model, self.max_batch, self.max_len, self.device = model, max_batch, max_len, device
        self.mode = check_compile_mode(compile, device)
        if self.mode is not None and not buckets:
            raise ConfigError(
                "a compiled decode step needs buckets (static shapes); "
                "pass decode_buckets=True or None"
            )
        self.buckets = buckets
        self.cudagraphs = self.mode in CUDAGRAPH_MODES and device.type == "cuda"
        self._inputs: dict[int, torch.Tensor] = {}
        self._static_cache: KVCache | None = None  # the cache whose tensors are marked static
        self.shapes: set[tuple[int, int]] = set()
        """(batch, attended length) pairs run so far: buckets when bucketed (a CUDA graph each with
        `cudagraphs`), the exact shapes otherwise."""
        self._compiled = None
        if self.mode is not None:
            self._compiled = torch.compile(self._padded_forward, mode=self.mode, fullgraph=True)

    def __call__(self, cache: KVCache, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """fp32 logits [B, vocab] for sequence b in slot b feeding token `tokens[b]` at
        `positions[b]` (which the step also writes into the cache)."""
        if not self.buckets:
            self.shapes.add((len(tokens), max(positions) + 1))
            return self.eager(cache, tokens, positions)
        b = len(tokens)
        bucket = batch_bucket(b, self.max_batch)
        kv_length = kv_bucket(max(positions) + 1, self.max_len)
        pad = [0] * (bucket - b)
        inputs = self._input_buffer(bucket)
        inputs.copy_(torch.tensor([tokens + pad, positions + pad, [1] * b + pad], dtype=torch.long))
        self.shapes.add((bucket, kv_length))
        if self._compiled is None:
            logits = self._padded_forward(cache, inputs, kv_length)
        else:
            logits = self._run_compiled(cache, inputs, kv_length)
        return logits[:b]

    # ---------------------------------------------------------------- forwards

    def eager(self, cache: KVCache, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """The step at its exact shapes, eagerly: B rows, attended length max(position) + 1."""
        pos = torch.tensor(positions, device=self.device)[:, None]
        batch = ForwardBatch.decode_step(pos, cache, max(positions) + 1, self.model.sliding_window)
        hidden = self.model.hidden_states(torch.tensor(tokens, device=self.device)[:, None], batch)
        return self.model.logits(hidden[:, 0])

    def _padded_forward(self, cache: KVCache, inputs: torch.Tensor, kv_length: int) -> torch.Tensor:
        """The bucketed forward (what `torch.compile` traces): `inputs` [3, bucket] holds token ids,
        positions and the row mask (1 real, 0 padding); attention spans `kv_length` positions."""
        tokens, positions = inputs[0].unsqueeze(1), inputs[1].unsqueeze(1)
        row_mask = inputs[2].to(self.model.dtype).view(-1, 1, 1)
        batch = ForwardBatch.decode_step(
            positions, cache, kv_length, self.model.sliding_window, row_mask=row_mask
        )
        hidden = self.model.hidden_states(tokens, batch)
        return self.model.logits(hidden[:, 0])

    def _run_compiled(self, cache: KVCache, inputs: torch.Tensor, kv_length: int) -> torch.Tensor:
        from torch._dynamo.utils import counters

        if self.cudagraphs:
            if cache is not self._static_cache:
                _mark_static(
                    cache.tensors() + list(self.model.parameters()) + list(self.model.buffers())
                )
                self._static_cache = cache
            # the previous step's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        skips = counters["inductor"]["cudagraph_skips"]
        with torch._dynamo.config.patch(
            recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True
        ):
            logits = self._compiled(cache, inputs, kv_length)
        if self.cudagraphs and counters["inductor"]["cudagraph_skips"] != skips:
            raise RuntimeError(
                f"torch.compile(mode={self.mode!r}) ran the decode step without CUDA graphs "
                "(a cudagraph skip; TORCH_LOGS=perf_hints prints the reason); refusing to "
                "continue uncaptured"
            )
        return logits

    # ---------------------------------------------------------------- static buffers

    def _input_buffer(self, bucket: int) -> torch.Tensor:
        """The static [3, bucket] int64 input buffer of a batch bucket (allocated once)."""
        if bucket not in self._inputs:
            self._inputs[bucket] = torch.zeros(3, bucket, dtype=torch.long, device=self.device)
            if self.cudagraphs:
                _mark_static([self._inputs[bucket]])
        return self._inputs[bucket]


def _mark_static(tensors: list[torch.Tensor]) -> None:
    """Tell dynamo these tensors keep their address (guarded: a moved tensor recompiles), so CUDA
    graphs use them in place instead of copying them in, and may write to them (the KV cache)."""
    for t in tensors:
        if getattr(t, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(t, guard=True)
