"""Rollout workers on Ray: the per-step time split, and the weight broadcast of a real-size model.

``--part steps``: the tiny-cpu preset for `--steps` steps (`--rounds` times, interleaved) in-process, on 1 worker and on 2 workers
at equal total threads (`--threads`: the in-process run and the trainer use all of them; one worker
uses all of them; two workers use half each). Reports the median of each phase over the steps after
`--warmup`, and the Ray path's overhead against the in-process step time.

``--part sync``: a random model of `--model` dimensions (a RANDOM_CONFIGS name of `flashrl bench`,
default qwen2.5-0.5b; `--layers` keeps fewer layers) broadcast over gloo to `--workers` int8
workers: the bf16 stream vs trainer-side int8 codes, against the in-process `update_weights` of
the same tensors and a plain copy of the same bytes. Every worker's weights are checked equal to
the in-process engine's after each payload.

    OMP_NUM_THREADS=1 python benchmarks/bench_distributed.py --part steps --steps 10
    OMP_NUM_THREADS=1 python benchmarks/bench_distributed.py --part sync --layers 24
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import format_table, time_fn, write_json
from flashrl.rl.config_build import build_config
from flashrl.rl.trainer import Trainer, read_metrics

PHASES = ("rollout", "logprobs", "train", "weight_update", "transfer", "requantize", "step")
"""Trainer phases: the `time/<phase>_s` keys of metrics.jsonl."""


def run_steps(args: argparse.Namespace, workers: int, root: Path) -> dict:
    """One tiny-cpu run; the mean time of each phase after the warm-up steps."""
    threads = args.threads if workers <= 1 else max(args.threads // workers, 1)
    overrides = {
        "run.steps": args.steps,
        "run.output_dir": str(root / f"w{workers}"),
        "run.plot": False,
        "rollout.workers.count": workers,
        "rollout.shards": args.shards,
    }
    if workers:  # worker settings without workers are refused
        overrides["rollout.workers.threads"] = threads
    torch.set_num_threads(args.threads)
    trainer = Trainer(build_config("tiny-cpu", None, overrides))
    trainer.train()
    return read_metrics(trainer.metrics_path)[args.warmup :]


def summarize(workers: int, threads: int, rows: list[dict]) -> dict:
    """The median over the steps of every round of each phase's time."""
    out = {"workers": workers, "worker_threads": threads if workers else 0, "steps": len(rows)}
    for phase in PHASES:
        out[phase] = statistics.median(r.get(f"time/{phase}_s", 0.0) for r in rows)
    out["bytes"] = statistics.median(r.get("weight_update/sent_bytes", 0.0) for r in rows)
    return out


def part_steps(args: argparse.Namespace) -> dict:
    layouts = (0, 1, 2)
    steps: dict[int, list[dict]] = {w: [] for w in layouts}
    for _round in range(args.rounds):  # interleaved: the machine is shared and its load drifts
        for w in layouts:
            with tempfile.TemporaryDirectory() as tmp:
                steps[w] += run_steps(args, w, Path(tmp))
    rows = []
    for w in layouts:
        threads = args.threads if w <= 1 else max(args.threads // w, 1)
        rows.append(summarize(w, threads, steps[w]))
    base = rows[0]["step"]
    for row in rows:
        row["overhead_vs_in_process"] = row["step"] / base - 1
    cols = ["workers", "worker_threads", "steps", *PHASES, "bytes", "overhead_vs_in_process"]
    print(format_table([{c: row[c] for c in cols} for row in rows], cols))
    return {"steps": rows}


def copy_time(nbytes: int) -> float:
    """Median seconds of one in-memory copy of `nbytes` (buffers touched first, so no first-use
    page faults are timed)."""
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    src = torch.ones(nbytes, dtype=torch.uint8)
    return time_fn(lambda: dst.copy_(src), torch.device("cpu"), warmup=1, repeat=3)


def part_sync(args: argparse.Namespace) -> dict:
    from flashrl.distributed.config import WorkersConfig
    from flashrl.distributed.pool import WorkerPool
    from flashrl.engine.engine import Engine, EngineConfig
    from flashrl.tools.bench import random_model_dir

    tmp = Path(tempfile.mkdtemp())
    model_dir = random_model_dir(args.model, tmp)
    if args.layers:
        path = model_dir / "config.json"
        raw = json.loads(path.read_text())
        raw["num_hidden_layers"] = args.layers
        path.write_text(json.dumps(raw))
    engine_config = EngineConfig(
        dtype="bf16", device="cpu", max_batch=1, max_len=16, progress=False, load_weights=False
    )
    make = functools.partial(Engine, model_dir, "int8", engine_config)
    local = make()
    named = list(local.random_weights(seed=1))
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    start = time.perf_counter()
    local.update_weights(named)
    in_process = time.perf_counter() - start
    copy_s = copy_time(nbytes)
    expected = local.model.state_dict()
    pool = WorkerPool(
        make,
        WorkersConfig(count=args.workers, timeout=1200, bucket_mb=args.bucket_mb),
    )
    rows = []
    try:
        for payload in ("stream", "codes"):
            pool.config = dataclasses.replace(pool.config, payload=payload)
            for _ in range(args.repeat):
                start = time.perf_counter()
                out = pool.update_weights(named)
                wall = time.perf_counter() - start
                rows.append(
                    {
                        "payload": payload,
                        "bytes": out["sent_bytes"],
                        "wall_s": wall,
                        "check_s": out["plan_s"],
                        "send_s": out["send_s"],
                        "worker_sync_s": max(
                            v for k, v in out.items() if k.endswith("/weight_update_s")
                        ),
                        "worker_requant_s": out["requantize_s"],
                        "GB_per_s": out["sent_bytes"] / wall / 1e9,
                    }
                )
            for state in pool.call("state"):
                assert all(torch.equal(state[k], v) for k, v in expected.items()), payload
    finally:
        pool.shutdown()
    cols = ["payload", "bytes", "wall_s", "check_s", "send_s", "worker_sync_s"]
    cols += ["worker_requant_s", "GB_per_s"]
    print(format_table(rows, cols))
    print(
        f"bf16 model bytes {nbytes}, in-process update_weights {in_process:.3f} s, copy {copy_s:.3f} s"
    )
    return {
        "sync": rows,
        "model": args.model,
        "layers": args.layers,
        "workers": args.workers,
        "bf16_bytes": nbytes,
        "in_process_update_s": in_process,
        "copy_s": copy_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=("steps", "sync"), default="steps")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = part_steps(args) if args.part == "steps" else part_sync(args)
    result["machine"] = "shared, noisy 2-core AMD EPYC (CPU only)"
    out = args.out or f"benchmarks/results/distributed_{args.part}.json"
    print("wrote", write_json(out, {"args": vars(args), **result}))


if __name__ == "__main__":
    main()
