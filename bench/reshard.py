"""Resharding speed and memory against a plain copy of the same bytes, on the same disk, in one run.

    .venv/bin/python bench/reshard.py [--dir DIR] [--dtype bfloat16] [--layers 24] [--repeat 1]

Builds a synthetic trainer checkpoint (dcp:2 layout) with the real Qwen2-0.5B shapes (hidden 896,
24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936, untied LM head: 630 M parameters,
1.26 GB in bf16), random weights written tensor by tensor. Then, side by side:

    copy      `cp -r` of the checkpoint folder, then fsync of every copied file (the reshard fsyncs
              its outputs too, before committing the manifest), also reported without the fsync
    dcp->hf   reshard to a Hugging Face folder, in a child process
    hf->tp:2  reshard of that folder to tp:2, in a child process

Reshard times are the `reshard()` call inside the child (not interpreter start-up); peak RSS is the
child's ru_maxrss (so it includes the ~270 MB of the imported libraries). CPU seconds of each
step and the load average are printed too: on a shared machine the wall-clock ratio mostly says how
much CPU each step needs (the reshard also checksums every byte it writes; cp does not). With --repeat > 1 the
three are interleaved and each keeps its fastest time.

Every step is prepared the same way just before its timed work (the reshard children do it after
their imports): delete its own previous output, `sync` (so none inherits the dirty pages of the one
before), then touch and free twice the checkpoint's bytes of memory in a short-lived process
(`prime_gb`; `--no-prime` skips it). On this machine, a VM whose host takes back memory the guest
frees, the first touch of such memory cost about 2.8 s per GB, and a step that wrote its page cache
into it ran 5-10x slower; which step met it depended on the order of the steps and on what ran
before the benchmark. Touching memory first makes every step write into memory that is already
there, as on a machine without that reclaim, where the priming changes nothing.
Prints one JSON line; deletes its files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False)

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from pipeline.devices import set_threads
set_threads(1)
from pipeline.reshard import reshard
sys.path.insert(0, {bench!r})
from reshard import prepare_step
prepare_step({dst!r}, {prime})  # after the imports: the timed work starts right after, as cp's does
ru0 = resource.getrusage(resource.RUSAGE_SELF)
rss0, cpu0 = ru0.ru_maxrss / 1024, ru0.ru_utime + ru0.ru_stime
t0 = time.perf_counter()
reshard({src!r}, {dst!r}, to={to!r})
dt = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"s": dt, "peak_rss_mb": ru.ru_maxrss / 1024, "rss_after_import_mb": rss0,
                  "cpu_s": ru.ru_utime + ru.ru_stime - cpu0}}))
"""


def build_checkpoint(dst: str, dtype_name: str, layers: int) -> tuple[int, int]:
    """Write a dcp:2 trainer checkpoint tensor by tensor; returns (bytes of weights, largest tensor)."""
    import torch
    from transformers import Qwen2Config

    from pipeline.reshard.arch import Architecture
    from pipeline.reshard.checkpoint import checkpoint_meta, encode_meta
    from pipeline.reshard.dcp_io import DCPWriter
    from pipeline.reshard.layout import META, TensorSpec, ordered
    from pipeline.storage import put_atomic, url_to_fs
    from pipeline.weights import write_hf_folder

    dtype = getattr(torch, dtype_name)
    cfg = Qwen2Config(**{**QWEN2_05B, "num_hidden_layers": layers}, torch_dtype=dtype_name,
                      architectures=["Qwen2ForCausalLM"])
    write_hf_folder(os.path.join(dst, "hf"), config=cfg)
    arch = Architecture.from_config(cfg.to_dict(), dst)
    specs = ordered(TensorSpec(n, s, dtype) for n, s in arch.expected_shapes().items())
    fs, root = url_to_fs(dst)
    writer = DCPWriter(fs, f"{root}/dcp", 2, "bench")
    gen = torch.Generator().manual_seed(0)
    for spec in specs:
        t = (torch.randn(spec.shape, generator=gen) * 0.02).to(dtype)
        writer.write(spec, t)
        del t
    writer.commit()
    put_atomic(fs, f"{root}/{META}", encode_meta(checkpoint_meta(1, 2, 1)))
    return sum(s.nbytes for s in specs), max(s.nbytes for s in specs)


PRIME = """
import mmap, sys
n = int(sys.argv[1])
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)
for i in range(0, n, mmap.PAGESIZE):
    m[i] = 1
"""


def prepare_step(dst: str, prime_bytes: int) -> None:
    """What every timed step does first: delete its own previous output, `sync`, then touch and
    free `prime_bytes` of memory in a short-lived process (so it counts in nobody's RSS)."""
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    if prime_bytes > 0:
        subprocess.run([sys.executable, "-c", PRIME, str(prime_bytes)], check=True)


