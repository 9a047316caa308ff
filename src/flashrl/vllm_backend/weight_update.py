"""`WeightUpdater`: update a running ``vllm.LLM`` with a trainer's parameters after every optimizer step.

One `update_weights` is one vLLM weight update (``start_weight_update`` -> one ``update_weights`` chunk per
decoder layer -> ``finish_weight_update``) through the ``flashrl`` transfer backend, followed by
``reset_prefix_cache``. Inside vLLM each layer is re-quantized with fresh scales as soon as its
tensors arrive (layerwise reload), and the results are copied into the existing storages.

Rules the update enforces, because vLLM's layerwise reload cannot recover from them:

- tensors are sent in checkpoint (Hugging Face) names, one chunk per decoder layer
  (`vllm.distributed.weight_transfer.base.layerwise_groups`), so a layer never waits in a buffer;
- tensors vLLM fuses into one layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj, weights and
  biases alike) are sent together: a layer that received only some of them would be quantized
  with uninitialized memory in the missing rows, so an update that lacks a sibling is refused
  before anything is sent.

Transport: when the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the tensors
themselves are handed over; otherwise each chunk is written to a safetensors file in /dev/shm
(or the temp dir) and its path is sent. Every tensor is checked for NaN/Inf once, before anything
is sent; in-process, the chunks say so (``prechecked``) and vLLM's loaders do not check the same
tensors again (`flashrl.vllm_backend.model_state.ModelState.prechecked`).

FP8 KV cache: vLLM resets KV scales to 1.0 on every reload, so with an fp8 cache each update ends by
setting them again (`flashrl.vllm_backend.kv_scales`): calibrated from the new weights on the
recent rollouts (`remember_kv`), or a fixed value. A calibrated update must carry every decoder
parameter and the embedding (checked before anything is sent).

Online smoothing (``smooth`` in the engine's config): every update refreshes each re-quantized
layer's factors inside vLLM (`flashrl.vllm_backend.smoothing`). Building a `WeightUpdater` starts
the first statistics window (dropping vLLM's start-up dummy forwards), so build it before the first
``generate``; `calibrate_smoothing` gives the first step smoothed weights too.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import torch

from flashrl.errors import ConfigError, InputError, WeightError
from flashrl.vllm_backend.kv_scales import KVScaleSync
from flashrl.vllm_backend.names import TRANSFER_BACKEND

logger = logging.getLogger(__name__)

FUSED_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)
"""Checkpoint module names that vLLM loads into one fused layer (with `output_partition_sizes`)."""

TRANSPORTS = ("auto", "tensors", "file")


def check_fused_complete(names: Iterable[str]) -> None:
    """Raise a `WeightError` when `names` holds part of a fused group (q_proj without k_proj and v_proj,
    gate_proj without up_proj), naming what is missing."""
    present = set(names)
    for name in sorted(present):
        parts = name.split(".")
        if len(parts) < 2:
            continue
        for group in FUSED_GROUPS:
            if parts[-2] not in group:
                continue
            siblings = [".".join([*parts[:-2], member, parts[-1]]) for member in group]
            missing = [s for s in siblings if s not in present]
            if missing:
                raise WeightError(
                    f"{name} is sent without {', '.join(missing)}: vLLM fuses {'/'.join(group)} into one layer "
                    "and re-quantizes it only from all of its parts; send them together"
                )


def group_by_layer(items: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Split (name, tensor) pairs into one chunk per decoder layer (plus embeddings before and the
    final norm / head after), in vLLM's `layerwise_groups` order."""
    from vllm.distributed.weight_transfer.base import layerwise_groups

    by_name = dict(items)
    if len(by_name) != len(items):
        raise WeightError("duplicate parameter names in the weights of the update")
    return [
        [(name, by_name[name]) for name in group]
        for group in layerwise_groups([n for n, _ in items])
    ]


