"""Postgres and Redis for the cluster test, started on loopback in a temporary folder and removed
after it, through the test's `spawn` fixture (so they die with a failing or timed-out test too).

The servers come from Debian packages (`postgresql`, `redis-server`), which
`.ci/install-cluster-servers` installs when they are missing (`make test-cluster` runs it).
Postgres refuses to run as root: as root, `initdb` and `postgres` run as the `postgres` user
(`runuser`), with the data folder handed to that user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

INSTALL_HINT = "run `make test-cluster` (it installs them with .ci/install-cluster-servers)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary(name: str) -> str:
    """`name` on PATH, else under Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if not found:
        raise RuntimeError(f"{name} not found; {INSTALL_HINT}")
    return found


def _as_postgres(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def _wait(check, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except Exception as e:  # not up yet
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start ({e}); log: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.3)


@contextlib.contextmanager
def postgres(spawn, root: Path):
    """A Postgres cluster in `root/pg` on 127.0.0.1:<free port>; yields the SQLAlchemy URL of its
    database `airflow` (user `airflow`, trust authentication on loopback only)."""
    import psycopg2

    data, log = root / "pg", root / "postgres.log"
    data.mkdir()
    if os.geteuid() == 0:
        root.chmod(0o711)  # the postgres user must reach its folder
        shutil.chown(data, "postgres", "postgres")
    out = spawn.run(_as_postgres([server_binary("initdb"), "-D", str(data), "-U", "airflow", "--auth=trust",
                                  "-E", "UTF8", "--no-sync", "--no-instructions"]), timeout=180, capture_output=True)
    if out.returncode != 0:
        raise RuntimeError(f"initdb failed: {out.stderr.decode(errors='replace')[-2000:]}")
    port = free_port()
    with open(log, "ab") as sink:
        proc = spawn(_as_postgres([server_binary("postgres"), "-D", str(data), "-p", str(port), "-k", str(data),
                                   "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=300",
                                   "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]),
                     stdout=sink, stderr=subprocess.STDOUT)

    def create_db():
        db = psycopg2.connect(host="127.0.0.1", port=port, user="airflow", dbname="postgres", connect_timeout=3)
        db.autocommit = True
        with db.cursor() as cur:
            cur.execute("CREATE DATABASE airflow")
        db.close()

    try:
        _wait(create_db, "postgres", proc, log)
        yield f"postgresql+psycopg2://airflow@127.0.0.1:{port}/airflow"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)  # fast shutdown; the spawn fixture SIGKILLs what is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        spawn.kill(proc)
        shutil.rmtree(data, ignore_errors=True)


@contextlib.contextmanager
def redis(spawn, root: Path):
    """A Redis server on 127.0.0.1:<free port>, nothing persisted; yields its URL (database 0)."""
    folder, log, port = root / "redis", root / "redis.log", free_port()
    folder.mkdir()
    with open(log, "ab") as sink:
        proc = spawn([server_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--dir", str(folder)], stdout=sink, stderr=subprocess.STDOUT)

    def ping():
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            if not s.recv(64).startswith(b"+PONG"):
                raise RuntimeError("no PONG")

    try:
        _wait(ping, "redis", proc, log)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        spawn.kill(proc)
        shutil.rmtree(folder, ignore_errors=True)
