"""Time `QuantLinear.requantize_` per scheme and kernel path against the device's copy bandwidth.

Effective bandwidth = (bytes read + bytes written) / time: the bf16 weight is read once and the codes
and scales are written once, so a perfect kernel runs at copy bandwidth. The goal on GPU is within
2x of the measured device-to-device copy (vs_copy <= 2).

Kernel paths (``--kernels``, columns per path): ``torch`` is the chunked torch reference quantizer,
``triton`` the fused kernels of `flashrl.quant.kernels` (bit-identical codes and scales; the
``same_bits`` column checks that for the benchmarked weight). The Triton path is timed on CUDA only:
on CPU the kernels run in the Triton interpreter, which is a test tool, not a performance path.

    python benchmarks/bench_requant.py [--device cuda] [--shapes 4096x4096,4096x14336] [--out FILE]
    python benchmarks/bench_requant.py --device cuda --kernels triton,torch    # GPU: both paths
"""

from __future__ import annotations

import argparse

import torch

from _common import device_name, format_table, time_fn, write_json
from flashrl.quant import QuantLinear, kernels
from flashrl.quant.schemes import parse_scheme_list

PATHS = ("triton", "torch")


def parse_paths(text: str) -> list[str]:
    paths = [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad or not paths:
        raise SystemExit(
            f"--kernels {text!r}: allowed values are {', '.join(PATHS)} (comma-separated)"
        )
    return paths


def codes_and_scales(layer: QuantLinear) -> list[torch.Tensor]:
    return [
        b.view(torch.uint8) if b.element_size() == 1 else b
        for b in (layer.weight, layer.weight_scale)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shapes", default="4096x4096,4096x14336", help="comma-separated NxK weight shapes"
    )
    parser.add_argument("--quant", default="int8,fp8,fp8_channel,fp8_block")
    parser.add_argument(
        "--kernels",
        default="triton,torch",
        help="kernel paths to time: triton, torch (CUDA only for triton)",
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--out", default="benchmarks/results/requant.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    paths = parse_paths(args.kernels)
    skipped = {}
    for path in paths:
        if path == "triton" and device.type != "cuda":
            skipped[path] = (
                "not timed on CPU (the Triton interpreter is a test tool, not a performance path)"
            )
        elif path == "triton" and not kernels.triton_available():
            skipped[path] = "triton is not installed"
    timed = [p for p in paths if p not in skipped]
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        weight = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
        copy_dst = torch.empty_like(weight)
        copy_s = time_fn(lambda d=copy_dst, w=weight: d.copy_(w), device, repeat=args.repeat)
        copy_gbs = 2 * weight.numel() * 2 / copy_s / 1e9
        for scheme in parse_scheme_list(args.quant):
            row = dict(shape=f"{n}x{k}", scheme=scheme.name, copy_GBps=copy_gbs)
            results = {}
            for path in timed:
                with kernels.mode_scope(path):
                    layer = QuantLinear(k, n, scheme, dtype=torch.bfloat16, device=device)
                    seconds = time_fn(
                        lambda q=layer, w=weight: q.requantize_(w), device, repeat=args.repeat
                    )
                results[path] = codes_and_scales(layer)
                gbs = (weight.numel() * 2 + layer.nbytes()) / seconds / 1e9
                row.update(
                    {
                        f"{path}_ms": seconds * 1e3,
                        f"{path}_GBps": gbs,
                        f"{path}_vs_copy": copy_gbs / gbs,
                    }
                )
            if len(results) == 2:
                row["same_bits"] = all(torch.equal(a, b) for a, b in zip(*results.values()))
            rows.append(row)
    columns = ["shape", "scheme", "copy_GBps"]
    for path in timed:
        columns += [f"{path}_ms", f"{path}_GBps", f"{path}_vs_copy"]
    if len(timed) == 2:
        columns.append("same_bits")
    print(format_table(rows, columns))
    print(
        f"device: {device_name(device)}; vs_copy = copy bandwidth / requant bandwidth (1.0 is the floor, goal <= 2)"
    )
    for path, why in skipped.items():
        print(f"{path}: {why}")
    write_json(
        args.out,
        {
            "device": device_name(device),
            "torch": torch.__version__,
            "kernels": timed,
            "skipped": skipped,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
