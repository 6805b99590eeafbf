"""Where the nodes of a multi-node trainer meet: the endpoint of their torchrun c10d rendezvous.

`trainer.nnodes: M` runs M trainer launchers (M mapped Airflow tasks, or M processes of the local
runner), each `torchrun --nnodes=M --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT`. The endpoint is
the config's `trainer.rendezvous` when set (a fixed address the cluster provides); otherwise node 0
picks a free port on its own address (`RLHF_NODE_ADDRESS`, else its hostname's address) and
publishes `HOST:PORT` in the run directory, where the other nodes wait for it. The torchrun agent on
the endpoint's host serves the rendezvous store; FSDP2 then spans all M x nproc_per_node ranks.
A retried node 0 publishes a fresh endpoint, and the other nodes, failed with it, read that one
when they are retried.
"""

from __future__ import annotations

import os
import socket
import time

from .rundir import RunDir

ADDRESS_ENV = "RLHF_NODE_ADDRESS"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_address() -> str:
    """The address other nodes reach this one at."""
    if os.environ.get(ADDRESS_ENV):
        return os.environ[ADDRESS_ENV]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def publish(run: RunDir) -> str:
    """Node 0: a fresh endpoint on this node, written to the run directory."""
    host = node_address()
    endpoint = f"{host}:{free_port('' if host not in ('127.0.0.1', 'localhost') else host)}"
    run.set_marker(RunDir.TRAINER_RENDEZVOUS_MARKER, {"endpoint": endpoint, "time": time.time()})
    return endpoint


def wait_for(run: RunDir, timeout_s: float, poll_s: float = 1.0, not_before: float = 0.0) -> str:
    """Nodes 1..M-1: the endpoint node 0 published at or after `not_before` (when the current try
    of node 0 started; an older one is a dead node's). Raises TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        marker = run.marker(RunDir.TRAINER_RENDEZVOUS_MARKER)
        if marker and marker.get("endpoint") and float(marker.get("time", 0)) >= not_before:
            return str(marker["endpoint"])
        if run.stop_requested():
            raise RuntimeError(f"{run.url}: the run was stopped before trainer node 0 published its endpoint")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run.url}: trainer node 0 published no rendezvous endpoint in {timeout_s:.0f} s "
                               "(is its task running?)")
        time.sleep(poll_s)


def endpoint(run: RunDir, trainer_cfg, node_rank: int, not_before: float = 0.0) -> str:
    """The rendezvous endpoint node `node_rank` uses."""
    if trainer_cfg.rendezvous:
        return trainer_cfg.rendezvous
    return publish(run) if node_rank == 0 else wait_for(run, trainer_cfg.wait_timeout_s, not_before=not_before)
