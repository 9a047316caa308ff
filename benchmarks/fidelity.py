"""Learning fidelity of rollout precisions: `flashrl train` once per (variant, seed), same prompts.

    python benchmarks/fidelity.py                                   # smollm2-arith, 5 variants x 3 seeds
    python benchmarks/fidelity.py --preset tiny-cpu --steps 40 --seeds 0,1,2
    python benchmarks/fidelity.py --report-only                     # aggregate what exists, no training
    python benchmarks/fidelity.py --variants fp32,int8 --algo.lr 1e-5   # --group.key value: to every run

Each variant is a `run.compare` name (`fp32` = the trainer's own precision, the reference; `bf16`,
`int8`, `int8-notis` = int8 without importance weight, `fp8_channel`, ...). Runs go seed-major (every
variant of seed 0, then seed 1, ...) into `<out>/<variant>/seed<k>`, with the train log appended to
`<out>/<variant>/seed<k>.log`, and checkpoint every 5 steps (the last one kept).

Resume: a run whose metrics.jsonl holds every step and whose `checkpoint-<steps>` exists is skipped;
one with any `checkpoint-N` resumes from the latest (`--run.resume latest`); anything else starts
fresh (`--run.overwrite true`). So an interrupted sweep is continued by running the same command
again. A failed run is reported (exit code, end of its log), the sweep goes on, and the script exits
1 at the end.

The report is written every time, also after a partial sweep: per variant the seeds done, start
reward, final reward (mean of the last 10% of steps per seed; mean and standard error over seeds),
whether it is within 2 SE of fp32, mismatch KL and k3 (all steps and last 10%), truncation rate,
response length, fraction of rollout weights changed per weight update, s/step (rollout / train /
weight update); as JSON (with per-step curves: mean and SE over seeds), a Markdown table and a PNG
(one panel per metric, a line with a +-1 SE band per variant). Defaults:
benchmarks/results/fidelity.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from flashrl.errors import CheckpointError, ConfigError
from flashrl.fileio import atomic_write_text
from flashrl.rl.checkpoint import list_checkpoints, read_metrics
from flashrl.rl.compare import compare_variants
from flashrl.rl.config_build import build_config
from flashrl.tools.train import parse_overrides
from flashrl.utils import format_table

NAN = float("nan")
PANELS = [  # (curve name, metrics.jsonl key, panel title, log scale)
    ("reward", "reward/mean", "mean reward", False),
    ("kl", "rollout_corr/kl", "mismatch KL (rollout vs trainer; <= 0 not shown)", True),
    ("k3", "rollout_corr/k3_kl", "mismatch KL, k3 estimator", True),
    (
        "weights_changed_frac",
        "weight_update/weights_changed_frac",
        "weights changed per update",
        False,
    ),
    ("truncated_frac", "response/truncated_frac", "truncation rate", False),
    ("length", "response/length_mean", "mean response length (tokens)", False),
]
COLUMNS = ["variant", "seeds", "partial", "start", "final", "se", "diff_fp32", "within_2se",
           "kl", "kl_last", "k3", "k3_last", "trunc", "length", "w_changed", "codes_changed",
           "dense_changed", "step_s", "rollout_s", "train_s", "weight_update_s"]  # fmt: skip
Run = list[dict[str, Any]]  # the metrics.jsonl rows of one run, sorted by step


# ------------------------------------------------------------------------------------ statistics


def mean(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else NAN


def stderr(values: list[float]) -> float:
    """Standard error of the mean: sample std / sqrt(n); NaN below 2 values."""
    vals = [v for v in values if not math.isnan(v)]
    if len(vals) < 2:
        return NAN
    m = sum(vals) / len(vals)
    return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1) / len(vals))


def window(steps: int) -> int:
    """Steps in the final window: the last 10%, at least 1."""
    return max(1, round(steps / 10))


def run_mean(run: Run, key: str, last: int | None = None) -> float:
    """Mean of `key` over a run's steps (its last `last` steps if given); NaN where absent."""
    rows = run[-last:] if last else run
    return mean([float(r[key]) for r in rows if isinstance(r.get(key), int | float)])


