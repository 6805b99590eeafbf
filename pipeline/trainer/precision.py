"""Mixed precision: fp32 master weights and optimizer state, compute in the run's `model.dtype`.

The trainer always loads the policy in float32; that copy is what AdamW updates, so updates far
below bf16's resolution (lr 1e-6 on weights of size ~1) are not rounded away. Compute runs in the
run's dtype:

- one process: the policy's forward runs under `torch.autocast(dtype)` (matmuls in bf16/fp16,
  reductions and the loss in fp32);
- several ranks (FSDP2): `MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)`: the
  sharded fp32 parameters are gathered as bf16 for compute and gradients are reduced in fp32;
- float16 also scales the loss (`torch.amp.GradScaler`) so small gradients do not underflow.
  With several ranks use bfloat16 (no scaler needed).

The reference model needs no master copy: it is loaded in the compute dtype directly. The
sampler loads published weights in `model.dtype` (the serving dtype), which is also the compute
dtype unless `trainer.dtype` names another.

On CPU, a one-process bf16/fp16 trainer instead computes through a copy of the policy in the
compute dtype (`compute_module`), the float32 parameters staying the master copy that the optimizer
updates, checkpoints save and publications read:

- before a forward pass the copy takes the master values that changed since the last one (an
  optimizer step, a checkpoint loaded); each of its gradients is added to the master's float32
  gradient as soon as backward produces it, so micro-batches accumulate in float32;
- activations stay in the compute dtype between layers. Under autocast the residual stream stays
  float32 and every matmul casts its input: on batches shaped like the generation-heavy config's
  (tiny Qwen2, one thread, a CPU with AMX) a step took 0.19 s against 0.21-0.23 s under autocast,
  alternating in one process, with the same losses and statistics to 2-3 digits; in whole runs of
  that config (300 steps, runs alternating A B B A) the trainer was busy 75.4 and 59.5 s against
  77.3 and 65.2 s;
- attention runs eagerly (`attn_implementation="eager"`): the CPU flash-attention kernel's backward
  in bf16 took 6x its float32 time, while eager attention's batched matmuls use the bf16 matrix
  units (a step took 0.48 s in float32, 0.56 s under bf16 autocast with the flash kernel and 0.30 s
  with eager attention);
- the output layer (the LM head) computes in float32 on the master's own weights, so that the
  log-probs, which the objective compares with the sampler's, are not rounded to bf16's 8 bits (it
  is a small share of the work).
"""

from __future__ import annotations

import copy
import functools
from contextlib import nullcontext
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Precision:
    dtype: torch.dtype = torch.float32      # compute dtype
    device_type: str = "cpu"
    sharded: bool = False                   # FSDP2 casts parameters itself
    scaler: object = None                   # torch.amp.GradScaler for float16

    @classmethod
    def of(cls, dtype: str, device: torch.device, sharded: bool) -> "Precision":
        compute = DTYPES[dtype]
        if compute is torch.float16 and sharded:
            raise ValueError("model.dtype=float16 with several trainer ranks: use bfloat16 (FSDP2 mixed precision "
                             "without a sharded loss scaler)")
        scaler = torch.amp.GradScaler(device.type) if compute is torch.float16 else None
        return cls(dtype=compute, device_type=device.type, sharded=sharded, scaler=scaler)

    @property
    def mixed(self) -> bool:
        return self.dtype is not torch.float32

    @property
    def name(self) -> str:
        """The dtype's name in configs and `from_pretrained(dtype=...)`: "bfloat16"."""
        return str(self.dtype).removeprefix("torch.")

    def mp_policy(self):
        """FSDP2's policy for `fully_shard(..., mp_policy=...)` (None: full precision)."""
        if not self.mixed:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def autocast(self):
        if not self.mixed or self.sharded:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Run `model`'s forward in the compute dtype (one process; FSDP2 does it when sharded).
        The forward is patched on the instance, so state-dict keys stay those of the model."""
        if self.mixed and not self.sharded:
            if self.device_type == "cpu":
                model.forward = _ComputeCopy(model, self.dtype)
            else:
                model.forward = torch.autocast(device_type=self.device_type, dtype=self.dtype)(model.forward)
        return model

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, opt, params: list, max_norm: float) -> torch.Tensor:
        """Unscale (float16), clip to `max_norm`, step; returns the gradient norm before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if self.scaler is not None:
            self.scaler.step(opt)  # skips the step when a gradient is inf/nan
            self.scaler.update()
        else:
            opt.step()
        return norm


FULL = Precision()


def compute_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward computes `model`'s: its compute-dtype copy on CPU (see the module
    docstring), else `model` itself."""
    fwd = model.__dict__.get("forward")
    return fwd.module if isinstance(fwd, _ComputeCopy) else model


class _ComputeCopy:
    """`model.forward` of a one-process mixed-precision trainer on CPU: runs a copy of `model` whose
    parameters are in `dtype` (not registered in `model`, whose state dict stays its own), refreshed
    from `model`'s float32 parameters when they change, with gradients sent back to them."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.module = twin = copy.deepcopy(model)
        if isinstance(head, torch.nn.Linear):
            # the copy's LM head is the master's (float32) layer: logits in float32, its gradient
            # straight to the master (a tied input embedding keeps a copy of its own in `dtype`)
            twin_head = twin.get_output_embeddings()
            twin_head.weight, twin_head.bias = head.weight, head.bias
            twin_head.forward = lambda x, _f=twin_head.forward: _f(x.float())
        masters = {id(p) for p in model.parameters()}
        copies = dict(twin.named_parameters(remove_duplicate=False))
        self.pairs, seen = [], set()
        for name, p in model.named_parameters(remove_duplicate=False):
            q = copies[name]
            if id(q) in masters or id(q) in seen:
                continue
            seen.add(id(q))
            q.data = q.data.to(dtype)
            q.register_post_accumulate_grad_hook(functools.partial(_add_to_master, p))
            self.pairs.append((p, q))
        self.master = model
        self._synced: list = [None] * len(self.pairs)

    def __call__(self, *args, **kwargs):
        with torch.no_grad():
            for i, (p, q) in enumerate(self.pairs):
                stamp = (p._version, p.data_ptr())
                if self._synced[i] != stamp:
                    q.copy_(p)
                    self._synced[i] = stamp
        if self.module.training != self.master.training:
            self.module.train(self.master.training)
        return self.module(*args, **kwargs)


def _add_to_master(master: torch.nn.Parameter, twin: torch.Tensor) -> None:
    """A gradient of the compute copy, added to its master parameter's float32 gradient."""
    grad = twin.grad.to(master.dtype)
    twin.grad = None
    if master.grad is None:
        master.grad = grad
    else:
        master.grad.add_(grad)
