"""The trainer's checkpoints: what it saves, how it resumes, which it keeps.

    checkpoints/step_<N>/   one checkpoint per saved step, in the layout of `pipeline.reshard.checkpoint`
                            (its one writer, `save_dcp`): dcp/ with model.<hf name> (policy),
                            critic.<name>, optim.state.*, sched.last_epoch,
                            trainer.{step,cursor,replay_epochs_done,updates}, rng.torch; hf/ with the
                            files of policy v0 but its weights (config, tokenizer...: the user's,
                            byte for byte); meta.json (+ "kind") written last

A checkpoint exists only once its meta.json is there, so a trainer killed while saving leaves a
folder that every reader ignores (and the next save of that step replaces). DCP stores each rank's
shards and loads them at any other world size.

Only tensors go into DCP (DCP reads non-tensor entries back with a full unpickler): optimizer
hyper-parameters come from the config, every counter is an int64 tensor. Checkpoints of kind
`periodic` are pruned to the newest `trainer.keep_checkpoints`; `phase` checkpoints (which the
reshard tasks read) are kept.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..policy import PolicyStore
from ..reshard.checkpoint import dcp_load, dcp_reader, read_meta, save_dcp
from ..reshard.layout import DCP_DIR, META
from ..rundir import RunDir
from ..storage import list_names
from ..weights import write_hf_folder
from .critic import ActorCritic
from .distributed import World

log = logging.getLogger("rlhf.trainer")
STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    """Counters that travel with the weights."""

    step: int = 0                      # fresh optimizer steps = the policy version of the weights
    cursor: tuple[int, int] = (0, 0)   # L1 read position (seq, group) after `step`
    replay_epochs_done: int = 0
    updates: int = 0                   # optimizer updates, fresh and replay (the LR schedule's clock)

    def cursor_dict(self) -> dict:
        return {"seq": self.cursor[0], "group": self.cursor[1]}


@dataclass
class Checkpoint:
    step: int
    url: str
    path: str
    meta: dict


def checkpoint_dir(run: RunDir, step: int) -> str:
    return run.path("checkpoints", f"step_{step}")


def list_checkpoints(run: RunDir) -> list[Checkpoint]:
    """Complete checkpoints (with meta.json), oldest first."""
    out = []
    for name in list_names(run.fs, run.path("checkpoints")):
        m = STEP_RE.match(name)
        if not m:
            continue
        path = run.path("checkpoints", name)
        meta = read_meta(run.fs, path)
        if meta is not None:
            out.append(Checkpoint(int(m.group(1)), run.child_url("checkpoints", name), path, meta))
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(run: RunDir) -> Checkpoint | None:
    cks = list_checkpoints(run)
    return cks[-1] if cks else None


def _split(msd: dict) -> tuple[dict, dict]:
    policy = {k[len("policy."):]: v for k, v in msd.items() if k.startswith("policy.")}
    critic = {k[len("critic."):]: v for k, v in msd.items() if k.startswith("critic.")}
    return policy, critic


def _state(actor: ActorCritic, opt, sched, st: TrainerState) -> tuple[dict, dict]:
    """The DCP state dict (tensors only) and the optimizer's param_groups (kept out of DCP)."""
    msd, osd = get_state_dict(actor, opt)
    policy, critic = _split(msd)
    state = {
        "model": policy,
        "optim": {"state": osd["state"]},
        "sched": {"last_epoch": torch.tensor(sched.last_epoch if sched is not None else 0, dtype=torch.long)},
        "trainer": {"step": torch.tensor(st.step, dtype=torch.long),
                    "cursor": torch.tensor(list(st.cursor), dtype=torch.long),
                    "replay_epochs_done": torch.tensor(st.replay_epochs_done, dtype=torch.long),
                    "updates": torch.tensor(st.updates, dtype=torch.long)},
        "rng": {"torch": torch.get_rng_state()},
    }
    if critic:
        state["critic"] = critic
    return state, osd["param_groups"]