# ------------------------------------------------------------------------------------- the sweep


def flag(key: str) -> str:
    """'rollout.kv_cache_dtype' -> '--rollout.kv-cache-dtype'."""
    return "--" + key.replace("_", "-")


def load_run(run_dir: Path) -> Run:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        rows = read_metrics(path)
    except CheckpointError as err:
        print(f"  {err}", file=sys.stderr)
        return []
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def run_state(run_dir: Path, steps: int) -> str:
    """'skipped' (all steps and checkpoint-<steps>), 'resumed' (a checkpoint-N) or 'fresh'."""
    checkpoints = [step for step, _ in list_checkpoints(run_dir)]
    done = {r["step"] for r in load_run(run_dir)}
    if done >= set(range(steps)) and steps in checkpoints:
        return "skipped"
    return "resumed" if checkpoints else "fresh"


def train_command(
    args: argparse.Namespace, overrides: dict[str, Any], seed: int, run_dir: Path, state: str
) -> list[str]:
    cmd = [sys.executable, "-m", "flashrl.cli", "train", "--preset", args.preset,
           "--run.seed", str(seed), "--run.output-dir", str(run_dir), "--run.save-every", "5",
           "--run.keep-last", "1", "--run.log-weight-changes", "true", "--run.plot", "false"]  # fmt: skip
    for key, value in overrides.items():
        cmd += [flag(key), str(value)]
    if args.steps is not None:
        cmd += ["--run.steps", str(args.steps)]
    cmd += ["--run.resume", "latest"] if state == "resumed" else ["--run.overwrite", "true"]
    return cmd + args.passthrough


def tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join("    " + line for line in text.replace("\r", "\n").splitlines()[-lines:])


def run_one(
    args: argparse.Namespace, name: str, overrides: dict[str, Any], seed: int, steps: int
) -> bool:
    """Train (or skip) one (variant, seed); prints a progress line; False if the run failed."""
    run_dir = Path(args.out) / name / f"seed{seed}"
    log, state = run_dir.parent / f"seed{seed}.log", run_state(run_dir, steps)
    start, code = time.perf_counter(), 0
    if state != "skipped":
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        cmd = train_command(args, overrides, seed, run_dir, state)
        with log.open("a") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
            f.flush()
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    final = run_mean(load_run(run_dir), "reward/mean", window(steps))
    failed = f"  FAILED (exit code {code}); end of {log}:\n{tail(log)}" if code else ""
    print(f"{name:<14} seed {seed}  {state:<8} {seconds:8.1f} s  final reward {final:.4f}{failed}")
    sys.stdout.flush()
    return code == 0


def sweep(args: argparse.Namespace, variants: list[tuple[str, dict]], steps: int) -> list[str]:
    """Every (variant, seed), seed-major; returns the failed runs' names."""
    failed = []
    for seed in args.seed_list:
        for name, overrides in variants:
            if not run_one(args, name, overrides, seed, steps):
                failed.append(f"{name}/seed{seed}")
    return failed


# ------------------------------------------------------------------------------------ the report


def collect(out: Path, names: list[str]) -> dict[str, dict[int, Run]]:
    """variant -> seed -> run, for every `<out>/<variant>/seed*/metrics.jsonl`: the listed
    variants first, then any other found."""
    found = sorted(p.name for p in out.glob("*") if list(p.glob("seed*/metrics.jsonl")))
    runs: dict[str, dict[int, Run]] = {}
    for name in names + [n for n in found if n not in names]:
        for path in sorted((out / name).glob("seed*/metrics.jsonl")):
            seed = path.parent.name[len("seed") :]
            if seed.isdigit() and (run := load_run(path.parent)):
                runs.setdefault(name, {})[int(seed)] = run
    return runs


