"""Tiny checkpoints that vLLM can load: a `flashrl.testing` model plus a local character tokenizer.

vLLM needs a tokenizer in the model directory (unless ``skip_tokenizer_init=True``); the built-in
engine does not. The tokenizer is built with the `tokenizers` library from a fixed vocabulary, so
nothing is downloaded: ids 0-3 are ``<pad> <s> </s> <unk>`` (matching `flashrl.testing.tiny_config`'s
pad/bos/eos ids), then the 95 printable ASCII characters one token each, then filler tokens
``<t99>``... up to the model's vocabulary size.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from flashrl.testing import char_tokenizer, save_tiny_model


def save_char_tokenizer(path: str | Path, vocab_size: int = 256) -> Path:
    """Write `flashrl.testing.char_tokenizer(vocab_size)` to `path`."""
    char_tokenizer(vocab_size).save_pretrained(path)
    return Path(path)


def save_tiny_vllm_model(
    path: str | Path,
    family: str = "qwen3",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """`flashrl.testing.save_tiny_model` plus the character tokenizer, in one directory.

    The default family is qwen3 (head_dim 32): vLLM's CPU attention needs head_size % 32 == 0.
    """
    path = save_tiny_model(path, family=family, seed=seed, dtype=dtype, **overrides)
    save_char_tokenizer(path, vocab_size=int(overrides.get("vocab_size", 256)))
    return path


TEST_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""Environment for small in-process vLLM tests: engine core in this process (the model and its
tensors are reachable), 1 GiB of KV cache."""


def apply_test_env() -> None:
    """Set `TEST_ENV` (keeping values already set) and drop ``FLASHRL_CONFIG`` /
    ``FLASHRL_LMHEAD_FP32``, which would otherwise switch the tests' engines to another scheme."""
    import os

    for key, value in TEST_ENV.items():
        os.environ.setdefault(key, value)
    for key in ("FLASHRL_CONFIG", "FLASHRL_LMHEAD_FP32"):
        os.environ.pop(key, None)


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The fp32 ``named_parameters()`` of the `transformers` checkpoint at `path` (what a trainer sends)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, trust_remote_code=False
    )
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def save_perturbed_copy(
    src: str | Path, dst: str | Path, scale: float = 0.05, seed: int = 1
) -> Path:
    """Copy the checkpoint (and tokenizer) at `src` to `dst` with Gaussian noise of std
    ``scale * std(parameter)`` added to every parameter: a stand-in for a trained policy."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, trust_remote_code=False
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(
                torch.randn(p.shape, generator=gen)
                * (scale * float(p.std()) if p.numel() > 1 else scale)
            )
    model.save_pretrained(dst)
    transformers.AutoTokenizer.from_pretrained(src, trust_remote_code=False).save_pretrained(dst)
    return Path(dst)


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Checkpoint names of the linear layers flashrl quantizes (dense decoder families)."""


def save_compressed_tensors_int8(src: str | Path, dst: str | Path) -> Path:
    """A compressed-tensors W8A8 int8 checkpoint (per-channel weights, dynamic per-token activations)
    whose codes and scales are flashrl's quantization of `src`'s linear weights: vLLM's own
    pre-quantized int8 path on flashrl's numbers (tests/test_vllm_kernels.py, benchmarks/bench_vllm.py).
    Written to a temp directory and renamed, so it appears complete or not at all; an existing
    complete `dst` is reused."""
    from safetensors.torch import load_file, save_file

    from flashrl.quant.linear import QuantLinear

    src, dst = Path(src), Path(dst)
    if (dst / "model.safetensors").exists():
        return dst
    tmp = Path(tempfile.mkdtemp(prefix=".w8a8-", dir=dst.parent))
    shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    tensors = load_file(str(tmp / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            layer = QuantLinear(tensor.shape[1], tensor.shape[0], "int8", dtype=tensor.dtype)
            layer.requantize_(tensor)
            out[name] = layer.weight.clone()
            out[name.removesuffix("weight") + "weight_scale"] = layer.weight_scale.clone()
        else:
            out[name] = tensor
    del tensors
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
        "ignore": ["lm_head"],
    }
    (tmp / "config.json").write_text(json.dumps(config))
    os.replace(tmp, dst)  # the checkpoint appears complete or not at all
    return dst


def save_tiny_moe_model(
    path: str | Path, family: str = "qwen3_moe", seed: int = 0, **overrides: Any
) -> Path:
    """`save_tiny_vllm_model` of a `flashrl.testing.MOE_FAMILIES` family (8 experts, top-2; Qwen3-MoE
    with a dense layer, Qwen2-MoE with its shared expert, Mixtral), with hidden size 128 so that
    head_dim is 32 (vLLM's CPU attention needs head_size % 32 == 0) and weights ~ N(0, 0.2^2) so
    that logits have real spread. `transformers` writes per-expert checkpoint tensors
    (``...experts.{i}.gate_proj.weight``; Mixtral ``...block_sparse_moe.experts.{i}.w1.weight``)."""
    settings: dict[str, Any] = dict(hidden_size=128, initializer_range=0.2)
    settings.update(overrides)
    return save_tiny_vllm_model(path, family=family, seed=seed, **settings)
