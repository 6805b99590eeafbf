"""Rules between settings of different sections of a run config (`RunConfig`'s last validator).

Each rule refuses a combination that could never run as meant: one that would stall the run
(the staleness bound, the rate limiter), wait for data that can never come (replay nothing can
be eligible for) or be silently ignored. A broken rule raises ValueError with one line that names
the settings and the fix; `pipeline.config` turns it into a ConfigError.
"""

from __future__ import annotations

import re

from pydantic import AliasChoices, BaseModel, ValidationError

from .config_yaml import show_value

_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:([0-9]{1,5}))?")
_YAML11_BOOLS = {"yes", "no", "on", "off", "y", "n"}


def check_endpoint(value: str) -> str:
    """`value` if it is host[:port] with a port of 1-65535 (an IPv6 host in brackets; torchrun's
    default port 29400 without one)."""
    m = _ENDPOINT.fullmatch(value)
    if not m or (m.group(3) is not None and not 0 < int(m.group(3)) < 65536):
        raise ValueError(f"{value!r} is not host:port (e.g. node-0:29400, [fd00::1]:29400, port 1-65535)")
    return value


def check_vllm_options(options: dict, reserved: tuple[str, ...]) -> dict:
    """`sampler.vllm`: none of the engine arguments the backend sets itself, and no YAML 1.1 word
    for a boolean (config files are read as YAML 1.2, where `no` is the string 'no', which is true)."""
    clash = [k for k in options if k in reserved]
    if clash:
        raise ValueError(f"'{clash[0]}' is set by the pipeline (from model.path, model.dtype, "
                         "model.trust_remote_code, seed); remove it from sampler.vllm")
    for k, v in options.items():
        if isinstance(v, str) and v.lower() in _YAML11_BOOLS:
            raise ValueError(f"{k}: {v!r} is a string; write true or false")
    return options


def format_error(err: ValidationError, root: type[BaseModel]) -> str:
    """The one line a config's first validation error becomes."""
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "config"
    if e["type"] == "extra_forbidden":
        parent, model = e["loc"][:-1], root
        for p in parent:
            field = model.model_fields.get(str(p))
            if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                break
            model = field.annotation
        for name, f in model.model_fields.items():  # an old name given beside the new one
            if isinstance(f.validation_alias, AliasChoices) and e["loc"][-1] in f.validation_alias.choices:
                return f"config key '{loc}' is the old name of '{'.'.join(map(str, parent + (name,)))}'; give only one of them"
        return f"unknown config key '{loc}'; remove it or use one of: {', '.join(model.model_fields)}"
    if e["type"] == "value_error":
        msg = str(e.get("ctx", {}).get("error", e["msg"]))
        return msg if loc == "config" or msg.startswith(loc + ".") else f"{loc}: {msg}"
    if e["type"] == "string_type" and isinstance(e.get("input"), (int, float)) and not isinstance(e["input"], bool):
        return (f"{loc}: a text setting, which YAML read as the number {show_value(e['input'])}; quote the value "
                f"as written, e.g. (YAML: {loc.split('.')[-1]}: '007'; the command line: --set \"{loc}='007'\")")
    return f"{loc}: {e['msg'].rstrip('.')} (got {show_value(e.get('input'))}); fix the value of '{loc}'"


CRITIC_SETTINGS = ("critic_lr", "vf_coef", "gamma", "gae_lambda", "critic_targets", "vtrace_rho_bar", "vtrace_c_bar")


def check_trainer(t, frozen: bool = False) -> None:
    """The rules within a `TrainerConfig`; `frozen` (a run directory's snapshot): not those that
    only refuse settings the run would ignore."""
    if t.steps % t.phases:
        raise ValueError(f"trainer.phases={t.phases} does not divide trainer.steps={t.steps}; "
                         "choose phases so that every phase has the same number of steps")
    if t.replay_rows != "all" and t.algorithm == "ppo":
        raise ValueError(f"trainer.replay_rows={t.replay_rows} picks rows by their group's advantage, which "
                         "algorithm ppo (a critic, token advantages) does not have; use replay_rows=all or a "
                         "group algorithm (grpo, dr_grpo, rloo, reinforce_pp)")
    if t.algorithm != "ppo" and not frozen:  # a value other than the default would be silently ignored
        unused = [k for k in CRITIC_SETTINGS if getattr(t, k) != type(t).model_fields[k].default]
        if unused:
            raise ValueError(f"{', '.join('trainer.' + k for k in unused)}: settings of the critic, which algorithm "
                             f"{t.algorithm} does not train (only ppo does); remove them or use algorithm ppo")
    if not t.std_normalize and t.algorithm != "grpo" and not frozen:
        raise ValueError(f"trainer.std_normalize=false changes only grpo's advantages, and algorithm {t.algorithm} "
                         "would ignore it (dr_grpo, rloo and reinforce_pp never divide by the group's std; ppo "
                         "has a critic); remove it, or use algorithm grpo")