def variant_row(name: str, seeds: dict[int, Run], steps: int) -> dict[str, Any]:
    """Summary of one variant over its complete seeds (those that reached `steps`)."""
    done = {s: r[:steps] for s, r in seeds.items() if len(r) >= steps}
    runs, last = list(done.values()), window(steps)

    def over(key: str, n: int | None = None) -> float:
        return mean([run_mean(r, key, n) for r in runs])

    finals = [run_mean(r, "reward/mean", last) for r in runs]
    return {
        "variant": name,
        "seeds": len(runs),
        "seed_list": sorted(done),
        "partial": ", ".join(
            f"seed{s}:{len(r)}" for s, r in sorted(seeds.items()) if s not in done
        ),
        "start": mean([float(r[0].get("reward/mean", NAN)) for r in runs]),
        "final": mean(finals),
        "se": stderr(finals),
        "final_per_seed": finals,
        "kl": over("rollout_corr/kl"),
        "kl_last": over("rollout_corr/kl", last),
        "k3": over("rollout_corr/k3_kl"),
        "k3_last": over("rollout_corr/k3_kl", last),
        "trunc": over("response/truncated_frac"),
        "length": over("response/length_mean"),
        "w_changed": over("weight_update/weights_changed_frac"),
        "codes_changed": over("weight_update/codes_changed_frac"),
        "dense_changed": over("weight_update/dense_changed_frac"),
        "step_s": over("time/step_s"),
        "rollout_s": over("time/rollout_s"),
        "train_s": over("time/logprobs_s") + over("time/train_s"),
        "weight_update_s": over("time/weight_update_s"),
    }


def compare_fp32(rows: list[dict[str, Any]]) -> None:
    """Add `diff_fp32` (final - final of fp32) and `within_2se` (|diff| <= 2 sqrt(SE^2 +
    SE_fp32^2); None for fp32 itself or where a SE is missing) to every row."""
    ref = next((r for r in rows if r["variant"] == "fp32"), None)
    for row in rows:
        row["diff_fp32"], row["within_2se"] = NAN, None
        if ref is None or row is ref:
            continue
        row["diff_fp32"] = row["final"] - ref["final"]
        bound = 2 * math.sqrt(row["se"] ** 2 + ref["se"] ** 2)
        if not math.isnan(bound) and not math.isnan(row["diff_fp32"]):
            row["within_2se"] = abs(row["diff_fp32"]) <= bound


def curves(seeds: dict[int, Run], steps: int) -> dict[str, Any]:
    """Per step (0 .. steps-1) the mean and SE over the seeds that reached it, of every curve."""
    by_step = [[r[i] for r in seeds.values() if i < len(r)] for i in range(steps)]
    out: dict[str, Any] = {"step": list(range(steps)), "n": [len(rows) for rows in by_step]}
    for name, key, _, _ in PANELS:
        vals = [[float(r[key]) for r in rows if key in r] for rows in by_step]
        out[name] = {"mean": [mean(v) for v in vals], "se": [stderr(v) for v in vals]}
    return out


def jsonable(value: Any) -> Any:
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


def markdown(rows: list[dict[str, Any]], config: dict[str, Any]) -> str:
    def cell(v: Any) -> Any:
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.3g}" if abs(v) < 1e-2 and v else f"{v:.4f}"
        return "-" if v is None or v == "" else v

    table = format_table([{c: cell(r.get(c)) for c in COLUMNS} for r in rows], COLUMNS)
    steps, last = config["steps"], window(config["steps"])
    return (
        f"Fidelity sweep: preset {config['preset']}, {steps} steps, seeds {config['seeds']}, "
        f"extra flags {' '.join(config['passthrough']) or '-'}.\n\n{table}\n\n"
        f"seeds: runs that reached {steps} steps (partial: seed:steps done, not counted); start: "
        f"reward of step 0; final: mean reward over the last {last} steps, mean over seeds, se: "
        f"its standard error; within_2se: |final - final(fp32)| <= 2 sqrt(se^2 + se_fp32^2); kl, "
        f"k3: mismatch KL rollout vs trainer, all steps / last {last}; w_changed: fraction of "
        f"rollout weights whose stored value changed per weight update; *_s: seconds per step (train = "
        f"logprobs + update).\n"
    )


