"""Time `QuantLinear.requantize_` per scheme against the device's copy bandwidth.

Effective bandwidth = (bytes read + bytes written) / time: the bf16 weight is read once and the codes
and scales are written once, so a perfect kernel runs at copy bandwidth. The goal on GPU is within
2x of the measured device-to-device copy.

    python benchmarks/bench_requant.py [--device cuda] [--shapes 4096x4096,4096x14336] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch

from _common import device_name, format_table, time_fn, write_json
from flashrl.quant import QuantLinear
from flashrl.quant.schemes import parse_scheme_list


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="4096x4096,4096x14336", help="comma-separated NxK weight shapes")
    parser.add_argument("--quant", default="int8,fp8,fp8_channel,fp8_block")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--out", default="benchmarks/results/requant.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        weight = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
        copy_dst = torch.empty_like(weight)
        copy_s = time_fn(lambda: copy_dst.copy_(weight), device, repeat=args.repeat)
        copy_gbs = 2 * weight.numel() * 2 / copy_s / 1e9
        for scheme in parse_scheme_list(args.quant):
            layer = QuantLinear(k, n, scheme, dtype=torch.bfloat16, device=device)
            seconds = time_fn(lambda: layer.requantize_(weight), device, repeat=args.repeat)
            moved = weight.numel() * 2 + layer.nbytes()
            gbs = moved / seconds / 1e9
            rows.append(dict(shape=f"{n}x{k}", scheme=scheme.name, ms=seconds * 1e3, GBps=gbs,
                             copy_GBps=copy_gbs, vs_copy=copy_gbs / gbs))
    print(format_table(rows, ["shape", "scheme", "ms", "GBps", "copy_GBps", "vs_copy"]))
    print(f"device: {device_name(device)}; vs_copy = copy bandwidth / requant bandwidth (1.0 is the floor)")
    write_json(args.out, {"device": device_name(device), "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
