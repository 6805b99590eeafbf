import os

import pytest

# Tests share one small example cache; two cores: one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _example_cache(tmp_path_factory):
    """Built-in examples go to a per-session cache unless RLHF_CACHE is set by the caller."""
    if "RLHF_CACHE" not in os.environ:
        os.environ["RLHF_CACHE"] = str(tmp_path_factory.mktemp("rlhf-cache"))
    yield


@pytest.fixture(scope="session")
def digit_example():
    from pipeline.example import ensure_example

    return ensure_example("digit", 0)
