"""Which policy each scheduled run published: a small JSON file on shared storage.

`rlhf_retrain` starts each run from the policy of the latest earlier-dated run. Keyed by the run's
date, the registry makes reruns and backfills idempotent: rerunning a date replaces its own entry
and never changes which policy an earlier date started from.
"""

from __future__ import annotations

import json


class PolicyRegistry:
    def __init__(self, url: str):
        from pipeline.storage import url_to_fs

        self.url = url
        self.fs, self.path = url_to_fs(url)

    def entries(self) -> dict[str, dict]:
        try:
            self.fs.invalidate_cache()
            return json.loads(self.fs.cat_file(self.path)).get("runs", {})
        except FileNotFoundError:
            return {}

    def previous(self, date: str) -> dict | None:
        """The entry of the latest date strictly before `date` (YYYY-MM-DD), if any."""
        earlier = sorted(d for d in self.entries() if d < date)
        return self.entries()[earlier[-1]] if earlier else None

    def record(self, date: str, entry: dict) -> None:
        from pipeline.storage import put_atomic

        runs = self.entries()
        runs[date] = entry
        put_atomic(self.fs, self.path, json.dumps({"runs": runs}, indent=1, sort_keys=True).encode())
