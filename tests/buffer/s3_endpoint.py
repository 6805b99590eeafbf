"""A real S3 endpoint for tests: moto's server on 127.0.0.1, as s3fs's own tests do."""

from __future__ import annotations

import contextlib
import os
import uuid


@contextlib.contextmanager
def moto_s3(bucket: str = "rlhf-test"):
    """Start moto's S3 server on a free port; point fsspec's s3 (this process and child processes,
    through FSSPEC_S3_ENDPOINT_URL) at it with dummy credentials. Yields the bucket name."""
    import fsspec
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": endpoint}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_conf = dict(fsspec.config.conf.get("s3", {}))
    os.environ.update(env)
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(bucket)
        yield bucket
    finally:
        server.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        fsspec.config.conf["s3"] = saved_conf
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


def new_prefix(bucket: str) -> str:
    return f"s3://{bucket}/{uuid.uuid4().hex}"
