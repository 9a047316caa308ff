"""`flashrl train`: every `TrainConfig` field as a dotted flag (``--algo.lr``), then
`flashrl.rl.run.run`. A flat flag of flashrl 0.1 (``--rollout-quant``) is refused, naming its new
flag."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from flashrl.errors import ConfigError
from flashrl.rl import run as rl_run
from flashrl.rl.config import GROUPS, TrainConfig
from flashrl.rl.config_build import ROLLOUT_FILE, build_config
from flashrl.rl.presets import PRESETS
from flashrl.rl.renamed import RENAMED, refuse
from flashrl.tools.args import add_fields
from flashrl.tools.checks import check_device
from flashrl.vllm_backend.install_check import require_vllm


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="GRPO/DAPO training with quantized rollouts (default: tiny task on CPU)",
        description="RL training: rollouts with a quantized engine, per-step weight "
        "update and rollout correction. With no arguments, trains the "
        "built-in tiny model on CPU.",
        epilog="Every TrainConfig field is a flag --group.field VALUE (defaults "
        "below are the dataclass's; the preset sets some). The flat flags of "
        "flashrl 0.1 (--rollout-quant, --tis-cap, ...) are refused, naming "
        "the new flag, as are the rollout settings that moved from run to rollout "
        "(--run.backend, --rollout-workers, ...). Example: flashrl train --rollout.quant fp8 "
        "--run.steps 20 --correction.weight none. Rollout workers on Ray: "
        "--rollout.workers.count N (--rollout.workers.address auto, "
        "--rollout.workers.async-rollouts; docs/distributed.md).",
    )
    p.add_argument(
        "--preset",
        default="tiny-cpu",
        help=f"named preset: {', '.join(PRESETS)} (default: tiny-cpu)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML file of TrainConfig fields, nested like the flags (over the preset)",
    )
    add_fields(p, TrainConfig, only=("model",))
    for group, cls in GROUPS.items():
        flags = p.add_argument_group(f"{group} ({cls.__name__})")
        add_fields(flags, cls, prefix=f"{group}.")
        if group == "rollout":
            flags.add_argument(
                f"--{ROLLOUT_FILE}",
                dest=ROLLOUT_FILE,
                default=argparse.SUPPRESS,
                metavar="FILE",
                help="a rollout config (flashrl.yaml from `flashrl "
                "setup`, or a scheme) as the base of this group",
            )
    p.set_defaults(run=run_train, accepts_overrides=True)


def parse_overrides(tokens: Sequence[str]) -> dict[str, str]:
    """Flags argparse does not know, as overrides: ['--x.y', '2', '--z'] -> {'x.y': '2', 'z':
    'true'} (a flag with no value means 'true'). These are unknown keys (`build_config` refuses
    them, naming the allowed ones); an old flag (flashrl 0.1's ``--rollout-quant``, a moved
    ``--run.backend``) is a ConfigError naming its new flag."""
    out: dict[str, str] = {}
    renamed: list[str] = []
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
        name = key.replace("-", "_")
        out[name] = value
        if name in RENAMED:
            renamed.append("--" + key)
        i += 1
    if renamed:
        raise refuse(renamed, flags=True)
    return out


def run_train(args: argparse.Namespace) -> int:
    dotted = {k: v for k, v in vars(args).items() if k == "model" or "." in k}
    overrides = {**parse_overrides(args.overrides), **dotted}
    config = build_config(args.preset, args.config, overrides)
    check_device(config.run.device, "--run.device")
    out = Path(config.run.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"run.output_dir={config.run.output_dir!r} is a file; expected a "
            f"directory (created if missing)"
        )
    r = config.rollout
    if r.backend == "vllm" and not r.workers.count:  # the workers check their own
        require_vllm("--rollout.backend vllm")
    rl_run.run(config)
    return 0