class WeightUpdater:
    """Updates the weights of an ``LLM`` built with `engine_kwargs` (or the equivalent settings).

    `transport`: ``auto`` (tensors for an in-process engine, files otherwise), ``tensors`` or
    ``file``. `tmp_dir`: where chunk files go (default /dev/shm when it exists). `kv_scale`
    (``calibrated`` or a float) overrides the KV-scale mode `engine_kwargs` recorded for an fp8 KV
    cache; with an fp8 cache the scales are set at construction (from the checkpoint on disk) and
    after every update.
    """

    def __init__(
        self,
        llm: Any,
        transport: str = "auto",
        tmp_dir: str | None = None,
        kv_scale: str | float | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ConfigError(
                f"transport={transport!r} is invalid; allowed: {', '.join(TRANSPORTS)}"
            )
        self.llm = llm
        backend = getattr(llm.llm_engine.vllm_config.weight_transfer_config, "backend", None)
        if backend != TRANSFER_BACKEND:
            raise ConfigError(
                f"this LLM was built with weight_transfer_config backend {backend!r}; WeightUpdater needs "
                f"{TRANSFER_BACKEND!r}: build it with LLM(model, **flashrl.vllm_backend.engine_kwargs(...))"
            )
        try:
            workers = llm.collective_rpc("flashrl_worker_info")
        except Exception as err:
            raise ConfigError(
                "the LLM's workers lack flashrl's methods; build it with "
                "LLM(model, **flashrl.vllm_backend.engine_kwargs(...)) (worker_extension_cls)"
            ) from err
        in_process = all(w["pid"] == os.getpid() for w in workers)
        if transport == "auto":
            transport = "tensors" if in_process else "file"
        elif transport == "tensors" and not in_process:
            raise ConfigError(
                "transport='tensors' needs an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        self.transport = transport
        self.tmp_dir = tmp_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.version = 0
        llm.init_weight_transfer_engine({"init_info": {}})
        self.kv = KVScaleSync(llm, kv_scale)
        self.kv_start_s = self.kv.start()
        self.smoothed_layers = max(llm.collective_rpc("flashrl_reset_smoothing_stats"))
        """Layers vLLM smooths (per worker; 0 without ``smooth``)."""
        self.smoothing_pending = bool(self.smoothed_layers) and self.kv.load_format != "dummy"
        """Whether `calibrate_smoothing` still applies: smoothing on, checkpoint weights, no update yet."""

    def calibrate_smoothing(self, sequences: Iterable[Iterable[int]]) -> float:
        """The built-in engine's first calibration, while the engine holds the checkpoint on disk: a
        prefill over the first `CALIBRATION_PROMPTS` of `sequences` (token ids) gathers activation
        statistics, then vLLM reloads the checkpoint (``reload_weights``), which refreshes every
        smoothed layer's factors, and the fp8 KV scales are set again (a reload resets them, and the
        calibrated ones now use `sequences`). Returns seconds; 0.0 when not `smoothing_pending`."""
        if not self.smoothing_pending:
            return 0.0
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from flashrl.model.kv_calibration import checkpoint_getter
        from flashrl.model.smoothing import CALIBRATION_PROMPTS

        start = time.perf_counter()
        seqs = [list(s) for s in sequences][:CALIBRATION_PROMPTS]
        if not seqs:
            raise InputError("calibrate_smoothing needs at least one token sequence")
        self.llm.collective_rpc("flashrl_reset_smoothing_stats")
        prompts = [TokensPrompt(prompt_token_ids=s) for s in seqs]
        self.llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        self.llm.collective_rpc("reload_weights")
        self.llm.reset_prefix_cache()
        self.kv.apply(
            checkpoint_getter(self.kv.model_dir) if self.kv.calibrated else None, sequences=seqs
        )
        self.smoothing_pending = False
        return time.perf_counter() - start

    def remember_kv(self, sequences: Iterable[Iterable[int]]) -> None:
        """Add recent token sequences (prompt + response, most important first) to the fp8 KV
        calibration set (no-op without calibrated KV scales)."""
        self.kv.remember([list(s) for s in sequences])

    def calibrate_kv(self, sequences: Iterable[Iterable[int]]) -> float:
        """Recalibrate the fp8 KV scales of the engine's start-up weights (the checkpoint on disk) on
        `sequences`, e.g. the first real prompts; before the first update only. Returns seconds."""
        if self.version > 0:
            raise ConfigError(
                "calibrate_kv reads the checkpoint on disk, which the engine no longer holds after an "
                "update; the next update recalibrates on remember_kv's sequences"
            )
        if not self.kv.calibrated:
            raise ConfigError("calibrate_kv needs an fp8 KV cache with kv_scale='calibrated'")
        from flashrl.model.kv_calibration import checkpoint_getter

        return self.kv.apply(
            checkpoint_getter(self.kv.model_dir), sequences=[list(s) for s in sequences]
        )

    def _checked_items(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """The pairs as full tensors, every one checked before anything is sent (a refused update
        leaves the engine as it was): finite floats, complete fused groups, what the KV
        calibration needs."""
        from vllm.distributed.weight_transfer.base import materialize_full_tensor

        from flashrl.vllm_backend.direct_load import check_incoming

        items = [(name, materialize_full_tensor(t).detach()) for name, t in named_tensors]
        if not items:
            raise WeightError("nothing to update: no (name, tensor) pairs")
        for name, tensor in items:
            check_incoming(tensor, name)
        check_fused_complete(name for name, _ in items)
        self.kv.check_update([name for name, _ in items])
        return items

    def _send(self, chunks: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Start a weight update and send `chunks` (one layer's tensors each) through the
        flashrl weight-transfer backend; the caller finishes the update."""
        self.llm.start_weight_update()
        chunk_dir = (
            tempfile.mkdtemp(prefix="flashrl-update-", dir=self.tmp_dir)
            if self.transport == "file"
            else None
        )
        try:
            for index, chunk in enumerate(chunks):
                self.llm.update_weights({"update_info": self._payload(chunk, chunk_dir, index)})
        finally:
            if chunk_dir is not None:
                shutil.rmtree(chunk_dir, ignore_errors=True)

    @torch.no_grad()
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        kv_sequences: Iterable[Iterable[int]] | None = None,
    ) -> dict[str, float]:
        """Update the engine with `named_tensors` (checkpoint names, e.g. a trainer's
        ``named_parameters()``), re-quantizing every layer, set the fp8 KV scales again, then reset
        the prefix cache.

        Returns seconds: ``transfer_s`` (sending and loading, re-quantization excluded),
        ``requantize_s`` (summed over layers; max over workers), ``kv_calibration_s`` (computing
        and setting fp8 KV scales; 0.0 without an fp8 cache), ``reset_cache_s`` and
        ``weight_update_s`` (in all); plus ``sent_bytes``, ``tensors``, ``chunks`` and
        ``layers_requantized``. `kv_sequences` (token ids) replace the remembered calibration set
        for this update. A failure after the update started leaves the engine's weights
        undefined: update again.
        """
        items = self._checked_items(named_tensors)
        chunks = group_by_layer(items)
        self.llm.collective_rpc("flashrl_pop_requantize_stats")  # zero the counters
        start = time.perf_counter()
        self._send(chunks)
        self.version += 1
        self.smoothing_pending = False  # the update refreshed the factors
        self.llm.finish_weight_update(weight_version=weight_version or str(self.version))
        loaded = time.perf_counter()
        kv_sequences = [list(s) for s in kv_sequences] if kv_sequences is not None else None
        kv_calibration = self.kv.apply(dict(items).__getitem__, items[0][1].device, kv_sequences)
        calibrated = time.perf_counter()
        self.llm.reset_prefix_cache()
        done = time.perf_counter()
        requant = self.llm.collective_rpc("flashrl_pop_requantize_stats")
        requant_s = max(r["requantize_s"] for r in requant)
        return {
            "transfer_s": loaded - start - requant_s,
            "requantize_s": requant_s,
            "kv_calibration_s": kv_calibration,
            "reset_cache_s": done - calibrated,
            "weight_update_s": done - start,
            "sent_bytes": float(sum(t.numel() * t.element_size() for _, t in items)),
            "tensors": float(len(items)),
            "chunks": float(len(chunks)),
            "layers_requantized": float(max(r["layers_requantized"] for r in requant)),
        }

    def _payload(
        self, chunk: list[tuple[str, torch.Tensor]], chunk_dir: str | None, index: int
    ) -> dict[str, Any]:
        names = [name for name, _ in chunk]
        if chunk_dir is None:  # every tensor was checked whole: the loaders need not scan it again
            return {"names": names, "tensors": [t for _, t in chunk], "prechecked": True}
        from safetensors.torch import save_file

        path = os.path.join(chunk_dir, f"chunk-{index:05d}.safetensors")
        # clone() breaks storage sharing (tied or sliced parameters), which safetensors refuses.
        save_file({name: t.to("cpu").contiguous().clone() for name, t in chunk}, path)
        return {"names": names, "path": path}
