"""Prompt draws claimed by the sampler replicas of a run.

The run's prompt order is one deterministic stream (`PromptStream`): draw k of the run is the
batch at positions [k * prompts_per_batch, (k + 1) * prompts_per_batch). A sampler generates a
draw only after claiming it with a create-only write of `claims/<k>.json` (`storage.put_if_absent`:
a hard link locally, `If-None-Match: *` on S3), so exactly one replica gets each draw however
many run, and a replica takes the next draw only when it is ready for one: fast replicas make most
of the batches, a slow one few, a lost one none (its claimed draw is skipped, never made twice).
Replicas can join a running run at any time: they start after the highest claim they see.

A claim names its replica and the time; nothing else reads them but `rlhf buffer stats`-style
inspection, and they stay with the run as the record of who drew what.
"""

from __future__ import annotations

import json
import time

from ..rundir import RunDir
from ..storage import join, list_names, put_if_absent

CLAIMS_DIR = "claims"


def claim_name(k: int) -> str:
    return f"{k:010d}.json"


class DrawClaims:
    """Claims the next free draw for one replica; `next()` returns its number."""

    def __init__(self, run: RunDir, sampler_id: str):
        self.run, self.sampler_id = run, sampler_id
        self.fs, self.dir = run.fs, run.path(CLAIMS_DIR)
        self.fs.makedirs(self.dir, exist_ok=True)
        self.last = self.highest()

    def highest(self) -> int:
        """The highest claimed draw (-1 before any): one listing, when a replica starts."""
        nums = [int(n[:-5]) for n in list_names(self.fs, self.dir) if n.endswith(".json") and n[:-5].isdigit()]
        return max(nums, default=-1)

    def next(self) -> int:
        """Claim the lowest free draw above the last one this replica saw claimed."""
        payload = json.dumps({"sampler_id": self.sampler_id, "time": time.time()}).encode()
        k = self.last + 1
        while not put_if_absent(self.fs, join(self.dir, claim_name(k)), payload, fsync=False):
            k += 1  # another replica has it
        self.last = k
        return k

    def owner(self, k: int) -> str | None:
        """Which replica claimed draw k (None: nobody yet)."""
        try:
            with self.fs.open(join(self.dir, claim_name(k)), "rb") as f:
                return json.loads(f.read())["sampler_id"]
        except FileNotFoundError:
            return None
