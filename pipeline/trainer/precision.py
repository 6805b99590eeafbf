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

On CPU, a one-process bf16/fp16 trainer also:

- runs attention eagerly (`attn_implementation="eager"`): the CPU flash-attention kernel's backward
  in bf16 took 6x its float32 time, while eager attention's batched matmuls use the bf16 matrix
  units. Measured on batches shaped like the generation-heavy config's (tiny Qwen2, one thread, a
  CPU with AMX): a step took 0.48 s in float32, 0.56 s under bf16 autocast with the flash kernel
  and 0.30 s with eager attention;
- keeps the output layer (the LM head) in float32, so that the log-probs, which the objective
  compares with the sampler's, are not rounded to bf16's 8 bits (it is a small share of the work).
"""

from __future__ import annotations

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
                _cpu_layout(model)
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


def _cpu_layout(model: torch.nn.Module) -> None:
    """Eager attention and a float32 LM head for autocast on CPU (see the module docstring)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        linear = head.forward

        @torch.autocast(device_type="cpu", enabled=False)
        def full(x: torch.Tensor) -> torch.Tensor:
            return linear(x.float())

        head.forward = full
