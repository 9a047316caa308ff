"""The `flashrl` command: `main(argv) -> exit code`, one function pair per subcommand.

    flashrl generate --model DIR --quant int8 --prompt "..." [--logprobs]
    flashrl bench    --model DIR | --random-weights NAME --quant bf16,int8,fp8 --batch 16 --output-len 128
    flashrl train    [--preset tiny-cpu] [--config FILE.yaml] [--any-config-field VALUE ...]
    flashrl profile  --model DIR --quant int8[,fp8,...] [--prompts FILE] [--kv-cache-dtype fp8] --out profile.json
    flashrl setup    --profile profile.json [--quant SCHEME] --out flashrl.yaml
    flashrl verify   [--device cuda] [--quant int8,fp8] [--no-vllm]

Errors (docs/reliability.md): a bad input (`flashrl.errors.FlashRLError`, a YAML or safetensors error,
an OS error on a path) prints one line ``flashrl <cmd>: error: <message>`` and exits 2, before any work
where it can be checked up front (device, output paths, FLASHRL_* variables). Anything else is a bug
and keeps its traceback; ``-v`` shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flashrl.errors import ConfigError, FlashRLError, InputError, UnsupportedError
from flashrl.fileio import atomic_write_text
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.quant.schemes import SCHEMES

logger = logging.getLogger("flashrl")

UserError = ConfigError
"""The CLI's former error type, kept as a name for `ConfigError`."""

_DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda when available)"


def _common_engine_args(p: argparse.ArgumentParser, quant_help: str) -> None:
    p.add_argument("--quant", default=None, help=quant_help)
    p.add_argument("--device", default=None, help=_DEVICE_HELP)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="activation dtype (default: bf16)")


# ------------------------------------------------------------------------------------------ checks before the work


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse a device this machine cannot run (ConfigError for a bad name, UnsupportedError for CUDA
    without CUDA) before a model is loaded."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"{flag} {device!r} is invalid; allowed: cpu, cuda or cuda:N")
    if parsed.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = (f"this torch {torch.__version__} is built without CUDA" if torch.version.cuda is None
               else f"no CUDA GPU is visible to torch {torch.__version__} (CUDA {torch.version.cuda})")
        raise UnsupportedError(f"{flag} {device}: CUDA is not available on this machine ({why}); use --device cpu")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise UnsupportedError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                               f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    except OSError:
        return False


def check_output(flag: str, out: str | None, inputs: Mapping[str, str | None] | None = None) -> None:
    """Refuse an output path that the write at the end would fail on or that would destroy an input:
    an existing directory, a missing or read-only parent directory, or the same file as an input."""
    if not out:
        return
    path = Path(out).expanduser()
    if path.is_dir():
        raise ConfigError(f"{flag} {out}: is a directory; give a file path")
    for input_flag, value in (inputs or {}).items():
        if value and _same_file(path, Path(value).expanduser()):
            raise ConfigError(f"{flag} {out}: is the same file as {input_flag} {value}; writing it would destroy "
                              f"the input: choose another {flag}")
    parent = Path(os.path.realpath(path)).parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {out}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {out}: directory {str(parent)!r} is not writable")


def check_environment() -> None:
    """Validate every FLASHRL_* variable (ConfigError naming it) before the work starts."""
    from flashrl.config import from_env
    from flashrl.quant.kernels import get_mode

    from_env()
    get_mode()


def preflight(args: argparse.Namespace) -> None:
    """The checks every subcommand gets before its work: the device and the output file."""
    check_device(getattr(args, "device", None))
    if getattr(args, "out", None):
        inputs = {f"--{name.replace('_', '-')}": getattr(args, name) for name in getattr(args, "inputs", ())}
        check_output("--out", args.out, inputs)


