"""Prompt draws claimed by the sampler replicas of a run, and the draws they hold.

The run's prompt order is one deterministic stream (`PromptStream`): draw k of the run is the
batch at positions [k * n, (k + 1) * n), n = `sampler.prompts_drawn`. A sampler generates a
draw only after claiming it with a create-only write of `claims/<k>.json` (`storage.put_if_absent`:
a hard link locally, `If-None-Match: *` on S3), so exactly one replica gets each draw however
many run, and a replica takes the next draw only when it is ready for one: fast replicas make most
of the batches, a slow one few, a lost one none (its claimed draw is skipped, never made twice).
Replicas can join a running run at any time: they start after the highest claim they see.

Each replica's state marker (`RunDir.sampler_state_marker`) says which draw it holds (claimed, not
yet handed over or dropped) and since when. The staleness gate counts the draws other replicas
hold below its own: their groups will most likely be committed first (`Sampler.ahead`). A hold
counts while it is younger than `hold_expiry_s` of its replica's last batch time: a replica lost
while holding a draw reserves its place only that long, and a replica restarted under the same id
drops its predecessor's hold at once. A hold that expired while its replica still runs costs
nothing but the check at commit, which drops a batch that would arrive past the bound.
"""

from __future__ import annotations

import json
import time

from ..rundir import RunDir
from ..storage import join, list_names, put_if_absent

CLAIMS_DIR = "claims"
HOLD_MIN_S = 30.0  # a hold counts at least this long, and at least 3x its replica's last batch time
SAVE_ALONE_S = 5.0


def claim_name(k: int) -> str:
    return f"{k:010d}.json"


def replica_id(i: int) -> str:
    """The id of a run's sampler replica i (0 .. sampler.replicas - 1)."""
    return f"sampler-{i}"


def replica_ids(replicas: int) -> list[str]:
    return [replica_id(i) for i in range(replicas)]


def hold_expiry_s(batch_s: float) -> float:
    return max(HOLD_MIN_S, 3.0 * batch_s)


class DrawClaims:
    """Claims the next free draw for one replica (`next()`), records its hold until `release()`,
    and counts the live holds of the run's other replicas (`held_below()`)."""

    def __init__(self, run: RunDir, sampler_id: str, replicas: int = 1):
        self.run, self.sampler_id = run, sampler_id
        self.fs, self.dir = run.fs, run.path(CLAIMS_DIR)
        self.fs.makedirs(self.dir, exist_ok=True)
        self.last = self.highest()
        self.key = RunDir.sampler_state_marker(sampler_id)
        self.state = {k: v for k, v in (run.marker(self.key) or {}).items() if k in ("last_draw", "batches", "batch_s")}
        self.others = [RunDir.sampler_state_marker(s) for s in replica_ids(replicas) if s != sampler_id.lower()]
        self.contended = False  # a draw it went for was taken: a replica the config does not name has joined
        self._save()  # a hold left by an earlier process of this replica is void: it will never be handed over

    @property
    def alone(self) -> bool:
        """No other replica is configured and none has taken a draw from under this one."""
        return not self.others and not self.contended

    @property
    def batches(self) -> int:
        return int(self.state.get("batches", 0))

    def highest(self) -> int:
        """The highest claimed draw (-1 before any): one listing, when a replica starts."""
        nums = [int(n[:-5]) for n in list_names(self.fs, self.dir) if n.endswith(".json") and n[:-5].isdigit()]
        return max(nums, default=-1)

    def next(self) -> int:
        """Claim the lowest free draw above the last one this replica saw claimed, and hold it."""
        payload = json.dumps({"sampler_id": self.sampler_id, "time": time.time()}).encode()
        k = self.last + 1
        while not put_if_absent(self.fs, join(self.dir, claim_name(k)), payload, fsync=False):
            k += 1  # another replica has it
            self.contended = True
        self.last = k
        if self.others:  # else nobody reads the hold: one request less per batch
            self._save(holding=k, since=time.time())
        return k

    def release(self, k: int, batch_s: float | None = None) -> None:
        """Draw k was made in `batch_s` seconds and handed over or dropped (None: given up unmade,
        the run is stopping): this replica holds nothing until its next claim. Alone, it saved no
        hold, and nobody reads its batch time: the marker is written at most every SAVE_ALONE_S
        (and by `flush`), a request per batch less."""
        if batch_s is not None:
            self.state.update(last_draw=k, batches=self.batches + 1, batch_s=round(batch_s, 3))
        self._dirty = True
        if self.others or time.monotonic() - self._saved_at >= SAVE_ALONE_S:
            self._save()

    def flush(self) -> None:
        """Write what `release` has not yet written."""
        if self._dirty:
            self._save()

    def held_below(self, k: int | None = None) -> int:
        """How many of the other replicas hold a draw below k (any draw, with k None) and are
        within their hold's expiry."""
        now, n = time.time(), 0
        for key in self.others:
            m = self.run.marker(key) or {}
            held = m.get("holding")
            if held is not None and (k is None or held < k) and now - m["since"] < hold_expiry_s(m.get("batch_s", 0)):
                n += 1
        return n

    def owner(self, k: int) -> str | None:
        """Which replica claimed draw k (None: nobody yet)."""
        try:
            with self.fs.open(join(self.dir, claim_name(k)), "rb") as f:
                return json.loads(f.read())["sampler_id"]
        except FileNotFoundError:
            return None

    def _save(self, **hold) -> None:
        self.run.set_marker(self.key, {**self.state, "holding": None, **hold})
        self._dirty, self._saved_at = False, time.monotonic()
