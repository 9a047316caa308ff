"""The `flashrl` command: `main(argv) -> exit code`, one function pair per subcommand.

    flashrl generate --model DIR --quant int8 --prompt "..." [--logprobs]
    flashrl bench    --model DIR | --random-weights NAME --quant bf16,int8,fp8 --batch 16
    flashrl train    [--preset tiny-cpu] [--config FILE.yaml] [--group.field VALUE ...]
    flashrl profile  --model DIR --quant int8[,fp8,...] [--prompts FILE] --out profile.json
    flashrl setup    --profile profile.json [--quant SCHEME] --out flashrl.yaml
    flashrl verify   [--device cuda] [--quant int8,fp8] [--no-vllm]
    flashrl convert  SRC.gguf OUT [--dtype bf16]

Every subcommand's flags come from a dataclass (`flashrl.tools.args`): `GenerateFlags` and
`SamplingParams` (`flashrl.tools.generate`), `BenchConfig`, `TrainConfig` (dotted: ``--algo.lr``,
`flashrl.tools.train`), `ProfileConfig`, `SetupConfig`, `VerifyConfig`.

Errors (docs/reliability.md): a bad input (`flashrl.errors.FlashRLError`, a YAML or safetensors
error, an OS error on a path) prints one line ``flashrl <cmd>: error: <message>`` and exits 2,
before any work where it can be checked up front (device, output paths, FLASHRL_* variables).
Anything else is a bug and keeps its traceback; ``-v`` shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys
import time
from collections.abc import Callable, Sequence

import yaml
from safetensors import SafetensorError

from flashrl.core.config import yaml_problem
from flashrl.core.device import resolve_device
from flashrl.core.env import configure_logging
from flashrl.errors import ConfigError, FlashRLError
from flashrl.fileio import atomic_write_text
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.quant.schemes import SCHEMES, parse_scheme_list
from flashrl.tools import bench as bench_tool
from flashrl.tools import profile as profile_tool
from flashrl.tools import setup as setup_tool
from flashrl.tools import verify as verify_tool
from flashrl.tools.args import add_fields, build
from flashrl.tools.checks import check_environment, dumps, preflight
from flashrl.tools.convert import add_convert
from flashrl.tools.generate import add_generate
from flashrl.tools.profile_report import format_profile
from flashrl.tools.train import add_train

logger = logging.getLogger("flashrl")

UserError = ConfigError
"""The CLI's former error type, kept as a name for `ConfigError`."""


# ------------------------------------------------------------------------------------------ bench


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="rollout throughput per precision (fixed output length)",
        description="Generate the same prompts with each scheme (EOS ignored, fixed "
        "output length) and report tokens/s, ratio to the first scheme, "
        "TTFT, weight-update transfer and requantize time, memory.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    add_fields(source, bench_tool.BenchConfig, only=("model", "random_weights"))
    add_fields(p, bench_tool.BenchConfig, skip=("model", "random_weights"))
    # the default output file is checked before the work like a given one
    p.set_defaults(run=run_bench, inputs=("random_weights",), out=bench_tool.BenchConfig.out)


def run_bench(args: argparse.Namespace) -> int:
    cfg = build(bench_tool.BenchConfig, args)
    result = bench_tool.run_bench(cfg)
    print(bench_tool.format_rows(result.rows))
    budget = (
        f"; max_sequences for a {cfg.kv_budget_gib:g} GiB KV budget"
        if cfg.kv_budget_gib is not None
        else ""
    )
    print(
        f"device: {result.device}; copy bandwidth {result.copy_bandwidth_gbs:.1f} GB/s; "
        f"batch {cfg.batch}, prompt {cfg.prompt_len}, output {cfg.output_len} tokens{budget}"
    )
    if cfg.out:
        atomic_write_text(cfg.out, dumps(result.to_dict(), indent=2) + "\n")
        print(f"wrote {cfg.out}")
    return 0


# ------------------------------------------------------------------------------------------ profile


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="per-layer quantization error, end-to-end mismatch and a bf16 skip list",
        description="Measure how much each scheme distorts a bf16 checkpoint: "
        "per linear layer the relative weight and output error on "
        "calibration activations, end to end the mismatch of next-token "
        "distributions (correction-module metric names), a recommended "
        "skip list and the mismatch after skipping, weight memory. "
        "Prints a table; writes JSON for `flashrl setup` (fields: "
        "docs/profile.md).",
    )
    add_fields(p, profile_tool.ProfileConfig)
    p.add_argument("--out", default="profile.json", help="JSON output file (default: profile.json)")
    p.set_defaults(run=run_profile, inputs=("prompts",))


def run_profile(args: argparse.Namespace) -> int:
    result = profile_tool.run_profile(build(profile_tool.ProfileConfig, args))
    print(format_profile(result.to_dict()))
    profile_tool.write_profile(result, args.out)
    print(f"wrote {args.out}; next: flashrl setup --profile {args.out} --out flashrl.yaml")
    return 0


