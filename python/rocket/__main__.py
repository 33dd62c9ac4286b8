"""``python -m rocket`` and the ``rocket`` console script: the Rust CLI."""

from __future__ import annotations

import sys

from . import _rocket


def main() -> None:
    argv = ["rocket", *sys.argv[1:]]
    sys.stdout.flush()
    raise SystemExit(_rocket.run_cli(argv))


if __name__ == "__main__":
    main()
