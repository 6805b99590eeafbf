"""Policy versions from the trainer: in-phase publication and retention.

In-phase (`publish_policy`, every `trainer.sync_every` steps): the sharded weights are gathered to
rank 0 and committed as `policy/v<step>/` through `PolicyStore.publish_model` (safetensors +
config + tokenizer, manifest last). In the trainer that happens on rank 0's `BackgroundPublisher`
thread, with the retention after it: the next step trains while the version uploads (on object
storage a publication is a few requests, longer than a small model's step: there the thread
publishes with `defer`, so a version goes up to the run directory when a reader on another node
can need it, or every RECORD_EVERY_S for the record, and `flush`es those waiting once it has been
idle REMOTE_POLL_S and at its end; `pipeline.policy_upload`). A version that is
still waiting when a newer one comes is replaced by it (samplers load the newest anyway), unless
the sampler runs on a fixed lag (`sampler.fixed_lag` with one replica: it loads a given version), when the trainer waits
for the thread to take the one queued instead; a failed
publication fails the trainer at its next publication or at its end. The checkpoint closing a phase becomes `policy/v<step>` through
`PolicyStore.publish_checkpoint` (cast to the serving dtype too), which the orchestrator calls (the
DAG's reshard task, the local runner's `advance`), not the trainer. Besides their weights, versions
carry policy v0's files byte for byte (`PolicyStore.base_meta`).

Retention (`prune_policies`, rank 0 after `trainer.keep_policy_versions` in-phase publications,
at most every RETAIN_EVERY_S, and at the end; the trainer is the one deleter): the newest
`keep_policy_versions` versions stay (between two retentions, so do those published since the
last: at least `keep`, and what RETAIN_EVERY_S of publications holds; on object storage each
retention is some five requests), and so do v0 (the reference policy and
every trainer's starting weights), each phase-end version (the last one is the final policy that
finalize exports) and any version a sampler is loading (its lease, see `PolicyStore.retain`).
"""

from __future__ import annotations

import threading
import time

from ..config import TrainerConfig
from ..policy import PolicyStore
from ..policy_cache import REMOTE_POLL_S
from ..rundir import RunDir
from .distributed import World
from .phases import phase_end_steps

RETAIN_EVERY_S = 10.0


def publish_policy(run: RunDir, version: int, actor, tokenizer, world: World, meta: dict | None = None,
                   dtype=None, publisher: "BackgroundPublisher | None" = None) -> bool:
    """Gather the policy's full weights to rank 0 and publish them (collective), cast to `dtype`
    (the serving dtype; the trainer's float32 master weights otherwise); with `publisher`, rank 0
    hands them to its thread instead (returns True: queued)."""
    store = PolicyStore(run)
    weights = full_state_dict(actor.policy, world)
    # The thread gets a copy (at most one, with the cast): the next optimizer step changes the
    # parameters, and views of them, in place.
    copy = world.is_main and publisher is not None
    weights = {k: v.to(dtype if dtype is not None and v.is_floating_point() else v.dtype, copy=copy)
               for k, v in weights.items()}
    published = False
    if world.is_main:
        meta = {"step": version, "source": "trainer", **(meta or {})}
        if publisher is not None:
            publisher.submit(version, actor.policy, tokenizer, meta, weights)
            published = True
        else:  # False when already there (a resumed trainer redoing a step: same data, same weights)
            published = store.publish_model(version, actor.policy, tokenizer, meta, weights=weights)
    world.barrier()
    return published


def full_state_dict(model, world: World) -> dict:
    """The model's whole weights on the CPU: gathered from the ranks' shards (a collective), or in
    one process the module's own tensors (in place: callers copy; the gathering path costs a
    millisecond a step on a small model, as much as its publication's share of the step)."""
    if not world.distributed:
        return {k: v.cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def replaces(sampler_cfg) -> bool:
    """Whether a newer version may replace one still waiting: the samplers load the newest, unless
    one replica alone runs on a fixed lag (several replicas ignore `sampler.fixed_lag`)."""
    return not (sampler_cfg.fixed_lag and sampler_cfg.replicas == 1)


class BackgroundPublisher:
    """Rank 0's publication thread: `submit` queues a version (replacing one still waiting, or
    with `replace` False waiting until the thread has taken it), the thread publishes it and
    applies the retention; `close` waits for what is queued."""

    def __init__(self, store: PolicyStore, tc: TrainerConfig, replace: bool = True):
        self.store, self.tc, self.replace = store, tc, replace
        self._cond = threading.Condition()
        self._queued: tuple | None = None
        self._closed = False
        self._error: BaseException | None = None
        self.replaced = 0  # versions a newer one replaced before they were published
        self.published = 0
        self._retained = (0, time.monotonic())  # publications counted, and when, at the last retention
        self._thread = threading.Thread(target=self._loop, name="policy-publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, model, tokenizer, meta: dict, weights: dict) -> None:
        with self._cond:
            while not self.replace and self._queued is not None and self._error is None:
                self._cond.wait()
            self._raise_if_failed()
            self.replaced += self._queued is not None
            self._queued = (version, model, tokenizer, meta, weights)
            self._cond.notify_all()

    def close(self) -> None:
        """Publish what is queued, apply the retention, stop the thread; re-raise a failure."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            self._raise_if_failed()
        if self.published > self._retained[0]:
            self._retain()

    def _retain(self) -> None:
        prune_policies(self.store, self.tc)
        self._retained = (self.published, time.monotonic())

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"publishing a policy version failed: {err}") from err

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._queued is None and not self._closed:
                    self._cond.wait(REMOTE_POLL_S)
                job, self._queued, closed = self._queued, None, self._closed
                self._cond.notify_all()
            try:
                if job is None:  # idle for REMOTE_POLL_S, or closed: the versions it deferred go up
                    self.store.flush()
                elif self.store.publish_model(job[0], *job[1:4], weights=job[4], defer=True):
                    self.published += 1
                    count, at = self._retained
                    if (self.published - count >= self.tc.keep_policy_versions
                            and time.monotonic() - at >= RETAIN_EVERY_S):
                        self._retain()
            except BaseException as e:  # surfaced on the trainer's next submit or close
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
            if job is None and closed:
                return


def prune_policies(store: PolicyStore, tc: TrainerConfig) -> list[int]:
    """Delete the in-phase versions beyond the newest `tc.keep_policy_versions`. Returns those deleted."""
    return store.retain(tc.keep_policy_versions, protected={0, *phase_end_steps(tc)})