def save_checkpoint(run: RunDir, actor: ActorCritic, opt, sched, st: TrainerState, tokenizer, world: World,
                    kind: str = "periodic", keep: int = 2, buffer_version: int | None = None,
                    store: PolicyStore | None = None) -> Checkpoint:
    """Save `st.step`'s checkpoint (collective: every rank calls it). Idempotent for a complete one.
    `buffer_version`: the buffer log's version when it was taken (rank 0's), which a resume takes
    the later replays back to (`ReplayBuffer.restore_replays`). `store`: the caller's policy store,
    which keeps v0's files between checkpoints."""
    state, _ = _state(actor, opt, sched, st)
    policy = actor.policy
    url = run.child_url("checkpoints", f"step_{st.step}")
    store = store or PolicyStore(run)  # hf/: policy v0's files but weights, byte for byte (fetched once a store)
    with tempfile.TemporaryDirectory(prefix="ckpt-hf-") as tmp:
        hf = store.base_meta()
        if hf is None:  # no v0 (a run not prepared): the metadata rendered from memory
            hf = os.path.join(tmp, "hf")
            write_hf_folder(hf, config=policy.config, tokenizer=tokenizer,
                            generation_config=getattr(policy, "generation_config", None))
        meta = save_dcp(state, url, hf, step=st.step, world_size=world.size, policy_version=st.step, kind=kind,
                        extra=None if buffer_version is None else {"buffer_version": buffer_version})
    if world.is_main:
        prune(run, keep)
    return Checkpoint(st.step, url, checkpoint_dir(run, st.step), meta)


def prune(run: RunDir, keep: int) -> list[int]:
    """Delete all but the newest `keep` periodic checkpoints, and incomplete folders older than the
    newest complete checkpoint. Returns the deleted steps."""
    cks = list_checkpoints(run)
    periodic = [c for c in cks if c.meta.get("kind", "periodic") == "periodic"]
    newest = cks[-1].step if cks else -1
    doomed = [c.step for c in periodic[:-keep]] if keep else [c.step for c in periodic]
    complete = {c.step for c in cks}
    for name in list_names(run.fs, run.path("checkpoints")):
        m = STEP_RE.match(name)
        if m and int(m.group(1)) not in complete and int(m.group(1)) < newest:
            doomed.append(int(m.group(1)))
    for s in doomed:
        if s == newest:
            continue
        meta = checkpoint_dir(run, s) + f"/{META}"
        if run.fs.exists(meta):
            run.fs.rm(meta)  # uncommit first: a reader never sees half a checkpoint
        run.fs.rm(checkpoint_dir(run, s), recursive=True)
    return sorted(doomed)


def load_checkpoint(ck: Checkpoint, actor: ActorCritic, opt, sched) -> TrainerState:
    """Restore weights, optimizer, scheduler, RNG and counters in place (collective)."""
    st = TrainerState()
    state, groups = _state(actor, opt, sched, st)
    if "critic" in state and not _has_critic(ck):
        raise ValueError(f"{ck.url}: checkpoint has no critic but trainer.algorithm needs one; "
                         "resume with the algorithm it was saved with or start a new run")
    dcp_load(state, f"{ck.url}/{DCP_DIR}")
    msd = {f"policy.{k}": v for k, v in state["model"].items()}
    msd.update({f"critic.{k}": v for k, v in state.get("critic", {}).items()})
    set_state_dict(actor, opt, model_state_dict=msd,
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": groups})
    if sched is not None:
        n = int(state["sched"]["last_epoch"])
        sched.last_epoch = n
        sched._step_count = n + 1
        for g, lr in zip(opt.param_groups, sched.get_lr()):
            g["lr"] = lr
        sched._last_lr = [g["lr"] for g in opt.param_groups]
    torch.set_rng_state(state["rng"]["torch"])
    t = state["trainer"]
    return TrainerState(step=int(t["step"]), cursor=(int(t["cursor"][0]), int(t["cursor"][1])),
                        replay_epochs_done=int(t["replay_epochs_done"]), updates=int(t["updates"]))


def _has_critic(ck: Checkpoint) -> bool:
    md = dcp_reader(f"{ck.url}/{DCP_DIR}").read_metadata()
    return any(k.startswith("critic.") for k in md.state_dict_metadata)


def restore_replays(buffer, ck: Checkpoint | None) -> None:
    """Take back the replays recorded after `ck` (every one without a checkpoint): the resumed
    trainer redoes them, so each counts once and its draws see the priorities `ck` saw. Left as
    they are for a checkpoint saved before it recorded the buffer's version."""
    since = 0 if ck is None else ck.meta.get("buffer_version")
    if since is None:
        return
    n = buffer.restore_replays(int(since))
    if n < 0:
        log.warning("trainer: the buffer log after version %d is gone (vacuumed): the replays recorded after "
                    "the checkpoint stay counted, and the resumed trainer replays those groups less", since)
    elif n:
        log.info("trainer: %d replays recorded after the checkpoint taken back (they are redone)", n)
