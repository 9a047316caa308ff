"""The `vllm` check of `flashrl verify`: a vLLM engine on checkpoint A, `WeightUpdater.update_weights` of
checkpoint B, and a fresh vLLM engine on B give the same greedy tokens and logprobs (SKIP when vLLM
is not installed)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from flashrl.tools.verify_context import SKIP, TINY_MODEL, CheckFailed, VerifyContext, token_ids


@contextmanager
def _environ(values: Mapping[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_vllm(ctx: VerifyContext, scheme: str) -> str | tuple[str, str]:
    """vLLM engine on A + WeightUpdater.update_weights(B) gives the greedy tokens and logprobs of a fresh
    engine on B."""
    if importlib.util.find_spec("vllm") is None:
        return SKIP, "vLLM is not installed (see docs/vllm.md, Install)"
    from flashrl.vllm_backend.testing import TEST_ENV, load_state_dict, save_char_tokenizer

    for name in ("a", "b"):
        save_char_tokenizer(ctx.checkpoint(name), vocab_size=TINY_MODEL["vocab_size"])
    env = {
        **{k: os.environ.get(k, v) for k, v in TEST_ENV.items()},
        "FLASHRL_CONFIG": None,
        "FLASHRL_LMHEAD_FP32": None,
    }
    with _environ(env):
        import vllm

        from flashrl.vllm_backend import WeightUpdater, engine_kwargs

        kwargs = dict(
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=64,
            seed=0,
            max_num_seqs=8,
            trust_remote_code=False,
            **engine_kwargs(scheme),
        )
        fresh = vllm.LLM(str(ctx.checkpoint("b")), **kwargs)
        try:
            expected = _greedy_outputs(vllm, fresh)
        finally:
            fresh.llm_engine.engine_core.shutdown()
        llm = vllm.LLM(str(ctx.checkpoint("a")), **kwargs)
        try:
            before = _greedy_outputs(vllm, llm)
            WeightUpdater(llm).update_weights(load_state_dict(ctx.checkpoint("b")).items())
            after = _greedy_outputs(vllm, llm)
        finally:
            llm.llm_engine.engine_core.shutdown()
    if before == expected:
        raise CheckFailed(
            "checkpoints A and B give the same vLLM outputs: the check would prove nothing"
        )
    if after != expected:
        raise CheckFailed(
            f"{scheme}: greedy outputs after WeightUpdater.update_weights differ from a fresh vLLM engine"
        )
    return (
        f"vLLM {vllm.__version__}, {scheme}: greedy tokens and logprobs after an update equal a "
        f"fresh engine"
    )


def _greedy_outputs(vllm: Any, llm: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs of `llm` on three fixed token-id prompts."""
    params = vllm.SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in token_ids(5, [3, 7, 12])]
    return [
        (list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
        for out in llm.generate(prompts, params, use_tqdm=False)
        for c in out.outputs
    ]
