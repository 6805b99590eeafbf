import os
import shutil
import tempfile

import pytest
from spawner import Spawner

# Tests share one small example cache; two cores: one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _example_cache():
    """Built-in examples go to a per-session cache unless RLHF_CACHE is set by the caller. Not under
    pytest's basetemp: pytest prunes old temp folders, also those of a concurrent session."""
    if "RLHF_CACHE" in os.environ:
        yield
        return
    path = tempfile.mkdtemp(prefix="rlhf-test-cache-")
    os.environ["RLHF_CACHE"] = path
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def digit_example():
    from pipeline.example import ensure_example

    return ensure_example("digit", 0)


@pytest.fixture
def spawn():
    """Start processes for this test (see `spawner.Spawner`): own process group, default signal
    dispositions; whatever they started is SIGKILLed at teardown, passed, failed or timed out."""
    with Spawner() as spawner:
        yield spawner