def check_run(cfg) -> None:
    """Every rule, on a `RunConfig` whose sections are each valid."""
    _batches(cfg)
    _staleness(cfg)
    if cfg.sampler.fixed_lag:
        _fixed_lag(cfg)
    _replay(cfg)
    _rate_limiter(cfg)


def _batches(cfg) -> None:
    gps, ppb = cfg.trainer.groups_per_step, cfg.sampler.prompts_per_batch
    if gps % ppb and ppb % gps:
        raise ValueError(f"trainer.groups_per_step={gps} and sampler.prompts_per_batch={ppb}: one must divide the other")


def _staleness(cfg) -> None:
    s, t = cfg.sampler, cfg.trainer
    steps_per_batch = max(1, s.prompts_per_batch // t.groups_per_step)
    if t.sync_every + steps_per_batch - 1 > s.max_staleness + 1:
        raise ValueError(
            f"trainer.sync_every={t.sync_every}, sampler.max_staleness={s.max_staleness}"
            + (f" and batches of {steps_per_batch} steps (sampler.prompts_per_batch / trainer.groups_per_step)"
               if steps_per_batch > 1 else "")
            + ": a batch's last group may be trained at most max_staleness steps after the version that "
            "generated the batch, so sync_every + steps per batch - 1 must be at most max_staleness + 1, or "
            "the run stalls; lower trainer.sync_every or sampler.prompts_per_batch, or raise "
            "sampler.max_staleness"
        )


def _fixed_lag(cfg) -> None:
    s, t = cfg.sampler, cfg.trainer
    if t.keep_policy_versions * t.sync_every <= s.max_staleness:
        raise ValueError(
            f"sampler.fixed_lag with trainer.keep_policy_versions={t.keep_policy_versions}, trainer.sync_every="
            f"{t.sync_every} and sampler.max_staleness={s.max_staleness}: the version a batch is scheduled on "
            "is up to max_staleness steps old, so keep_policy_versions * sync_every must be above it")


def _replay(cfg) -> None:
    t, b = cfg.trainer, cfg.buffer
    if t.replay_epochs and b.max_replays_per_group == 0:
        raise ValueError(f"trainer.replay_epochs={t.replay_epochs} but buffer.max_replays_per_group=0: nothing "
                         "would ever be eligible; set buffer.max_replays_per_group >= 1 or trainer.replay_epochs=0")
    lo, hi = b.l2_min_reward_mean, b.l2_max_reward_mean
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"buffer.l2_min_reward_mean={lo} is above buffer.l2_max_reward_mean={hi}: no group could "
                         "be promoted to L2 for replay; swap them or drop one")


def _rate_limiter(cfg) -> None:
    """The rate limiter's bounds (`pipeline.buffer.ratelimit`) must let a sampler batch in and let
    the trainer's step fill: else the sampler waits for consumption that never comes."""
    b, s, t = cfg.buffer, cfg.sampler, cfg.trainer
    need = max(s.prompts_per_batch, t.groups_per_step)
    why = (f"one sampler batch (sampler.prompts_per_batch={s.prompts_per_batch}) and one trainer step "
           f"(trainer.groups_per_step={t.groups_per_step}) take {need} groups")
    if b.max_fresh_backlog is not None and b.max_fresh_backlog < need:
        raise ValueError(f"buffer.max_fresh_backlog={b.max_fresh_backlog}: {why}, so the sampler would wait for ever; "
                         f"set it to at least {need}")
    if b.samples_per_insert is None:
        return
    if b.rate_error_groups < need:
        raise ValueError(f"buffer.rate_error_groups={b.rate_error_groups} with buffer.samples_per_insert: {why}, so "
                         f"the sampler would wait for ever; set it to at least {need}")
    most = 1 + (b.max_replays_per_group if t.replay_epochs else 0)
    if b.samples_per_insert > most:
        raise ValueError(
            f"buffer.samples_per_insert={b.samples_per_insert}: a group is trained on at most {most} time(s) here "
            f"(once fresh{f', and up to buffer.max_replays_per_group={b.max_replays_per_group} replays' if most > 1 else ', replay being off (trainer.replay_epochs=0)'}), "
            f"so the sampler would fall behind the bound and wait for ever; set it to at most {most}")
