"""A llama.cpp model seen through the three calls the data generator's labelling makes of a transformers causal LM,
so that ``data_gen.continuation_labels.label_continuation`` labels with llama.cpp's own logits (the replay check of the
llama.cpp benchmark rows: ``runtimes.llamacpp.replay_check``).

The labeller reads a causal LM through ``get_decoder()(input_ids, attention_mask).last_hidden_state``, then
``get_output_embeddings()`` on the rows it labels, and the draft's rollouts through ``generate``. Here the "hidden
state" of a position is llama.cpp's logits row and the output embedding the identity, so the labeller's heads give
llama.cpp's logits unchanged; ``generate`` continues greedily. Each sequence is read on top of the longest prefix
already in llama.cpp's cache (``Llama.n_tokens`` rolled back to it, as ``runtimes.llamacpp.draft`` does), so the many
rollouts of one prompt re-read only their own tail. The model must be loaded with ``logits_all`` (every position's
logits kept in ``Llama.scores``).

Usage::

    llm = load_llama(path, n_threads=2, n_ctx=1024, logits_all=True)
    models = LabelModels(LlamaCausalLM(draft_llm), LlamaCausalLM(target_llm))
    records, stats = label_continuation(models, prompt, output, LabelOptions(min_shared_prefix=0, store_hidden=False),
                                        sample_id="p0", rollout_len=16, label_batch_tokens=1)
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
        """[len(tokens), V] logits of every position of ``tokens`` (row j predicts token j + 1), reading only what
        follows the longest prefix already cached."""
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
        """Greedy continuations of left-padded rows, ``generation_config.max_new_tokens`` each (no stop at an end of
        sequence: the rollouts a speculative draft would make); returns [B, W + new] ids as transformers does."""
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
