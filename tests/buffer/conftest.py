import uuid

import pytest

from pipeline.config import BufferConfig


@pytest.fixture(scope="session")
def s3_bucket():
    """A bucket on a real S3 endpoint (moto's server on 127.0.0.1), shared by the session."""
    from s3_endpoint import moto_s3

    with moto_s3() as bucket:
        yield bucket


@pytest.fixture
def s3_url(s3_bucket):
    from s3_endpoint import new_prefix

    return new_prefix(s3_bucket) + "/buffer"


@pytest.fixture(params=["file", "memory", pytest.param("s3", marks=pytest.mark.integration)])
def buffer_url(request, tmp_path):
    """A fresh buffer location on local disk, on memory:// and on a real S3 endpoint."""
    if request.param == "file":
        yield str(tmp_path / "buffer")
        return
    if request.param == "s3":
        yield request.getfixturevalue("s3_url")
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
