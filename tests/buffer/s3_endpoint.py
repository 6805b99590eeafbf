"""A real S3 endpoint for tests: moto's server on 127.0.0.1, as s3fs's own tests do.

The server runs in a process of its own (`python s3_endpoint.py`), so that serving requests
does not compete for the test process's interpreter lock, and handles one request at a time (see
`_serve`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid


@contextlib.contextmanager
def moto_s3(bucket: str = "rlhf-test"):
    """Start moto's S3 server on a free port; point fsspec's s3 (this process and child processes,
    through FSSPEC_S3_ENDPOINT_URL) at it with dummy credentials. Yields the bucket name."""
    import fsspec

    server = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"moto server did not start (exit code {server.poll()})")
        endpoint = f"http://127.0.0.1:{int(line)}"
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
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            fsspec.config.conf["s3"] = saved_conf
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        server.kill()
        server.wait()


def new_prefix(bucket: str) -> str:
    return f"s3://{bucket}/{uuid.uuid4().hex}"


def _serve() -> None:
    """moto's S3 server on a free port of 127.0.0.1; prints the port, then serves until killed.

    moto's S3 application itself, not its dispatcher for every service, which finds each
    request's service by its host name and, for that, scans moto's package folder every time (a
    third of the server's CPU per request on this endpoint, which serves only S3).

    A thread per connection (werkzeug's server, as moto's own ThreadedMotoServer; it closes each
    connection after its response, so every request opens one, where S3 keeps them alive), but
    one request at a time: moto checks `If-None-Match: *` and then stores the object, so two
    create-only PUTs of the same key handled by two threads at once can both succeed, the second
    replacing the first.
    S3 decides such races atomically; serving requests one by one gives moto the same guarantee,
    without which a test of the commit protocol would see commits vanish that S3 would refuse."""
    import threading

    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    moto_app, lock = create_backend_app("s3"), threading.Lock()

    def app(environ, start_response):
        with lock:
            return list(moto_app(environ, start_response))

    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    _serve()
