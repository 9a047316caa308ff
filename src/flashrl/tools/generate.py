"""`flashrl generate`: sample responses with the built-in engine and print them (text, token ids,
processed logprobs, or strict JSON lines)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import flashrl.engine
from flashrl.core.sampling import SamplingParams
from flashrl.errors import InputError
from flashrl.quant.schemes import SCHEMES
from flashrl.tools.args import add_fields, build, values
from flashrl.tools.checks import dumps


@dataclass
class GenerateFlags:
    """`flashrl generate`'s flags besides the prompts and the sampling parameters."""

    model: str
    """Hugging Face checkpoint directory (safetensors)."""
    quant: str | None = None
    device: str | None = None
    """cpu, cuda or cuda:N (default: cuda when available)."""
    dtype: str = "bf16"
    """Activation dtype: bf16, fp16 or fp32."""
    logprobs: bool = False
    """Print each token's processed logprob."""
    json: bool = False
    """Print the rollouts as JSON lines (strict JSON: a logprob that is not finite, e.g. -inf, is
    null)."""


GENERATE_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "n", "seed", "ignore_eos")
GENERATE_DEFAULTS = {"max_tokens": 64}


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="sample responses with a quantized rollout engine",
        description="Sample responses with the built-in engine; prints text and, "
        "with --logprobs, the processed logprob of every sampled token.",
    )
    quant = (
        f"weight scheme: {', '.join(SCHEMES)} or a flashrl.yaml (default: FLASHRL_CONFIG or bf16)"
    )
    add_fields(p, GenerateFlags, help={"quant": quant})
    add_fields(
        p,
        SamplingParams,
        only=GENERATE_SAMPLING,
        defaults=GENERATE_DEFAULTS,
        help={"n": "samples per prompt"},
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    prompt.add_argument(
        "--prompt-ids",
        action="append",
        help="comma-separated token ids, e.g. 5,9,17 (repeat for several)",
    )
    p.set_defaults(run=run_generate)


def parse_prompt_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    """'5,9,17' -> [5, 9, 17] (empty items are skipped); InputError naming `flag` otherwise."""
    ids = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            ids.append(int(item))
        except ValueError:
            raise InputError(
                f"{flag} {text!r}: {item!r} is not an integer; token ids are "
                f"comma-separated integers, e.g. {flag} 5,9,17"
            ) from None
    if not ids:
        raise InputError(
            f"{flag} {text!r} holds no token id; token ids are comma-separated "
            f"integers, e.g. {flag} 5,9,17"
        )
    return ids


def run_generate(args: argparse.Namespace) -> int:
    flags = build(GenerateFlags, args)
    prompts = args.prompt or [parse_prompt_ids(ids) for ids in args.prompt_ids]
    params = SamplingParams(**{**GENERATE_DEFAULTS, **values(SamplingParams, args)})
    engine_config = flashrl.engine.EngineConfig(
        dtype=flags.dtype, device=flags.device, max_batch=max(1, min(64, len(prompts) * params.n))
    )
    engine = flashrl.engine.Engine(flags.model, flags.quant, engine_config)
    for r in engine.generate(prompts, params):
        if flags.json:
            print(
                dumps(
                    dict(
                        prompt_index=r.prompt_index,
                        sample_index=r.sample_index,
                        text=r.text,
                        response_ids=r.response_ids,
                        logprobs=r.logprobs,
                        finish_reason=r.finish_reason,
                    )
                )
            )
            continue
        print(
            f"[prompt {r.prompt_index} sample {r.sample_index}] ({r.finish_reason}, "
            f"{len(r.response_ids)} tokens, quant={engine.config.quant})"
        )
        tokenizer = engine.tokenizer
        print(r.text if tokenizer is not None else " ".join(map(str, r.response_ids)))
        if flags.logprobs:
            for token, lp in zip(r.response_ids, r.logprobs):
                piece = tokenizer.decode([token]) if tokenizer is not None else ""
                print(f"  {token:>8d} {piece!r:>12} {lp:+.6f}")
    return 0
