"""Same seed, same numbers: the tiny `flashrl train` and `flashrl bench --random-weights tiny-bench`
run from two git revisions (issue 16: behaviour unchanged by the redesign).

Each revision is checked out into a temporary worktree and run with its own `src` first on
PYTHONPATH, single-threaded. Reported: per metric of metrics.jsonl, whether every step is identical
(timing keys `time/*`, `throughput/*`, `memory/*` are excluded), and the tokens/s of both runs.

    python benchmarks/bench_redesign_parity.py --before b33d23c --after HEAD --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from flashrl.rl.checkpoint import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("time", "throughput", "memory")
SPELLINGS = (
    ("--run.steps", "--run.output-dir", "--run.plot"),
    ("--steps", "--output-dir", "--plot"),
)
"""`flashrl train` flags: dotted (the nested TrainConfig), then flat for older revisions (before the
nested config; the flat names are refused since)."""


def train(env: dict, out: Path, steps: int) -> None:
    """The tiny `flashrl train` for `steps` steps into out/run, in the spelling the revision takes
    (a refused spelling exits 2 and writes nothing)."""
    for names in SPELLINGS:
        flags = [str(steps), str(out / "run"), "false"]
        argv = [x for pair in zip(names, flags) for x in pair]
        cmd = [sys.executable, "-m", "flashrl.cli", "train", *argv]
        done = subprocess.run(cmd, env=env, cwd=out, capture_output=True)
        if done.returncode != 2:
            break
    done.check_returncode()


def run_rev(rev: str, work: Path, steps: int) -> dict:
    """Train and bench at `rev`; returns the metrics rows and the bench JSON."""
    tree = work / f"tree-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(tree), rev],
                   check=True, capture_output=True)  # fmt: skip
    try:
        env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}
        out = work / f"out-{rev}"
        out.mkdir()
        train(env, out, steps)
        bench = [sys.executable, "-m", "flashrl.cli", "bench", "--random-weights", "tiny-bench",
                 "--out", str(out / "bench.json"), "--threads", "1"]  # fmt: skip
        subprocess.run(bench, check=True, env=env, cwd=out, capture_output=True)
        rows = read_metrics(out / "run" / "metrics.jsonl")  # an older revision's keys renamed
        return {"rows": rows, "bench": json.loads((out / "bench.json").read_text())}
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       check=False, capture_output=True)  # fmt: skip


def compare(before: dict, after: dict) -> dict:
    """Metrics that differ at some step (timing excluded) and the bench rows side by side."""
    keys = sorted({k for row in before["rows"] for k in row if k.split("/")[0] not in TIMING})
    differ = {
        k: sum(a.get(k) != b.get(k) for a, b in zip(before["rows"], after["rows"])) for k in keys
    }
    bench = [
        {"scheme": a["scheme"], "tokens_per_s_before": a["tokens_per_s"],
         "tokens_per_s_after": b["tokens_per_s"], "ratio": b["tokens_per_s"] / a["tokens_per_s"]}
        for a, b in zip(before["bench"]["rows"], after["bench"]["rows"])
    ]  # fmt: skip
    return {
        "steps": len(before["rows"]),
        "metrics_compared": len(keys),
        "metrics_differing": {k: n for k, n in differ.items() if n},
        "bench": bench,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/redesign_parity.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = run_rev(args.before, Path(tmp), args.steps)
        after = run_rev(args.after, Path(tmp), args.steps)
    result = {"before": args.before, "after": args.after, **compare(before, after)}
    print(f"{args.before} -> {args.after}: {result['steps']} steps, "
          f"{result['metrics_compared']} metrics, differing: {result['metrics_differing'] or 'none'}")  # fmt: skip
    print(f"{'scheme':<12} {'tok/s before':>12} {'tok/s after':>12} {'ratio':>6}")
    for row in result["bench"]:
        print(f"{row['scheme']:<12} {row['tokens_per_s_before']:>12.0f} "
              f"{row['tokens_per_s_after']:>12.0f} {row['ratio']:>6.2f}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
