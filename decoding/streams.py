"""One model's side of a batched decoding call: its KV cache (transformers ``DynamicCache``) and the per-position
validity mask that turns padding and rejected drafts into masked holes (positions come from the mask)."""
from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from compute.models import layer_output

__all__ = ["Stream"]


class Stream:
    """One model's KV cache plus its per-position validity mask [B, S] (0 = padding or a discarded token)."""

    def __init__(self, model: PreTrainedModel, batch: int, device: torch.device) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.tapped: Tensor | None = None

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @torch.inference_mode()
    def forward(
        self, tokens: list[list[int]], left_pad: bool, keep_logits: int = 1, hidden: bool = False,
        tap: int | None = None
    ) -> tuple[Tensor, Tensor | None, list[list[int]]]:
        """Feed each sequence its tokens (possibly none); returns (logits [B, n, V] of the last n = ``keep_logits``
        positions, 0 meaning every position (transformers' ``logits_to_keep``), last hidden, cache indices). With
        ``tap`` = N, ``self.tapped`` holds the [B, H] residual stream after the first N layers at the last position
        (the states of a companion that is those layers)."""
        batch = len(tokens)
        n = max(1, max(len(t) for t in tokens))
        device = self.mask.device
        ids = torch.zeros(batch, n, dtype=torch.long, device=device)
        m = torch.zeros(batch, n, dtype=torch.long, device=device)
        idx: list[list[int]] = []
        for b, t in enumerate(tokens):
            start = n - len(t) if left_pad else 0
            if t:
                ids[b, start : start + len(t)] = torch.tensor(t, device=device)
                m[b, start : start + len(t)] = 1
            idx.append([self.length + start + j for j in range(len(t))])
        pos = (self.mask.sum(-1, keepdim=True) + m.cumsum(-1) - 1).clamp_min(0)
        self.mask = torch.cat([self.mask, m], dim=1)
        with layer_output(self.model.get_decoder().layers, tap) as seen:
            out = self.model(
                input_ids=ids,
                attention_mask=self.mask,
                position_ids=pos,
                past_key_values=self.cache,
                use_cache=True,
                output_hidden_states=hidden,
                logits_to_keep=keep_logits,
            )
        h = out.hidden_states[-1][:, -1] if hidden else None
        self.tapped = seen[-1][:, -1] if seen else None
        return out.logits, h, idx

    def discard(self, b: int, indices: list[int]) -> None:
        if indices:
            self.mask[b, indices] = 0

    def crop(self) -> None:
        """Drop trailing positions no sequence still needs."""
        valid = self.mask.any(0).nonzero()
        keep = int(valid.max()) + 1 if valid.numel() else 0
        if keep < self.length:
            self.cache.crop(keep - self.length)  # negative: tokens to remove
            self.mask = self.mask[:, :keep]