# ------------------------------------------------------------------------------------------ setup


def add_setup(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "setup",
        help="write a rollout config (flashrl.yaml) from a profile",
        description="Turn a `flashrl profile` JSON into a rollout config: "
        "scheme, skip list, KV-cache dtype and scale mode, "
        "lm_head_fp32, logprob mode. Use it with "
        "FLASHRL_CONFIG=flashrl.yaml, Engine(model, "
        "'flashrl.yaml'), `flashrl generate --quant flashrl.yaml` "
        "or --rollout.file in `flashrl train`.",
    )
    add_fields(p, setup_tool.SetupConfig)
    p.set_defaults(run=run_setup, inputs=("profile",))


def run_setup(args: argparse.Namespace) -> int:
    cfg = build(setup_tool.SetupConfig, args)
    config = setup_tool.run_setup(cfg.profile, cfg.out, quant=cfg.quant, threshold=cfg.threshold)
    kept = [name for name in config.skip if name not in DEFAULT_SKIP]
    print(
        f"wrote {cfg.out}: quant={config.quant}, {len(kept)} tensor(s) kept in bf16 besides the "
        f"defaults, kv_cache_dtype={config.kv_cache_dtype}, lm_head_fp32={config.lm_head_fp32}"
    )
    for name in kept:
        print(f"  skip {name}")
    print(f"use: FLASHRL_CONFIG={cfg.out} python your_script.py   (or Engine(model, {cfg.out!r}))")
    return 0


# ------------------------------------------------------------------------------------------ verify


def add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="deterministic self-test of the install on this device (PASS/FAIL)",
        description="Check this install on this device with tiny built-in "
        "models: GEMM kernels vs references, update exactness (update "
        "vs fresh load), logprob exactness vs float64 recomputation, "
        "KV-cache path vs full forward, and the vLLM backend if "
        "installed. Exits 1 if any check fails; SKIP rows (e.g. a "
        "scheme this GPU cannot run) do not.",
    )
    schemes = f"comma-separated schemes to check (default: all: {', '.join(SCHEMES)})"
    add_fields(p, verify_tool.VerifyConfig, help={"quant": schemes})
    p.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    cfg = build(verify_tool.VerifyConfig, args)
    schemes = [s.name for s in parse_scheme_list(cfg.quant)] if cfg.quant else None
    start = time.perf_counter()
    results = verify_tool.run_verify(device=cfg.device, schemes=schemes, vllm=not cfg.no_vllm)
    seconds = time.perf_counter() - start
    device = resolve_device(cfg.device)
    print(verify_tool.format_results(results, device, seconds))
    if cfg.out:
        report = verify_tool.results_json(results, device, seconds)
        atomic_write_text(cfg.out, dumps(report, indent=2) + "\n")
        print(f"wrote {cfg.out}")
    return verify_tool.exit_code(results)


# ------------------------------------------------------------------------------------------ main

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_generate,
    add_bench,
    add_train,
    add_profile,
    add_setup,
    add_verify,
    add_convert,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashrl", description="Fast RL for LLMs with 8-bit rollouts."
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO level; show tracebacks"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


_PATH_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def user_error_message(err: BaseException) -> str | None:
    """The one-line message for an error caused by the user's input or files; None for anything
    else (a bug, which keeps its traceback)."""
    if isinstance(err, FlashRLError):
        message = str(err)
    elif isinstance(err, OSError) and (
        err.filename is not None or isinstance(err, _PATH_ERRORS) or err.errno in _DISK_ERRNOS
    ):
        if err.filename is not None and err.strerror:
            files = (
                f"{err.filename} -> {err.filename2}"
                if err.filename2 is not None
                else f"{err.filename}"
            )
            message = f"{files}: {err.strerror}"
        else:
            message = str(err)
    elif isinstance(err, yaml.YAMLError):
        message = f"not valid YAML ({yaml_problem(err)})"
    elif isinstance(err, SafetensorError):
        message = f"not a valid safetensors file ({err})"
    else:
        return None
    return " ".join(message.split())


def resolve_model_flag(args: argparse.Namespace) -> None:
    """A ``--model`` that names a .gguf file or a built-in model becomes its Hugging Face folder
    (converted or built once into the cache); `flashrl train` resolves its own (it may come from
    a preset or a YAML file)."""
    model = getattr(args, "model", None)
    if args.command != "train" and isinstance(model, str):
        if model.startswith("builtin:") or model.lower().endswith(".gguf"):
            from flashrl.rl.presets import resolve_model

            args.model = str(resolve_model(model))


def main(argv: Sequence[str] | None = None) -> int:
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
        resolve_model_flag(args)
        return args.run(args)
    except Exception as err:
        message = user_error_message(err)
        if message is None or args.verbose:
            raise
        print(f"flashrl {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
