"""How many flashrl source files one RL step runs through (issue 25, "Must show").

Builds the tiny `flashrl train` task in-process (`tiny-cpu` preset, built-in engine, CPU), runs
one untraced warm-up step, then traces the next `Trainer.train_step` call with `sys.setprofile`.
Set-up (config, model loading, the `Trainer` constructor) and the warm-up step are not traced.

Counted, for Python functions only (a `call` event whose code object's file is under the flashrl
package that was imported; C functions such as torch ops are not Python frames and never count):

- files: distinct flashrl source files with at least one function called during the step;
- functions: distinct (file, first line, name) code objects called;
- returns: `return` events of flashrl functions (every call that returned, loops included).

    python scripts/step_files.py [--files] [--step 1] [--with-setup]

`--with-setup` traces config building, the `Trainer` constructor and the first step together
(imports done before tracing starts still do not count).

Run it with the checkout's `src` first on PYTHONPATH to measure that checkout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import flashrl
from flashrl.rl.config_build import build_config
from flashrl.rl.trainer import Trainer

PACKAGE = Path(flashrl.__file__).resolve().parent


def trace(run) -> tuple[Counter, set, int]:
    """Calls per file, the distinct functions and the number of returns while `run()` runs."""
    calls: Counter = Counter()
    functions: set = set()
    returns = 0
    root = str(PACKAGE) + os.sep

    def profile(frame, event, arg):
        nonlocal returns
        path = frame.f_code.co_filename
        if not path.startswith(root):
            return
        if event == "call":
            calls[path] += 1
            functions.add((path, frame.f_code.co_firstlineno, frame.f_code.co_name))
        elif event == "return":
            returns += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls, functions, returns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=1, help="which step to trace (0 = the first)")
    parser.add_argument("--files", action="store_true", help="list the files with their calls")
    parser.add_argument(
        "--with-setup",
        action="store_true",
        help="trace from build_config through the Trainer's set-up and the first step instead",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = {"run.output_dir": tmp, "run.steps": args.step + 1, "run.plot": False}
        if args.with_setup:
            made: list[Trainer] = []

            def run() -> None:
                made.append(Trainer(build_config("tiny-cpu", None, overrides)))
                made[0].train_step()

            calls, functions, returns = trace(run)
            made[0].close()
            what = "build_config + Trainer() + step 0"
        else:
            trainer = Trainer(build_config("tiny-cpu", None, overrides))
            for _ in range(args.step):
                trainer.train_step()
            calls, functions, returns = trace(trainer.train_step)
            trainer.close()
            what = f"step {args.step}"
    print(f"package: {PACKAGE}")
    print(f"{what}: {len(calls)} files, {len(functions)} functions, {returns} returns")
    if args.files:
        for path, n in sorted(calls.items()):
            print(f"  {n:8d}  {Path(path).relative_to(PACKAGE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