def prime_size(nbytes: int) -> int:
    """Twice the checkpoint, or half the memory available, whichever is less."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0
    return min(2 * nbytes, avail // 2)


def run_child(src: str, dst: str, to: str, prime: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    code = CHILD.format(root=ROOT, bench=os.path.dirname(os.path.abspath(__file__)), src=src, dst=dst, to=to,
                        prime=prime)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"reshard to {to} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed_copy(src: str, dst: str, prime: int) -> tuple[float, float, float]:
    """(seconds for cp -r, seconds for cp -r plus fsync of every copied file, CPU seconds of cp)."""
    import resource

    prepare_step(dst, prime)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    t1 = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    for dirpath, _, names in os.walk(dst):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return t1 - t0, time.perf_counter() - t0, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary folder under /tmp)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-prime", action="store_true", help="skip touching and freeing memory before each step")
    ap.add_argument("--build-only", metavar="DST", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_only:  # child mode: keeps torch and the weights out of the measuring process
        sys.path.insert(0, ROOT)
        import torch

        torch.set_num_threads(1)
        print(json.dumps(build_checkpoint(args.build_only, args.dtype, args.layers)))
        return
    # This process never imports torch: Linux carries a parent's peak RSS into a child's ru_maxrss
    # across fork+exec, so a large parent would inflate every measurement.
    work = tempfile.mkdtemp(prefix="bench-reshard-", dir=args.dir)
    try:
        src = os.path.join(work, "step_1")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        built = subprocess.run([sys.executable, __file__, "--build-only", src, "--dtype", args.dtype, "--layers",
                                str(args.layers)], env=env, capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"building the checkpoint failed:\n{built.stderr[-3000:]}")
        nbytes, largest = json.loads(built.stdout.strip().splitlines()[-1])
        best = {"copy": float("inf"), "copy_sync": float("inf"), "dcp_to_hf": float("inf"), "hf_to_tp2": float("inf")}
        cpu_s = {"copy": float("inf"), "dcp_to_hf": float("inf"), "hf_to_tp2": float("inf")}
        rss, rss0 = 0.0, 0.0
        load_before = os.getloadavg()[0]
        prime = 0 if args.no_prime else prime_size(nbytes)
        for i in range(args.repeat):
            plain, synced, cpu = timed_copy(src, os.path.join(work, "copy"), prime)
            best["copy"], best["copy_sync"] = min(best["copy"], plain), min(best["copy_sync"], synced)
            cpu_s["copy"] = min(cpu_s["copy"], cpu)
            a = run_child(src, os.path.join(work, "hf"), "hf", prime)
            b = run_child(os.path.join(work, "hf"), os.path.join(work, "tp2"), "tp:2", prime)
            best["dcp_to_hf"], best["hf_to_tp2"] = min(best["dcp_to_hf"], a["s"]), min(best["hf_to_tp2"], b["s"])
            cpu_s["dcp_to_hf"], cpu_s["hf_to_tp2"] = min(cpu_s["dcp_to_hf"], a["cpu_s"]), min(cpu_s["hf_to_tp2"], b["cpu_s"])
            rss = max(rss, a["peak_rss_mb"], b["peak_rss_mb"])
            rss0 = max(rss0, a["rss_after_import_mb"], b["rss_after_import_mb"])
        gb = nbytes / 1e9
        slower = max(best["dcp_to_hf"], best["hf_to_tp2"])
        largest_mb = largest / 2**20
        print(json.dumps({
            "gb": round(gb, 3), "dtype": args.dtype,
            "dcp_to_hf_s": round(best["dcp_to_hf"], 3), "dcp_to_hf_gbps": round(gb / best["dcp_to_hf"], 3),
            "hf_to_tp2_s": round(best["hf_to_tp2"], 3), "hf_to_tp2_gbps": round(gb / best["hf_to_tp2"], 3),
            "copy_s": round(best["copy_sync"], 3), "copy_gbps": round(gb / best["copy_sync"], 3),
            "copy_nosync_s": round(best["copy"], 3),
            "ratio_vs_copy": round(slower / best["copy_sync"], 3),
            "ratio_vs_copy_nosync": round(slower / best["copy"], 3),
            "peak_rss_mb": round(rss, 1), "rss_after_import_mb": round(rss0, 1),
            "largest_tensor_mb": round(largest_mb, 1), "rss_goal_mb": round(2 * largest_mb + 256, 1),
            "cpu_s": {k: round(v, 3) for k, v in cpu_s.items()},
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "cores": os.cpu_count(),
            "repeat": args.repeat, "prime_gb": round(prime / 1e9, 2),
        }))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
