"""`load_causal_lm`: a transformers model from a folder, with the errors of its weight files named.

`transformers.AutoModelForCausalLM.from_pretrained` reads a ``pytorch_model.bin`` with
``torch.load(weights_only=True)``. A file that is not a valid archive (damaged, truncated, or a
pickle that needs code to load) then surfaces as a multi-line ``UnpicklingError``, a
``RuntimeError`` or even an ``IndexError`` from inside `torch.load`, naming no file; here it is a
one-line `CheckpointError` naming the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from flashrl.errors import CheckpointError
from flashrl.model.remote_code import NO_REMOTE_CODE

_TORCH_LOADERS = ("torch/serialization.py", "torch/_weights_only_unpickler.py")
"""Where `torch.load` runs: an exception raised there is about the file it reads."""


def load_causal_lm(path: str | Path, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` with ``trust_remote_code=False``; a
    ``*.bin`` weights file torch cannot load is a `CheckpointError` naming it."""
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs, **NO_REMOTE_CODE)
    except Exception as err:
        if not isinstance(err, (pickle.UnpicklingError, EOFError)) and not _in_torch_load(err):
            raise  # not a problem of the weights file: keep the traceback
        files = sorted(Path(path).glob("*.bin")) or [Path(path)]
        raise CheckpointError(
            f"{', '.join(map(str, files))}: not a valid PyTorch weights archive "
            f"({_reason(str(err)) or type(err).__name__}); it is damaged, truncated or holds "
            f"objects other than tensors (never loaded: that could run code). Replace it, or "
            f"save the model as safetensors with save_pretrained(DIR)"
        ) from None


def _in_torch_load(err: BaseException) -> bool:
    """Whether `err` was raised inside `torch.load` (the weights-only unpickler raises IndexError,
    KeyError, ... on garbage), not by an out-of-memory error or a bug elsewhere."""
    if isinstance(err, MemoryError) or "out of memory" in str(err):
        return False
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(_TORCH_LOADERS):
            return True
        tb = tb.tb_next
    return False


def _reason(text: str) -> str:
    """The informative part of torch's error: the unpickler's complaint, else the first
    sentence."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            detail = line.partition("WeightsUnpickler error:")[2].strip()
            return detail or (lines[i + 1] if i + 1 < len(lines) else "")
    return lines[0].split(". ")[0].rstrip(".") if lines else ""
