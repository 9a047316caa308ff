"""GPU diagnostic: how far a CUDA-graph decode step is from the eager one, per KV-cache dtype.

tests/test_engine_compile.py::test_cuda_graph_sees_fp8_kv_scale_updates found graph vs eager
relative logit differences of 0.036-0.042 with an fp8 KV cache on a sharp tiny model (H100, torch
2.11), above its 0.02 bound. This prints, for the same sharp model and inputs, graph-vs-eager and
each-vs-fp32 distances for a bf16 and an fp8 KV cache, so the cause (fp8 codes that round
differently when inductor fuses the cache write, or bf16 noise that a sharp model amplifies) can be
told apart. Run on a GPU: ``python scripts/gpu_kv_graph_diag.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from flashrl.testing import save_tiny_model
from test_engine_compile import decode_trace, engine, gpu_engines, random_ids, rel


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(Path(tmp) / "m", "qwen2", initializer_range=0.2)
        prompts = [random_ids(n, gen) for n in (4, 12, 7)]
        responses = [random_ids(12, gen) for _ in prompts]
        ref = decode_trace(
            engine(path, device="cuda", max_batch=8, max_len=96, decode_buckets=True),
            prompts,
            responses,
        )
        for kv, scale in (("bf16", None), ("fp8", 0.05), ("fp8", "dynamic")):
            extra = {} if scale is None else {"kv_scale": scale}
            eager, graphs = gpu_engines(path, [None, "reduce-overhead"], kv_cache_dtype=kv, **extra)
            e, g = decode_trace(eager, prompts, responses), decode_trace(graphs, prompts, responses)
            print(
                f"kv={kv} scale={scale}: graph-vs-eager {rel(g, e):.4f}, eager-vs-fp32 "
                f"{rel(e, ref):.4f}, graph-vs-fp32 {rel(g, ref):.4f}, first step graph-vs-eager "
                f"{rel(g[0], e[0]):.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
