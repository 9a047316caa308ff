"""What stochastic sync rounding costs: one full `Engine.update_weights` of fp32 master weights,
nearest vs stochastic (`rollout.sync_rounding`), per scheme, timed interleaved in one run.

    python benchmarks/bench_sync_rounding.py                          # SmolLM2-135M (builtin)
    python benchmarks/bench_sync_rounding.py --model builtin:smollm2-135m --quant bf16,int8,fp8_block --repeat 5 --threads 1

The update is the checkpoint's own weights plus 1e-5 relative fp32 noise (an Adam step at lr 1e-5
moves weights by about that much), sent as fp32 the way the trainer sends its master weights. Rows:
median seconds of each rounding, their ratio, and the fraction of stored values the update changed
(nearest keeps almost all of them; stochastic re-rounds about half of the values that sit between
two grid points). Nearest and stochastic calls alternate, so load on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from _common import device_name, format_table, write_json
from flashrl.core.config import RolloutConfig
from flashrl.engine import Engine, EngineConfig
from flashrl.rl.presets import resolve_model


def master_update(model_dir: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, value in sorted(load_file(str(file)).items()):
            noise = torch.randn(value.shape, generator=gen) * 1e-5
            out.append((name, value.float() * (1 + noise)))
    return out


def bench_scheme(model_dir: Path, scheme: str, repeat: int) -> dict:
    engine_config = EngineConfig(device="cpu", progress=False, seed=0)
    engines = {
        mode: Engine(model_dir, RolloutConfig(quant=scheme, sync_rounding=mode), engine_config)
        for mode in ("nearest", "stochastic")
    }
    update = master_update(model_dir, 0)
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    changed: dict[str, float] = {}
    for i in range(repeat + 1):  # the first round warms up
        for mode, engine in engines.items():
            start = time.perf_counter()
            result = engine.update_weights(update, count_changed=(i == 0))
            if i == 0:
                changed[mode] = result.get("weights_changed_frac", float("nan"))
            else:
                times[mode].append(time.perf_counter() - start)
    median = {mode: sorted(t)[len(t) // 2] for mode, t in times.items()}
    return {
        "scheme": scheme,
        "nearest_s": median["nearest"],
        "stochastic_s": median["stochastic"],
        "ratio": median["stochastic"] / median["nearest"],
        "changed_nearest": changed["nearest"],
        "changed_stochastic": changed["stochastic"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--quant", default="bf16,int8,fp8_block")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="results/sync_rounding.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    rows = [bench_scheme(model_dir, s, args.repeat) for s in args.quant.split(",")]
    device = device_name(torch.device("cpu"))
    payload = {"device": device, "threads": torch.get_num_threads(), "model": args.model,
               "rows": rows}  # fmt: skip
    if args.out:  # first: a table that fails to print loses nothing
        print(f"wrote {write_json(args.out, payload)}")
    print(format_table(rows, list(rows[0])))
    print(f"device: {device} ({torch.get_num_threads()} threads); model {args.model}")


if __name__ == "__main__":
    main()
