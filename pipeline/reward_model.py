"""A reward model: a Hugging Face sequence classifier scoring prompt + completion, in batches.

`reward.kind: model` with `reward.model: <folder or fsspec URL>` (any `AutoModelForSequenceClassification`
checkpoint, e.g. a Llama/Qwen reward model with a one-label score head). The text scored is the
prompt's messages plus the completion as the assistant's turn, through the reward model's own chat
template when its tokenizer has one (else the prompt text followed by the completion). The score is
the logit `reward.model_label` at the last non-padding token (Hugging Face's pooling), optionally
squashed by a sigmoid. The model sits on `reward.device` (cpu, cuda, cuda:N), apart from the
policy's device when the run gives it one of its own.
"""

from __future__ import annotations

import torch

from .config import ConfigError
from .model_cache import localize


def check_device(device: str, field: str = "reward.device") -> torch.device:
    try:
        d = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"{field}: invalid device {device!r}; use cpu, cuda or cuda:N") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{field}: {device!r} but torch sees no CUDA device here; use cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ConfigError(f"{field}: {device!r} but only {torch.cuda.device_count()} CUDA device(s) are "
                              "visible (CUDA_VISIBLE_DEVICES renumbers them from 0)")
    return d


class RewardModel:
    def __init__(self, path: str, device: str = "cpu", dtype: str = "float32", label: int = 0,
                 batch_size: int = 16, sigmoid: bool = False):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = check_device(device)
        local = localize(path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(local, local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(local, local_files_only=True,
                                                                       dtype=getattr(torch, dtype))
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward.model: {path!r} is not a Hugging Face sequence-classification "
                              f"model folder ({type(e).__name__}: {e})") from None
        tok = self.tokenizer
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"  # positions start at 0 for every row
        tok.truncation_side = "left"  # an overlong text keeps its end: the completion
        if model.config.pad_token_id is None:  # the pooling finds the last token through it
            model.config.pad_token_id = tok.pad_token_id
        if not 0 <= label < model.config.num_labels:
            raise ConfigError(f"reward.model_label: {label} but the model has {model.config.num_labels} "
                              f"label(s); use 0..{model.config.num_labels - 1}")
        self.model = model.to(self.device).eval()
        self.label, self.batch_size, self.sigmoid = label, batch_size, sigmoid
        limits = [n for n in (getattr(model.config, "max_position_embeddings", None), tok.model_max_length)
                  if isinstance(n, int) and 0 < n < 1_000_000]
        self.max_length = min(limits) if limits else None

    def text_of(self, messages, completion: str) -> tuple[str, bool]:
        """The text scored, and whether it came from the chat template (which adds its own
        special tokens)."""
        if isinstance(messages, str):
            return messages + completion, False
        messages = [dict(m) for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            turns = messages + [{"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(turns, tokenize=False), True
        return "\n".join(m["content"] for m in messages) + completion, False

    @torch.no_grad()
    def score(self, prompts: list, completions: list[str]) -> list[float]:
        """One score per (prompt messages, completion), in order."""
        texts = [self.text_of(p, c) for p, c in zip(prompts, completions)]
        templated = bool(texts) and texts[0][1]
        order = sorted(range(len(texts)), key=lambda i: len(texts[i][0]))  # less padding per batch
        out = [0.0] * len(texts)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            enc = self.tokenizer([texts[i][0] for i in idx], padding=True, truncation=self.max_length is not None,
                                 max_length=self.max_length, add_special_tokens=not templated,
                                 return_tensors="pt").to(self.device)
            logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
            values = logits[:, self.label].float()
            if self.sigmoid:
                values = torch.sigmoid(values)
            for i, v in zip(idx, values.cpu().tolist()):
                out[i] = v
        return out

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
