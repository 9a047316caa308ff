"""`flashrl bench`: rollout throughput per precision, measured fairly (fixed output length, EOS
ignored).

For each scheme and KV-cache dtype the same prompts are generated with the same seed; the table
reports output tokens/s and its ratio to the first row (bf16 when listed first), time to first
token (the prefill of the batch), the weight update's ``transfer_s`` and ``requantize_s`` for a
full set of new weights, weight and KV memory, peak memory, and the memory-bandwidth floor of a decode step
(weights + KV read once at the measured copy bandwidth). `--random-weights` builds a model of real
dimensions with random weights, so GPU throughput can be measured without a checkpoint; `--hf` adds
`transformers` generate.

KV cache (`--kv-cache-dtype bf16,fp8`): fp8 rows add ``kv_calibration_s`` (recalibrating the KV
scales after the weight update) and ``kv_kl``, the mean per-token KL(fp8-KV || unquantized KV) of
the next-token distributions, teacher-forced on the row's own generated sequences
(`Engine.kv_cache_mismatch`; 0 for unquantized rows). `--kv-budget-gib` adds ``max_sequences``: how
many sequences of prompt + output length fit in that much KV cache.

Decode step (`--compile none,default,...`, `--decode-buckets`): each compile mode adds a row per
scheme and KV dtype (``none`` is the eager step; the others are `torch.compile` modes, see
`flashrl.engine.decode`). A compiled row warms up with one full run of the timed generate, so the
timed run compiles nothing; ``warmup_s`` is that first run (compilation and CUDA-graph capture
included). Eager rows warm up with 4 tokens of 4 prompts. ``decode_shapes`` counts the distinct
(batch, attended length) shapes of the timed run's decode steps (buckets, when bucketed).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from flashrl.core.config import KV_CACHE_DTYPES, RolloutConfig
from flashrl.core.device import DTYPES, peak_memory_bytes, resolve_device, resolve_dtype
from flashrl.core.sampling import SamplingParams
from flashrl.engine import Engine, EngineConfig
from flashrl.engine.decode import COMPILE_MODES
from flashrl.engine.kv_cache import KVCache
from flashrl.errors import ConfigError
from flashrl.model.config import ModelConfig
from flashrl.model.remote_code import NO_REMOTE_CODE, check_no_custom_code
from flashrl.quant.schemes import parse_scheme_list
from flashrl.tools.bench_configs import random_model_dir
from flashrl.tools.bench_report import COLUMNS, BenchRow, format_rows  # noqa: F401
from flashrl.utils import device_name, synchronize


@dataclass
class BenchConfig:
    """Arguments of `run_bench` (the flags of `flashrl bench`)."""

    model: str | None = None
    """Hugging Face checkpoint directory."""
    random_weights: str | None = None
    """Random weights at real dimensions: a name of RANDOM_CONFIGS (tiny-bench, qwen2.5-0.5b,
    qwen2.5-1.5b, qwen2.5-7b, qwen3-8b, llama3.1-8b; MoE: tiny-moe-bench, mid-moe-bench,
    qwen3-30b-a3b) or a config.json."""
    quant: str = "bf16,int8,fp8,fp8_channel"
    """Comma-separated schemes; the first is the ratio baseline."""
    batch: int = 16
    prompt_len: int = 64
    output_len: int = 128
    device: str | None = None
    """cpu, cuda or cuda:N (default: cuda when available)."""
    dtype: str = "bf16"
    """Activation dtype: bf16, fp16 or fp32."""
    seed: int = 0
    hf: bool = False
    """Also time transformers generate on the same prompts."""
    out: str | None = "bench.json"
    """JSON output file ('' for none; non-finite numbers are written as null)."""
    kv_cache_dtype: str = "bf16"
    """Comma-separated KV-cache dtypes (bf16, fp8); each scheme runs with each. fp8 rows report
    kv_kl, the KL to an unquantized cache, and kv_calibration_s, the scale recalibration time."""
    kv_budget_gib: float | None = None
    """KV-cache budget in GiB: report max_sequences (prompt + output length) that fit in it."""
    compile: str = "none"
    """Comma-separated decode-step modes, each a row per scheme: none (eager) or a torch.compile
    mode (default, reduce-overhead = CUDA graphs, max-autotune, max-autotune-no-cudagraphs);
    compiled rows warm up with one full run (warmup_s)."""
    decode_buckets: bool | None = field(default=None, metadata={"words": {"auto": None}})
    """Pad decode steps to shape buckets: on, off, or auto (None: only when compiled)."""
    max_prefill_tokens: int | None = None
    """Padded prompt tokens per prefill forward (None: the engine's default, 16384); bounds
    prefill memory."""
    threads: int | None = None
    """CPU threads for torch (None: torch's choice)."""

    def check(self) -> None:
        """ConfigError naming the flag of the first invalid setting."""
        if (self.model is None) == (self.random_weights is None):
            raise ConfigError("give exactly one of --model DIR or --random-weights CONFIG")
        parse_scheme_list(self.quant)
        parse_kv_dtypes(self.kv_cache_dtype)
        parse_compile_modes(self.compile)
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is invalid; allowed: {', '.join(DTYPES)}")
        if self.kv_budget_gib is not None and not self.kv_budget_gib > 0:
            raise ConfigError(f"--kv-budget-gib {self.kv_budget_gib} must be > 0")
        for name in ("batch", "prompt_len", "output_len", "max_prefill_tokens", "threads"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(
                    f"--{name.replace('_', '-')} {value!r} is invalid; allowed: an integer >= 1"
                )


@dataclass
class BenchResult:
    """What `run_bench` measured: the rows and the machine."""

    config: BenchConfig
    device: str
    """The device's name (`flashrl.utils.device_name`)."""
    copy_bandwidth_gbs: float
    torch: str
    rows: list[BenchRow]

    def to_dict(self) -> dict[str, Any]:
        """The JSON document `flashrl bench --out` writes."""
        return dict(
            config=dataclasses.asdict(self.config),
            device=self.device,
            copy_bandwidth_gbs=self.copy_bandwidth_gbs,
            torch=self.torch,
            rows=[row.to_dict() for row in self.rows],
        )


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Measured device copy bandwidth in bytes/s (bytes read + written)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    synchronize(device)
    return 2 * nbytes * 5 / (time.perf_counter() - start)


def parse_kv_dtypes(text: str) -> list[str]:
    """'bf16,fp8' -> ['bf16', 'fp8']; raises ConfigError naming an unknown dtype."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in KV_CACHE_DTYPES]
    if bad or not names:
        raise ConfigError(
            f"--kv-cache-dtype {text!r} is invalid; allowed: a comma-separated list "
            f"of {', '.join(KV_CACHE_DTYPES)}"
        )
    return list(dict.fromkeys(names))


def parse_compile_modes(text: str) -> list[str | None]:
    """'none,default' -> [None, 'default']; raises ConfigError naming the allowed modes."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n != "none" and n not in COMPILE_MODES]
    if bad or not names:
        raise ConfigError(
            f"--compile {text!r} is invalid; allowed: a comma-separated list of "
            f"none, {', '.join(COMPILE_MODES)}"
        )
    return [None if n == "none" else n for n in dict.fromkeys(names)]


def _timed_generate(
    engine: Engine, prompts: list[list[int]], cfg: BenchConfig, compile: str | None
) -> tuple[list[Any], float, float, dict, dict]:
    """Warm up, then time one generate: (rollouts, warmup s, elapsed s, stats before, after)."""
    params = SamplingParams(
        temperature=1.0, max_tokens=cfg.output_len, ignore_eos=True, seed=cfg.seed
    )
    synchronize(engine.device)
    start = time.perf_counter()
    if compile is None:
        warm = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=cfg.seed)
        engine.generate(prompts[: min(4, len(prompts))], warm)
    else:  # every shape of the timed run: it compiles (and captures) nothing
        engine.generate(prompts, params)
    synchronize(engine.device)
    warmup = time.perf_counter() - start
    engine.decode.shapes.clear()  # count the timed run's shapes only
    before = engine.stats()
    synchronize(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    synchronize(engine.device)
    return outs, warmup, time.perf_counter() - start, before, engine.stats()


def _kv_capacity(
    engine: Engine, budget_gib: float | None, kv_cache_dtype: str, max_len: int
) -> dict[str, int]:
    """``kv_capacity_tokens`` and ``max_sequences`` (of `max_len` tokens) that `budget_gib` of KV
    cache holds at this engine's dimensions; empty without a budget."""
    if budget_gib is None:
        return {}
    c = engine.model_config
    kv_tokens = KVCache.capacity_tokens(
        int(budget_gib * 2**30),
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        engine.dtype,
        kv_cache_dtype,
        engine.kv_scale_granularity or "layer",
    )
    return dict(kv_capacity_tokens=kv_tokens, max_sequences=kv_tokens // max_len)


def _make_engine(
    model_dir: Path,
    scheme: str,
    cfg: BenchConfig,
    random: bool,
    kv_cache_dtype: str,
    compile: str | None,
) -> Engine:
    """The engine of one row (random weights: uninitialised, filled by the caller)."""
    engine_config = EngineConfig(
        dtype=cfg.dtype,
        device=cfg.device,
        max_batch=cfg.batch,
        max_len=cfg.prompt_len + cfg.output_len,
        progress=False,
        load_weights=not random,
        decode_compile=compile,
        decode_buckets=cfg.decode_buckets,
        max_prefill_tokens=cfg.max_prefill_tokens,
    )
    rollout_config = RolloutConfig(quant=scheme, kv_cache_dtype=kv_cache_dtype)
    return Engine(model_dir, rollout_config, engine_config)


def _bench_engine(
    model_dir: Path,
    scheme: str,
    cfg: BenchConfig,
    random: bool,
    prompts: list[list[int]],
    kv_cache_dtype: str = "bf16",
    compile: str | None = None,
) -> BenchRow:
    max_len = cfg.prompt_len + cfg.output_len
    engine = _make_engine(model_dir, scheme, cfg, random, kv_cache_dtype, compile)
    if random:
        engine.init_random_weights_(seed=cfg.seed)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    outs, warmup, elapsed, before, after = _timed_generate(engine, prompts, cfg, compile)
    tokens = sum(len(o.response_ids) for o in outs)
    kv_kl = 0.0
    if kv_cache_dtype != "bf16":
        kv_kl = engine.kv_cache_mismatch(
            [o.prompt_ids for o in outs], [o.response_ids for o in outs]
        )["kl"]
    new_weights = list(engine.random_weights(cfg.seed + 1))  # drawn first: only the update is timed
    update = engine.update_weights(new_weights)
    del new_weights
    capacity = _kv_capacity(engine, cfg.kv_budget_gib, kv_cache_dtype, max_len)
    steps = after["decode_steps"] - before["decode_steps"]
    return BenchRow(
        scheme=scheme,
        kv_cache_dtype=kv_cache_dtype,
        compile=compile or "none",
        buckets=engine.decode.buckets,
        tokens_per_s=tokens / elapsed,
        warmup_s=warmup,
        decode_step_ms=1e3 * (after["decode_s"] - before["decode_s"]) / max(1, steps),
        decode_shapes=len(engine.decode.shapes),
        ttft_s=after["prefill_s"] - before["prefill_s"],
        prefill_forwards=after["prefill_forwards"] - before["prefill_forwards"],
        decode_s=after["decode_s"] - before["decode_s"],
        decode_steps=steps,
        transfer_s=update["transfer_s"],
        requantize_s=update["requantize_s"],
        kv_calibration_s=update["kv_calibration_s"],
        weight_gib=after["weight_bytes"] / 2**30,
        kv_gib=after["kv_cache_bytes"] / 2**30,
        kv_bytes_per_token=after["kv_bytes_per_token"],
        **capacity,
        kv_kl=kv_kl,
        peak_gib=peak_memory_bytes(engine.device) / 2**30,
        tokens=tokens,
        weight_bytes=after["weight_bytes"],
    )


def _bench_hf(
    model_dir: Path, cfg: BenchConfig, prompts: list[list[int]], random: bool
) -> BenchRow:
    """`transformers` generate on the same prompts; with `random`, a model built from the config
    directly on the device (transformers' own random init: throughput does not depend on the
    values, and at 7B dims this skips a CPU init and a 15 GB save and load)."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype)
    check_no_custom_code(model_dir)
    if random:
        config = transformers.AutoConfig.from_pretrained(model_dir, **NO_REMOTE_CODE)
        torch.manual_seed(cfg.seed)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, **NO_REMOTE_CODE
        )
        model = model.to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=cfg.output_len,
        min_new_tokens=cfg.output_len,
        pad_token_id=0,
    )
    with torch.no_grad():
        model.generate(ids[:4], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        synchronize(device)
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return BenchRow(scheme="transformers", tokens_per_s=tokens / elapsed, tokens=tokens)


def run_bench(cfg: BenchConfig) -> BenchResult:
    """Run the benchmark: every scheme x KV dtype x compile mode (and transformers with `hf`)."""
    cfg.check()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    schemes = [s.name for s in parse_scheme_list(cfg.quant)]
    with tempfile.TemporaryDirectory() as tmp:
        random = cfg.random_weights is not None
        model_dir = (
            random_model_dir(cfg.random_weights, Path(tmp) / "model") if random else Path(cfg.model)
        )
        vocab = ModelConfig.from_model_dir(model_dir).vocab_size  # clear errors for a bad directory
        gen = torch.Generator().manual_seed(cfg.seed)
        prompts = torch.randint(3, vocab, (cfg.batch, cfg.prompt_len), generator=gen).tolist()
        rows = []
        for scheme in schemes:
            for kv in parse_kv_dtypes(cfg.kv_cache_dtype):
                for mode in parse_compile_modes(cfg.compile):
                    row = _bench_engine(model_dir, scheme, cfg, random, prompts, kv, mode)
                    rows.append(row)
                    _release_memory()  # the last row's engine (a compiled one is a cycle)
                    # progress on long runs (a 7B grid takes minutes): each row as it finishes
                    # the whole row too, so a run cut off by a time limit loses none of it
                    print(
                        f"[bench] {scheme} kv={kv} compile={mode or 'none'}: {row.tokens_per_s:.1f} tok/s"
                        f" | {json.dumps(dataclasses.asdict(row), default=str)}",
                        file=sys.stderr,
                        flush=True,
                    )
        if cfg.hf:
            rows.append(_bench_hf(model_dir, cfg, prompts, random))
    device = resolve_device(cfg.device)
    bandwidth = copy_bandwidth(device)
    for row in rows:
        row.vs_first = row.tokens_per_s / rows[0].tokens_per_s
        if row.weight_bytes is not None:
            # one decode step reads every weight once and the KV of every sequence so far
            step_bytes = row.weight_bytes + row.kv_gib * 2**30 / 2
            row.floor_tokens_per_s = cfg.batch / (step_bytes / bandwidth)
            row.vs_floor = row.tokens_per_s / row.floor_tokens_per_s
    return BenchResult(
        config=cfg,
        device=device_name(device),
        copy_bandwidth_gbs=bandwidth / 1e9,
        torch=torch.__version__,
        rows=rows,
    )


def _release_memory() -> None:
    """Free what the previous row held before the next one allocates (7B-dim rows on one GPU)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
