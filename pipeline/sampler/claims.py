"""Prompt draws claimed by the sampler replicas of a run, and the draws they hold.

The run's prompt order is one deterministic stream (`PromptStream`): draw k of the run is the
batch at positions [k * n, (k + 1) * n), n = `sampler.prompts_drawn`. A sampler generates a
draw only after claiming it with a create-only write of `claims/<k>.json` (`storage.put_if_absent`:
a hard link locally, `If-None-Match: *` on S3), so exactly one replica gets each draw however
many run, and a replica takes the next draw only when it is ready for one: fast replicas make most
of the batches, a slow one few, a lost one none (its claimed draw is skipped, never made twice).
Replicas can join a running run at any time: they start after the highest claim they see.

A replica alone in its run (no other configured, none met) claims as many draws as its last batch
time says it makes in CLAIM_AHEAD_S (MAX_BLOCK at most) with one write: `claims/<k>.json` with
`"through": k + n - 1` (a claim without it, or that cannot be read, covers draw k alone). On object
storage that is a request per second instead of one per batch (a third of a lone sampler's
requests). Whoever finds a claim in its way (a joiner starting from the highest claim, a replica
whose next claim is taken) goes past its `through`; every claim starts past every claim seen, so
claims never overlap. A replica that finds one taken from under it, or starts after another
replica's claim younger than HOLD_MIN_S, is not alone and claims draw by draw (a replica already
running alone notices a joiner when its next claim is taken: within a block, about a second). A
replica that stops records the rest of its block in its state marker, and its next process (the
same id) goes on with it; after a crash, with no record, the rest is never made (a restarted
replica starts past it), like the draw a replica holds when it stops.

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
CLAIM_AHEAD_S = 1.0  # a lone replica claims the draws it makes in this long at once
MAX_BLOCK = 16
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
        self.key = RunDir.sampler_state_marker(sampler_id)
        marker = run.marker(self.key) or {}
        self.state = {k: v for k, v in marker.items() if k in ("last_draw", "batches", "batch_s")}
        self.others = [RunDir.sampler_state_marker(s) for s in replica_ids(replicas) if s != sampler_id.lower()]
        # a draw it went for was taken, or another replica claimed lately: a replica the config does not name runs
        self.contended = False
        self.block_start = self.last = self.block_end = self.highest()
        rest = marker.get("rest") or {}  # the rest of the block its previous process stopped in
        claim = self._read(rest.get("claim", -1)) if rest and not self.others else {}
        if claim.get("sampler_id") == self.sampler_id and claim.get("through") == rest.get("through"):
            self.block_start, self.last, self.block_end = rest["claim"], rest["from"] - 1, rest["through"]
        self._save()  # a hold (and a rest) left by an earlier process of this replica is void

    @property
    def alone(self) -> bool:
        """No other replica is configured and none has taken a draw from under this one."""
        return not self.others and not self.contended

    @property
    def batches(self) -> int:
        return int(self.state.get("batches", 0))

    def highest(self) -> int:
        """The highest claimed draw (-1 before any): one listing and one read, when a replica starts.
        A recent claim of another replica's there means it is not alone."""
        nums = self._claimed()
        if not nums:
            return -1
        claim = self._read(max(nums))
        if claim.get("sampler_id") != self.sampler_id and time.time() - float(claim.get("time", 0)) < HOLD_MIN_S:
            self.contended = True
        return int(claim.get("through", max(nums)))

    def next(self) -> int:
        """Claim the lowest free draw above the last one this replica saw claimed, and hold it. Alone,
        take it from the block claimed before, or claim a new block starting with it."""
        if self.last < self.block_end:
            self.last += 1
            return self.last
        k = self.last + 1
        while True:
            n = self._block_size()
            claim = {"sampler_id": self.sampler_id, "time": time.time(), **({"through": k + n - 1} if n > 1 else {})}
            if put_if_absent(self.fs, join(self.dir, claim_name(k)), json.dumps(claim).encode(), fsync=False):
                break
            k = self._through(k) + 1  # another replica has it (and the draws its claim covers)
            self.contended = True
        self.block_start, self.last, self.block_end = k, k, k + n - 1
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
        """Write what `release` has not yet written, and the rest of the block this replica claimed
        (the draws past the last it took), which its next process goes on with."""
        if self.last < self.block_end:
            self._save(rest={"claim": self.block_start, "from": self.last + 1, "through": self.block_end})
        elif self._dirty:
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
        start = max((c for c in self._claimed() if c <= k), default=None)
        claim = self._read(start) if start is not None else {}
        return claim.get("sampler_id") if claim.get("through", start) >= k else None

    def _claimed(self) -> list[int]:
        """The draws that claims start at (one listing)."""
        return [int(n[:-5]) for n in list_names(self.fs, self.dir) if n.endswith(".json") and n[:-5].isdigit()]

    def _read(self, k: int) -> dict:
        """The claim at draw k ({} if there is none or it cannot be read: written without fsync,
        it may be torn by a machine crash)."""
        try:
            with self.fs.open(join(self.dir, claim_name(k)), "rb") as f:
                claim = json.loads(f.read())
            return claim if isinstance(claim, dict) else {}
        except (FileNotFoundError, ValueError):
            return {}

    def _through(self, k: int) -> int:
        """The last draw the claim at k covers."""
        return int(self._read(k).get("through", k))

    def _block_size(self) -> int:
        batch_s = self.state.get("batch_s") or 0
        if not self.alone or batch_s <= 0:
            return 1
        return max(1, min(MAX_BLOCK, int(CLAIM_AHEAD_S / batch_s)))

    def _save(self, **hold) -> None:
        self.run.set_marker(self.key, {**self.state, "holding": None, **hold})
        self._dirty, self._saved_at = False, time.monotonic()
