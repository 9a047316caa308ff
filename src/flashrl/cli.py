"""The `flashrl` command: `main(argv) -> exit code`, one function pair per subcommand.

    flashrl generate --model DIR --quant int8 --prompt "..." [--logprobs]
    flashrl bench    --model DIR | --random-weights NAME --quant bf16,int8,fp8 --batch 16 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from flashrl.quant.schemes import SCHEMES

logger = logging.getLogger("flashrl")


class UserError(Exception):
    """An error caused by the user's input: printed as one line, exit code 2."""


def _common_engine_args(p: argparse.ArgumentParser, quant_help: str) -> None:
    p.add_argument("--quant", default=None, help=quant_help)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="activation dtype (default: bf16)")


# ------------------------------------------------------------------------------------------ generate


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample responses with a quantized rollout engine",
                       description="Sample responses with the built-in engine; prints text and, with --logprobs, "
                                   "the processed logprob of every sampled token.")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (safetensors)")
    _common_engine_args(p, f"weight scheme: {', '.join(SCHEMES)} or a flashrl.yaml (default: FLASHRL_CONFIG or bf16)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeat for several)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", action="store_true", help="print each token's processed logprob")
    p.add_argument("--json", action="store_true", help="print the rollouts as JSON lines")
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from flashrl.engine import Engine, SamplingParams

    prompts = args.prompt or [[int(t) for t in ids.split(",") if t.strip()] for ids in args.prompt_ids]
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens,
                            n=args.n, seed=args.seed, ignore_eos=args.ignore_eos)
    engine = Engine(args.model, quant=args.quant, dtype=args.dtype, device=args.device,
                    max_batch=max(1, min(64, len(prompts) * args.n)))
    for r in engine.generate(prompts, params):
        if args.json:
            print(json.dumps(dict(prompt_index=r.prompt_index, sample_index=r.sample_index, text=r.text,
                                  response_ids=r.response_ids, logprobs=r.logprobs, finish_reason=r.finish_reason)))
            continue
        print(f"[prompt {r.prompt_index} sample {r.sample_index}] ({r.finish_reason}, {len(r.response_ids)} tokens, "
              f"quant={engine.config.quant})")
        print(r.text if engine.tokenizer is not None else " ".join(map(str, r.response_ids)))
        if args.logprobs:
            for token, lp in zip(r.response_ids, r.logprobs):
                piece = engine.tokenizer.decode([token]) if engine.tokenizer is not None else ""
                print(f"  {token:>8d} {piece!r:>12} {lp:+.6f}")
    return 0


# ------------------------------------------------------------------------------------------ bench


def add_bench(sub: argparse._SubParsersAction) -> None:
    from flashrl.bench import RANDOM_CONFIGS

    p = sub.add_parser("bench", help="rollout throughput per precision (fixed output length)",
                       description="Generate the same prompts with each scheme (EOS ignored, fixed output length) and "
                                   "report tokens/s, ratio to the first scheme, TTFT, weight sync + requant time, memory.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face checkpoint directory")
    src.add_argument("--random-weights", help=f"random weights at real dimensions: {', '.join(RANDOM_CONFIGS)} or a config.json")
    p.add_argument("--quant", default="bf16,int8,fp8,fp8_channel", help="comma-separated schemes; the first is the ratio baseline")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf", action="store_true", help="also time transformers generate on the same prompts")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--out", default="bench.json", help="JSON output file")
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from flashrl.bench import BenchConfig, format_rows, run_bench as bench

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = BenchConfig(model=args.model, random_weights=args.random_weights, quant=args.quant, batch=args.batch,
                      prompt_len=args.prompt_len, output_len=args.output_len, device=args.device, dtype=args.dtype,
                      seed=args.seed, hf=args.hf, out=args.out)
    result = bench(cfg)
    print(format_rows(result["rows"]))
    print(f"device: {result['device']}; copy bandwidth {result['copy_bandwidth_gbs']:.1f} GB/s; "
          f"batch {cfg.batch}, prompt {cfg.prompt_len}, output {cfg.output_len} tokens")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0


# ------------------------------------------------------------------------------------------ main

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_generate, add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashrl", description="Fast RL for LLMs with 8-bit rollouts.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level; show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from flashrl.config import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        configure_logging()
        return args.run(args)
    except (UserError, ValueError, FileNotFoundError, KeyError) as err:
        if args.verbose:
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"flashrl {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
