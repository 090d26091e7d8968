"""A llama.cpp model behind the three calls the labeller makes of a transformers causal LM, so the replay check of the
llama.cpp rows labels with llama.cpp's own logits.

A position's "hidden state" is its logits row and the output embedding the identity, so the labeller's heads return
llama.cpp's logits; each sequence reads on top of the longest prefix already cached. Load the model with ``logits_all``.

Usage: ``models = LabelModels(LlamaCausalLM(draft_llm), LlamaCausalLM(target_llm))``
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["LlamaCausalLM"]


@dataclass
class _DecoderOutput:
    last_hidden_state: Tensor


class LlamaCausalLM(nn.Module):
    """``llm`` (a ``llama_cpp.Llama`` with ``logits_all``) as the labeller's causal LM: states are logits rows."""

    def __init__(self, llm: Any) -> None:
        super().__init__()
        if not getattr(llm, "_logits_all", False):
            raise ValueError("LlamaCausalLM needs a llama.cpp model loaded with logits_all=True (every position's "
                             "logits are labelled)")
        self.llm = llm
        self.config = SimpleNamespace(name_or_path=str(getattr(llm, "model_path", "")))  # names the records' model
        self._device_anchor = nn.Parameter(torch.zeros(0), requires_grad=False)  # next(parameters()).device: CPU

    def get_decoder(self) -> LlamaCausalLM:
        return self

    def get_output_embeddings(self) -> nn.Module:
        return nn.Identity()

    def read(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens), V] logits of every position (row j predicts token j + 1), reading only what follows the cached
        prefix."""
        llm = self.llm
        cached = llm.input_ids[: llm.n_tokens].tolist()
        keep = 0
        for a, b in zip(cached, tokens):
            if a != b:
                break
            keep += 1
        llm.n_tokens = keep  # eval removes every cached position from n_tokens on
        if keep < len(tokens):
            llm.eval(tokens[keep:])
        return llm.scores[: len(tokens)]

    def forward(self, input_ids: Tensor, attention_mask: Tensor, use_cache: bool = False,
                **_: Any) -> _DecoderOutput:
        """[B, W, V] logits of right-padded rows (zeros at padding); one row at a time through llama.cpp."""
        if use_cache:
            raise ValueError("LlamaCausalLM reads whole sequences: label with LabelOptions(min_shared_prefix=0)")
        lens = attention_mask.sum(1).tolist()
        out = torch.zeros(input_ids.shape[0], input_ids.shape[1], int(self.llm.n_vocab()))
        for b, n in enumerate(lens):
            if n:
                out[b, :n] = torch.from_numpy(np.array(self.read(input_ids[b, :n].tolist()), dtype=np.float32))
        return _DecoderOutput(out)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor, generation_config: Any, **_: Any) -> Tensor:
        """Greedy continuations of left-padded rows, ``max_new_tokens`` each, not stopped at EOS (a draft's rollouts);
        [B, W + new] ids as transformers returns."""
        if getattr(generation_config, "do_sample", False):
            raise ValueError("LlamaCausalLM generates greedily only (branch rollouts follow greedy decoding)")
        new = int(generation_config.max_new_tokens)
        pad = int(generation_config.pad_token_id or 0)
        out = torch.full((input_ids.shape[0], input_ids.shape[1] + new), pad, dtype=torch.long)
        out[:, : input_ids.shape[1]] = input_ids
        for b in range(input_ids.shape[0]):
            tokens = input_ids[b][attention_mask[b].bool()].tolist()
            for k in range(new):
                nxt = int(np.argmax(self.read(tokens)[-1]))
                tokens.append(nxt)
                out[b, input_ids.shape[1] + k] = nxt
        return out