def plot(report: dict[str, Any], path: Path) -> None:
    """One PNG: a panel per metric, a line with a +-1 SE band per variant; atomic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for ax, (key, _, title, log) in zip(axes.flat, PANELS):
        for name, curve in report["curves"].items():
            pts = [(s, m, e) for s, m, e in zip(curve["step"], curve[key]["mean"], curve[key]["se"])
                   if not math.isnan(m) and not (log and m <= 0)]  # fmt: skip
            if not pts:
                continue
            xs, ms, es = zip(*pts)
            es = [0.0 if math.isnan(e) else e for e in es]
            lo = [max(m - e, m / 10) if log else m - e for m, e in zip(ms, es)]
            (line,) = ax.plot(xs, ms, label=name, lw=1.5)
            ax.fill_between(
                xs, lo, [m + e for m, e in zip(ms, es)], color=line.get_color(), alpha=0.2
            )
        ax.set(title=title, xlabel="step", yscale="log" if log else "linear")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.flat[0].legend(fontsize=9)
    c = report["config"]
    fig.suptitle(f"rollout precision fidelity: {c['preset']}, seeds {c['seeds']} (band: +-1 SE)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def build_report(args: argparse.Namespace, names: list[str], steps: int | None) -> dict[str, Any]:
    """Rows and curves of every run under --out; `steps` None: the longest run's."""
    runs = collect(Path(args.out), names)
    if steps is None:
        steps = max((len(r) for seeds in runs.values() for r in seeds.values()), default=1)
    rows = [variant_row(name, seeds, steps) for name, seeds in runs.items()]
    compare_fp32(rows)
    config = {"preset": args.preset, "steps": steps, "seeds": args.seeds, "out": args.out,
              "variants": names, "passthrough": args.passthrough, "final_window": window(steps)}  # fmt: skip
    curve = {name: curves(seeds, steps) for name, seeds in runs.items()}
    return {"benchmark": "fidelity", "command": " ".join(sys.argv), "config": config,
            "rows": rows, "curves": curve}  # fmt: skip


def write_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    text = markdown(report["rows"], report["config"])
    print("\n" + text)
    for path, content in ((args.json, json.dumps(jsonable(report), indent=1)), (args.md, text)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, content + "\n")
    if report["rows"]:
        plot(report, Path(args.png))
    print(f"wrote {args.json}, {args.md}" + (f", {args.png}" if report["rows"] else ""))


# ------------------------------------------------------------------------------------------ main


def configured_steps(args: argparse.Namespace) -> int:
    """run.steps of the runs: the preset's, under the passthrough flags and --steps."""
    overrides = parse_overrides(args.passthrough)
    yaml = overrides.pop("config", None)
    if args.steps is not None:
        overrides["run.steps"] = str(args.steps)
    return build_config(args.preset, yaml, overrides).run.steps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variants", default="fp32,bf16,int8,int8-notis,fp8_channel")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values")
    p.add_argument("--preset", default="smollm2-arith", help="flashrl train preset")
    p.add_argument("--steps", type=int, default=None, help="run.steps (default: the preset's)")
    p.add_argument("--out", default="runs/fidelity", help="root of the run directories")
    p.add_argument("--report-only", action="store_true", help="no training: report what exists")
    p.add_argument("--json", default="benchmarks/results/fidelity.json")
    p.add_argument("--md", default="benchmarks/results/fidelity.md")
    p.add_argument("--png", default="benchmarks/results/fidelity.png")
    args, args.passthrough = p.parse_known_args(argv)
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        variants = compare_variants(args.variants)
        steps = configured_steps(args)
    except ConfigError as err:
        if not args.report_only:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"{err}: reporting the runs found", file=sys.stderr)
        variants = [(v.strip(), {}) for v in args.variants.split(",") if v.strip()]
        steps = args.steps  # None: the longest run's
    names = [name for name, _ in variants]
    failed, code = [], 0
    if not args.report_only:
        print(f"{len(variants)} variants x {len(args.seed_list)} seeds, {steps} steps, "
              f"preset {args.preset}, runs in {args.out}", flush=True)  # fmt: skip
        try:
            failed = sweep(args, variants, steps)
        except KeyboardInterrupt:
            print("interrupted: reporting what is done", file=sys.stderr)
            code = 130
    write_report(args, build_report(args, names, steps))
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return code or (1 if failed else 0)


if __name__ == "__main__":
    raise SystemExit(main())
