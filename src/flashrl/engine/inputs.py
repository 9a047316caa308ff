"""What the engine takes from its caller and from the model directory, checked: prompts, token ids,
sampling parameters, the tokenizer and the EOS ids.

Every bad input is an `InputError` (or a `ConfigError` / `CheckpointError` for a bad file) naming
what was wrong and what is allowed; a float token id is refused, never truncated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrl.core.sampling import SamplingParams, is_integer
from flashrl.errors import CheckpointError, ConfigError, InputError, WeightError
from flashrl.fileio import check_input_file
from flashrl.model.config import TOKEN_IDS_ALLOWED, ModelConfig, read_json, token_ids
from flashrl.model.remote_code import NO_REMOTE_CODE, check_no_custom_code

Prompts = str | Sequence[str] | Sequence[Sequence[int]]
"""One text prompt, a list of them, or a list of token-id lists (lists, tensors or arrays)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


def check_token_ids(ids: object, what: str, vocab_size: int) -> list[int]:
    """`ids` (a list, tuple, integer tensor or array of token ids) as a list of ints in
    [0, vocab_size); anything else is an `InputError` naming `what`."""
    if isinstance(ids, torch.Tensor):
        bad_dtype = ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool
        if bad_dtype or ids.dim() != 1:
            raise InputError(
                f"{what} is a tensor of dtype {ids.dtype} and shape "
                f"{tuple(ids.shape)}; allowed: an integer dtype, 1-D"
            )
        ids = ids.tolist()
    elif isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise InputError(
            f"{what} is {type(ids).__name__}; allowed: a string or a list of token ids"
        )
    for pos, token in enumerate(ids):
        if not is_integer(token) or not 0 <= token < vocab_size:
            reason = "is outside the vocabulary" if is_integer(token) else "is not an integer"
            raise InputError(
                f"{what}: token id {token!r} at position {pos} {reason}; allowed: "
                f"integers in [0, {vocab_size})"
            )
    return [int(t) for t in ids]


def encode_prompts(
    prompts: Prompts, tokenizer: Any, vocab_size: int, max_len: int, model_dir: Path
) -> list[list[int]]:
    """Token ids of every prompt (text through `tokenizer`), each leaving room for a response."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence | torch.Tensor | np.ndarray):
        raise InputError(
            f"prompts must be a string, a list of strings or a list of token-id "
            f"lists, got {type(prompts).__name__}"
        )
    if not len(prompts):
        raise InputError("generate needs at least one prompt; got an empty list")
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise InputError(f"{model_dir} has no tokenizer; pass token ids instead of text")
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = check_token_ids(prompt, f"prompt {i}", vocab_size)
        if not ids:
            raise InputError(f"prompt {i} is empty")
        if len(ids) >= max_len:
            raise InputError(
                f"prompt {i} has {len(ids)} tokens; max_len={max_len} leaves no room "
                f"for a response (prompts may have at most {max_len - 1} tokens; "
                "raise max_len)"
            )
        encoded.append(ids)
    return encoded


def check_pairs(
    prompts: Sequence[object], responses: Sequence[object], vocab_size: int, max_len: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) pairs for teacher forcing: one non-empty response per non-empty
    prompt, each pair within `max_len` tokens."""
    if len(prompts) != len(responses) or not len(prompts):
        raise InputError(
            f"need one response per prompt and at least one pair; got {len(prompts)} "
            f"prompts and {len(responses)} responses"
        )
    encoded = [check_token_ids(p, f"prompt {i}", vocab_size) for i, p in enumerate(prompts)]
    pairs = []
    for i, (p, r) in enumerate(zip(encoded, responses)):
        r = check_token_ids(r, f"response {i}", vocab_size)
        if not p or not r:
            raise InputError(f"{'prompt' if not p else 'response'} {i} is empty")
        if len(p) + len(r) > max_len:
            raise InputError(f"sequence {i} has {len(p) + len(r)} tokens; max_len={max_len}")
        pairs.append((p, r))
    return pairs


def check_params(params: SamplingParams | None, vocab_size: int, model_dir: Path) -> SamplingParams:
    """`params` (None: the defaults), checked to be a `SamplingParams` whose stop tokens exist."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InputError(f"generate params must be a SamplingParams, got {type(params).__name__}")
    beyond = [t for t in params.stop_token_ids if t >= vocab_size]
    if beyond:
        raise InputError(
            f"SamplingParams.stop_token_ids {beyond} are outside the vocabulary "
            f"[0, {vocab_size}) of {model_dir}"
        )
    return params


def load_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's `transformers` tokenizer, or None when the directory has none. A tokenizer
    file that is a device, a pipe or a directory (a link to /dev/zero, say) is a `CheckpointError`
    naming it, as is one that is not valid JSON."""
    for name in (*_TOKENIZER_FILES, *_TOKENIZER_JSON):
        if os.path.lexists(model_dir / name):
            check_input_file(
                model_dir / name, "tokenizer file", "a regular file", error=CheckpointError
            )
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # heavy: only when there is a tokenizer

    check_no_custom_code(model_dir)  # never import code from the folder
    try:
        return AutoTokenizer.from_pretrained(model_dir, **NO_REMOTE_CODE)
    except Exception as err:  # name the damaged file when a JSON file is the cause
        for name in _TOKENIZER_JSON:
            path = model_dir / name
            if path.is_file():
                try:
                    json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as json_err:
                    raise CheckpointError(f"{path} is not valid JSON ({json_err})") from err
        raise CheckpointError(
            f"{model_dir}: the tokenizer does not load ({type(err).__name__}: {err})"
        ) from err


def eos_token_ids(model_dir: Path, config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """Every EOS id the checkpoint names: config.json, generation_config.json and the tokenizer."""
    ids = set(config.eos_token_ids)
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        raw = read_json(generation)
        if not isinstance(raw, dict):
            raise ConfigError(f"{generation} must be a JSON object, got {type(raw).__name__}")
        eos = token_ids(raw.get("eos_token_id"))
        if eos is None:
            raise ConfigError(
                f"{generation}: eos_token_id={raw.get('eos_token_id')!r} is invalid; "
                f"allowed: {TOKEN_IDS_ALLOWED}"
            )
        ids |= set(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def check_sequence(token_ids: object, vocab_size: int, max_len: int) -> list[int]:
    """One whole sequence of token ids (`check_token_ids`) of 1 to `max_len` tokens."""
    ids = check_token_ids(token_ids, "sequence", vocab_size)
    if not 1 <= len(ids) <= max_len:
        raise InputError(f"sequence has {len(ids)} tokens; allowed: 1 to max_len={max_len}")
    return ids


def named_tensor_pairs(named_tensors: object) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a dict or an iterable of pairs, as a list; an item that is not a
    pair is a `WeightError` naming its index (the tensors themselves are checked by the caller)."""
    items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    for i, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise WeightError(
                f"update_weights item {i} must be a (name, tensor) pair, got {type(item).__name__}"
            )
    return [tuple(item) for item in items]
