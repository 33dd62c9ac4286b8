"""``python -m rocket`` and the ``rocket`` console script: the Rust CLI."""

from __future__ import annotations

import sys

import os

from . import _installed_default_model, _rocket


def main() -> None:
    # The Rust CLI would ask `python3` on PATH for the default model; this
    # interpreter (perhaps a venv's) is the one that matters here.
    if not os.environ.get("ROCKET_DEFAULT_MODEL"):
        found = _installed_default_model()
        if found:
            os.environ["ROCKET_DEFAULT_MODEL"] = found
    argv = ["rocket", *sys.argv[1:]]
    sys.stdout.flush()
    raise SystemExit(_rocket.run_cli(argv))


if __name__ == "__main__":
    main()
