"""The `flashrl` console script's entry point (``flashrl = "flashrl.cli:main"``); the command lives
in `flashrl.tools.cli`."""

from flashrl.tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
