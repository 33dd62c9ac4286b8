"""``python -m rocket`` and the ``rocket`` console script: the Rust CLI."""

from __future__ import annotations

import os
import signal
import sys

from . import _installed_default_model, _rocket


def main() -> None:
    # The Rust CLI would ask `python3` on PATH for the default model; this
    # interpreter (perhaps a venv's) is the one that matters here.
    if not os.environ.get("ROCKET_DEFAULT_MODEL"):
        found = _installed_default_model()
        if found:
            os.environ["ROCKET_DEFAULT_MODEL"] = found
    argv = ["rocket", *sys.argv[1:]]
    # Ctrl-C behaves as with the native binary: the Rust command handles it
    # (`rocket serve` drains and exits, `rocket chat` stops an answer) or it ends
    # the process. Python's own handler would only raise KeyboardInterrupt after
    # the command had returned, and signal handlers that chain to it would
    # trigger that too.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    raise SystemExit(_rocket.run_cli(argv))


if __name__ == "__main__":
    main()