def _strict_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by None: `json.dumps(allow_nan=False)` then never
    writes NaN / Infinity, which are not JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON text (non-finite numbers as null)."""
    return json.dumps(_strict_json(value), allow_nan=False, **kwargs)


# ------------------------------------------------------------------------------------------ generate


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample responses with a quantized rollout engine",
                       description="Sample responses with the built-in engine; prints text and, with --logprobs, "
                                   "the processed logprob of every sampled token.")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (safetensors)")
    _common_engine_args(p, f"weight scheme: {', '.join(SCHEMES)} or a flashrl.yaml (default: FLASHRL_CONFIG or bf16)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    prompt.add_argument("--prompt-ids", action="append",
                        help="comma-separated token ids, e.g. 5,9,17 (repeat for several)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", action="store_true", help="print each token's processed logprob")
    p.add_argument("--json", action="store_true",
                   help="print the rollouts as JSON lines (strict JSON: a logprob that is not finite, e.g. -inf, "
                        "is null)")
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
            raise InputError(f"{flag} {text!r}: {item!r} is not an integer; token ids are comma-separated "
                             f"integers, e.g. {flag} 5,9,17") from None
    if not ids:
        raise InputError(f"{flag} {text!r} holds no token id; token ids are comma-separated integers, "
                         f"e.g. {flag} 5,9,17")
    return ids


def run_generate(args: argparse.Namespace) -> int:
    prompts = args.prompt or [parse_prompt_ids(ids) for ids in args.prompt_ids]
    from flashrl.engine import Engine, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens,
                            n=args.n, seed=args.seed, ignore_eos=args.ignore_eos)
    engine = Engine(args.model, quant=args.quant, dtype=args.dtype, device=args.device,
                    max_batch=max(1, min(64, len(prompts) * args.n)))
    for r in engine.generate(prompts, params):
        if args.json:
            print(dumps(dict(prompt_index=r.prompt_index, sample_index=r.sample_index, text=r.text,
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
    p.add_argument("--kv-cache-dtype", default="bf16",
                   help="comma-separated KV-cache dtypes (bf16, fp8); each scheme runs with each. fp8 rows report "
                        "kv_kl, the KL to an unquantized cache, and kv_calib_s, the scale recalibration time")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="KV-cache budget in GiB: report max_sequences (prompt + output length) that fit in it")
    p.add_argument("--compile", default="none",
                   help="comma-separated decode-step modes, each a row per scheme: none (eager) or a torch.compile mode "
                        "(default, reduce-overhead = CUDA graphs, max-autotune, max-autotune-no-cudagraphs); compiled rows "
                        "warm up with one full run (warmup_s)")
    p.add_argument("--decode-buckets", choices=["auto", "on", "off"], default="auto",
                   help="pad decode steps to shape buckets (auto: only when compiled)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="padded prompt tokens per prefill forward (default: the engine's, 16384); bounds prefill memory")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default=None, help=_DEVICE_HELP)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf", action="store_true", help="also time transformers generate on the same prompts")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--out", default="bench.json",
                   help="JSON output file ('' for none; non-finite numbers are written as null)")
    p.set_defaults(run=run_bench, inputs=("random_weights",))


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from flashrl.bench import BenchConfig, format_rows, run_bench as bench

    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads {args.threads} is invalid; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    cfg = BenchConfig(model=args.model, random_weights=args.random_weights, quant=args.quant, batch=args.batch,
                      prompt_len=args.prompt_len, output_len=args.output_len, device=args.device, dtype=args.dtype,
                      seed=args.seed, hf=args.hf, out=args.out, kv_cache_dtype=args.kv_cache_dtype,
                      kv_budget_gib=args.kv_budget_gib, compile=args.compile,
                      decode_buckets={"auto": None, "on": True, "off": False}[args.decode_buckets],
                      max_prefill_tokens=args.max_prefill_tokens)
    result = bench(cfg)
    print(format_rows(result["rows"]))
    print(f"device: {result['device']}; copy bandwidth {result['copy_bandwidth_gbs']:.1f} GB/s; "
          f"batch {cfg.batch}, prompt {cfg.prompt_len}, output {cfg.output_len} tokens"
          + (f"; max_sequences for a {cfg.kv_budget_gib:g} GiB KV budget" if cfg.kv_budget_gib is not None else ""))
    if args.out:
        atomic_write_text(args.out, dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


# ------------------------------------------------------------------------------------------ train


def add_train(sub: argparse._SubParsersAction) -> None:
    from flashrl.rl.config import TrainConfig
    from flashrl.rl.presets import PRESETS

    fields = ", ".join(f"--{name.replace('_', '-')}" for name in TrainConfig.__dataclass_fields__)
    p = sub.add_parser("train", help="GRPO/DAPO training with quantized rollouts (default: tiny task on CPU)",
                       description="RL training: rollouts with a quantized engine, per-step weight sync and rollout "
                                   "correction. With no arguments, trains the built-in tiny model on CPU.",
                       epilog=f"Every TrainConfig field is a flag taking a value: {fields}. "
                              "Example: flashrl train --rollout-quant fp8 --steps 20 --tis-cap 0")
    p.add_argument("--preset", default="tiny-cpu", help=f"named preset: {', '.join(PRESETS)} (default: tiny-cpu)")
    p.add_argument("--config", default=None, help="YAML file of TrainConfig fields (applied over the preset)")
    p.set_defaults(run=run_train, accepts_overrides=True)


def parse_overrides(tokens: Sequence[str]) -> dict[str, str]:
    """['--rollout-quant', 'fp8', '--plot=false'] -> {'rollout_quant': 'fp8', 'plot': 'false'}; a flag
    with no value means 'true'."""
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) <= 2:
            raise ConfigError(f"unexpected argument {token!r}; overrides look like --key value")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value, i = tokens[i + 1], i + 1
            else:
                value = "true"
        out[key.replace("-", "_")] = value
        i += 1
    return out


def run_train(args: argparse.Namespace) -> int:
    from flashrl.rl.config import build_config
    from flashrl.rl.run import run

    config = build_config(args.preset, args.config, parse_overrides(args.overrides))
    check_device(config.device, "device")
    if Path(config.output_dir).exists() and not Path(config.output_dir).is_dir():
        raise ConfigError(f"output_dir={config.output_dir!r} is a file; expected a directory (created if missing)")
    run(config)
    return 0


# ------------------------------------------------------------------------------------------ profile


def add_profile(sub: argparse._SubParsersAction) -> None:
    from flashrl.config import KV_CACHE_DTYPES
    from flashrl.profile import DEFAULT_THRESHOLD

    p = sub.add_parser("profile", help="per-layer quantization error, end-to-end mismatch and a bf16 skip list",
                       description="Measure how much each scheme distorts a bf16 checkpoint: per linear layer the "
                                   "relative weight and output error on calibration activations, end to end the "
                                   "mismatch of next-token distributions (correction-module metric names), a "
                                   "recommended skip list and the mismatch after skipping, weight memory. Prints a "
                                   "table; writes JSON for `flashrl setup` (fields: docs/profile.md).")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (bf16/fp32 safetensors)")
    p.add_argument("--quant", default="int8",
                   help=f"comma-separated schemes to profile: {', '.join(s for s in SCHEMES if s != 'bf16')} (default: int8)")
    p.add_argument("--prompts", default=None,
                   help="calibration prompts: .txt (one per line) or .jsonl (strings or {\"prompt\": ...}); "
                        "default: the built-in set (seeded random token ids for a model without a tokenizer)")
    p.add_argument("--kv-cache-dtype", default="bf16", choices=KV_CACHE_DTYPES,
                   help="also quantize the KV cache (fp8) and report its share of the mismatch")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"relative output error above which a layer is kept in bf16 (default: {DEFAULT_THRESHOLD})")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="prompts are cut to this many tokens (default: 128)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="sampled response length (default: 64)")
    p.add_argument("--lm-head-fp32", action="store_true", help="profile with the LM head and logits in fp32")
    p.add_argument("--device", default=None, help=_DEVICE_HELP)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="activation dtype (default: bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="profile.json", help="JSON output file (default: profile.json)")
    p.set_defaults(run=run_profile, inputs=("prompts",))


def run_profile(args: argparse.Namespace) -> int:
    from flashrl.profile import ProfileConfig, format_profile, run_profile as profile, write_profile

    result = profile(ProfileConfig(model=args.model, quant=args.quant, prompts=args.prompts,
                                   kv_cache_dtype=args.kv_cache_dtype, threshold=args.threshold,
                                   max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                                   device=args.device, dtype=args.dtype, lm_head_fp32=args.lm_head_fp32, seed=args.seed))
    print(format_profile(result))
    write_profile(result, args.out)
    print(f"wrote {args.out}; next: flashrl setup --profile {args.out} --out flashrl.yaml")
    return 0


# ------------------------------------------------------------------------------------------ setup


def add_setup(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("setup", help="write a rollout config (flashrl.yaml) from a profile",
                       description="Turn a `flashrl profile` JSON into a rollout config: scheme, skip list, KV-cache "
                                   "dtype and scale mode, lm_head_fp32, logprob mode. Use it with "
                                   "FLASHRL_CONFIG=flashrl.yaml, Engine(model, quant='flashrl.yaml'), "
                                   "`flashrl generate --quant flashrl.yaml` or rollout_config in a train config.")
    p.add_argument("--profile", required=True, help="JSON written by `flashrl profile`")
    p.add_argument("--quant", default=None, help="the scheme to use, among the profiled ones (needed when several were)")
    p.add_argument("--threshold", type=float, default=None,
                   help="re-derive the skip list from the per-layer errors at this threshold (default: the profile's)")
    p.add_argument("--out", default="flashrl.yaml", help="YAML output file (default: flashrl.yaml)")
    p.set_defaults(run=run_setup, inputs=("profile",))


def run_setup(args: argparse.Namespace) -> int:
    from flashrl.profile import run_setup as setup

    config = setup(args.profile, args.out, quant=args.quant, threshold=args.threshold)
    kept = [name for name in config.skip if name not in DEFAULT_SKIP]
    print(f"wrote {args.out}: quant={config.quant}, {len(kept)} tensor(s) kept in bf16 besides the defaults, "
          f"kv_cache_dtype={config.kv_cache_dtype}, lm_head_fp32={config.lm_head_fp32}")
    for name in kept:
        print(f"  skip {name}")
    print(f"use: FLASHRL_CONFIG={args.out} python your_script.py   (or Engine(model, quant={args.out!r}))")
    return 0


# ------------------------------------------------------------------------------------------ verify


def add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="deterministic self-test of the install on this device (PASS/FAIL table)",
                       description="Check this install on this device with tiny built-in models: GEMM kernels vs "
                                   "references, reload exactness (update vs fresh load), logprob exactness vs float64 "
                                   "recomputation, KV-cache path vs full forward, and the vLLM backend if installed. "
                                   "Exits 1 if any check fails; SKIP rows (e.g. a scheme this GPU cannot run) do not.")
    p.add_argument("--device", default=None, help=_DEVICE_HELP)
    p.add_argument("--quant", default=None, help=f"comma-separated schemes to check (default: all: {', '.join(SCHEMES)})")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM backend check even if vLLM is installed")
    p.add_argument("--out", default=None, help="also write the results as JSON to this file")
    p.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    import time

    import torch

    from flashrl.quant.schemes import parse_scheme_list
    from flashrl.verify import exit_code, format_results, results_json, run_verify as verify

    schemes = [s.name for s in parse_scheme_list(args.quant)] if args.quant else None
    start = time.perf_counter()
    results = verify(device=args.device, schemes=schemes, vllm=not args.no_vllm)
    seconds = time.perf_counter() - start
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(format_results(results, device, seconds))
    if args.out:
        atomic_write_text(args.out, dumps(results_json(results, device, seconds), indent=2) + "\n")
        print(f"wrote {args.out}")
    return exit_code(results)


# ------------------------------------------------------------------------------------------ main

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_generate, add_bench, add_train, add_profile,
                                                                    add_setup, add_verify]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashrl", description="Fast RL for LLMs with 8-bit rollouts.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level; show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def user_error_message(err: BaseException) -> str | None:
    """The one-line message for an error caused by the user's input or files; None for anything else
    (a bug, which keeps its traceback)."""
    if isinstance(err, FlashRLError):
        message = str(err)
    elif isinstance(err, OSError) and (err.filename is not None or isinstance(err, _PATH_ERRORS)
                                       or err.errno in _DISK_ERRNOS):
        if err.filename is not None and err.strerror:
            files = f"{err.filename} -> {err.filename2}" if err.filename2 is not None else f"{err.filename}"
            message = f"{files}: {err.strerror}"
        else:
            message = str(err)
    elif _is_yaml_error(err):
        from flashrl.config import yaml_problem

        message = f"not valid YAML ({yaml_problem(err)})"
    elif _is_safetensors_error(err):
        message = f"not a valid safetensors file ({err})"
    else:
        return None
    return " ".join(message.split())


_PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def _is_yaml_error(err: BaseException) -> bool:
    import yaml

    return isinstance(err, yaml.YAMLError)


def _is_safetensors_error(err: BaseException) -> bool:
    try:
        from safetensors import SafetensorError
    except ImportError:  # older safetensors
        return False
    return isinstance(err, SafetensorError)


def main(argv: Sequence[str] | None = None) -> int:
    from flashrl.config import configure_logging

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
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
        check_environment()
        preflight(args)
        return args.run(args)
    except Exception as err:
        message = user_error_message(err)
        if message is None or args.verbose:
            raise
        print(f"flashrl {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
