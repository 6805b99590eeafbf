import uuid

import pytest

from pipeline.config import BufferConfig


@pytest.fixture(params=["file", "memory"])
def buffer_url(request, tmp_path):
    """A fresh buffer location on local disk and on memory://."""
    if request.param == "file":
        yield str(tmp_path / "buffer")
        return
    url = f"memory://buffers/{uuid.uuid4().hex}"
    yield url
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.fixture
def small_config():
    return BufferConfig(checkpoint_interval=5, writer_queue=4)
