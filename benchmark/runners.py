"""Running one row on the prompts of a bench: target-only (``target.generate``, and on the reference compute path),
transformers' assisted generation, a stop policy inside transformers' generate, and the engine with one policy. Every
runner decodes through :func:`timed_prompts` (seeded, timed alone, in inference mode) except the engine, which
decodes in batches of ``batch_size``. Target-only and the engine also run one prompt a step at a time
(:func:`target_only_lane`, :func:`engine_lane`) for ``benchmark.interleave``."""
from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from benchmark.bench import Bench
from benchmark.interleave import Lane
from benchmark.rows import HF_METHOD, Row
from compute.models import load_model
from compute.timing import clock
from data_gen.config import ModelsConfig
from decoding.engine import DecodeStats, SpeculativeDecoder
from decoding.policies import build_decoder, build_policy, policy_label
from decoding.sampling import TokenSampler
from predictors.runtime_rules import TransformersRule
from runtimes.transformers.assisted import generate_with_policy


def generate_kwargs(bench: Bench) -> dict[str, Any]:
    """The keyword arguments of ``generate`` for the bench's decoding: its length and stop tokens, greedy or sampled."""
    d = bench.decoding
    kw: dict[str, Any] = {"max_new_tokens": d.max_new_tokens, "eos_token_id": bench.eos,
                          "pad_token_id": bench.tokenizer.pad_token_id}
    if d.temperature > 0:
        kw.update(do_sample=True, temperature=d.temperature, top_p=d.top_p, top_k=None)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kw


def new_tokens(bench: Bench, seq: torch.Tensor, prompt_len: int) -> list[int]:
    """The generated part of ``seq``, cut after the first of the bench's stop tokens."""
    new = seq[prompt_len:].tolist()
    for j, t in enumerate(new):
        if t in bench.eos:
            return new[: j + 1]
    return new


def timed_prompts(bench: Bench, row: Row, decode: Callable[[int, torch.Tensor], torch.Tensor]) -> Row:
    """The one timed loop: ``decode(i, ids [1, T]) -> sequences [1, T + new]`` per prompt, seeded and timed alone."""
    dev = bench.target.device
    for i, ids in enumerate(bench.prompts):
        x = torch.tensor([ids], device=dev)
        torch.manual_seed(bench.seed_of(i))
        t0 = clock(dev)
        with torch.inference_mode():  # every row alike: the engine decodes in inference mode (fewer dispatch steps)
            out = decode(i, x)
        row.seconds.append(clock(dev) - t0)
        row.outputs.append(new_tokens(bench, out[0], len(ids)))
    return row


def run_target_only(bench: Bench, name: str = "target-only", target: PreTrainedModel | None = None) -> Row:
    """``target.generate``: one target forward per token (``target`` defaults to the bench's)."""
    model = target if target is not None else bench.target
    kw = generate_kwargs(bench)
    row = timed_prompts(bench, Row(name, "target.generate", note="reference"),
                        lambda i, x: model.generate(x, attention_mask=torch.ones_like(x), **kw))
    row.target_calls = row.tokens
    for _ in row.outputs:
        row.count_prompt(0, 0, 0)
    if target is None:
        bench.reference = row.outputs
        row.prefill_seconds = [prefill_seconds(model, ids) for ids in bench.prompts]
    return row


TARGET_LOOP = "target forward loop"
"""The ``method`` of target-only decoded a token a step (:func:`target_only_lane`)."""


def target_only_lane(bench: Bench) -> Lane:
    """Target-only on the bench's one prompt a token a step: the target's forward over its cache, the token picked as
    the engine picks (greedy: ``generate``'s tokens; sampling: seeded by the prompt, ``generate``'s distribution)."""
    model, ids = bench.target, bench.prompts[0]
    row = Row("target-only", TARGET_LOOP, note="reference")

    def finish(out: list[int], seconds: float) -> Row:
        row.outputs.append(out)
        row.seconds.append(seconds)
        row.target_calls = len(out)
        row.count_prompt(0, 0, 0)
        bench.reference = row.outputs
        row.prefill_seconds = [prefill_seconds(model, ids)]
        return row

    return Lane(row.name, _target_steps(model, ids, bench), finish)


@torch.inference_mode()
def _target_steps(model: PreTrainedModel, ids: list[int], bench: Bench) -> Generator[int, None, list[int]]:
    """One target forward a step (the prompt's with the first token), yielding the new tokens so far; returns them."""
    d, eos = bench.decoding, set(bench.eos)
    sampler, gen = TokenSampler(d.temperature, d.top_p), None
    if d.temperature > 0:
        gen = torch.Generator(device=model.device)
        gen.manual_seed(bench.seed_of(0))
    cache = DynamicCache(config=model.config)
    x, out = torch.tensor([ids], device=model.device), []
    while True:
        logits = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        out.append(int(sampler.pick(logits.float(), gen)[0]))
        if out[-1] in eos or len(out) >= d.max_new_tokens:
            return out
        yield len(out)
        x = torch.tensor([[out[-1]]], device=model.device)


@torch.inference_mode()
def prefill_seconds(model: PreTrainedModel, ids: list[int]) -> float:
    """Seconds of one forward of a prompt into a fresh cache (target-only's prefill, timed after its row: the replay
    check adds each row's prefill to the curve's decoding time)."""
    x = torch.tensor([ids], device=model.device)
    t0 = clock(model.device)
    model(input_ids=x, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return clock(model.device) - t0


class ForwardCounter:
    """Counts a model's forward calls through a hook on that model object only (no library class is patched)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


HF_SETTINGS: dict[str, dict[str, Any]] = {
    "heuristic": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic",
                  "assistant_confidence_threshold": 0.0},
    "default": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.4},
}


def run_hf(bench: Bench, kind: str, settings: dict[str, Any] | None = None) -> Row:
    """transformers assisted generation with the draft's generation_config set for ``kind`` (restored afterwards), or
    to ``settings`` (the ``recommended`` row's tuned ones).

    Rounds are the target's forward calls (its first reads the prompt and verifies the first round's drafts in one
    pass: assisted generation has no separate prefill), drafted tokens the draft's forward calls (each proposes one
    token), accepted tokens = emitted tokens - rounds.
    """
    gc = bench.draft.generation_config
    if settings is not None:
        settings = dict(settings)
    elif kind.startswith("static:"):
        settings = {"num_assistant_tokens": int(kind.split(":")[1]), "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.0}
    else:
        settings = HF_SETTINGS[kind]
    saved = {k: getattr(gc, k, None) for k in settings}
    kw = generate_kwargs(bench)
    t_calls, d_calls = ForwardCounter(bench.target), ForwardCounter(bench.draft)
    marks: list[tuple[int, int]] = []  # both models' forward calls before each prompt: its rounds and drafts

    def decode(i: int, x: torch.Tensor) -> torch.Tensor:
        for k, v in settings.items():  # the heuristic schedule adapts num_assistant_tokens: reset per prompt
            setattr(gc, k, v)
        marks.append((t_calls.calls, d_calls.calls))
        return bench.target.generate(x, attention_mask=torch.ones_like(x), assistant_model=bench.draft, **kw)

    try:
        row = timed_prompts(bench, Row(f"hf:{kind}", HF_METHOD), decode)
        row.note = ", ".join(f"{k}={v}" for k, v in settings.items())
    finally:
        t_calls.close()
        d_calls.close()
        for k, v in saved.items():
            setattr(gc, k, v)
    row.rounds = row.target_calls = t_calls.calls
    row.draft_tokens = d_calls.calls
    row.accepted = row.tokens - row.rounds
    marks.append((t_calls.calls, d_calls.calls))
    for (t0, d0), (t1, d1), out in zip(marks, marks[1:], row.outputs):
        row.count_prompt(t1 - t0, d1 - d0, len(out) - (t1 - t0))
    row.spec = TransformersRule(**settings).spec()  # the rule the replay check replays for this row
    # both models' prompt passes (after the row, as target-only's): the replay check adds them to the curve's time
    row.prefill_seconds = [prefill_seconds(bench.target, ids) + prefill_seconds(bench.draft, ids)
                           for ids in bench.prompts]
    return row


def run_hf_policy(bench: Bench, spec: str) -> Row:
    """A stop policy inside transformers' generate (runtimes.transformers.assisted)."""
    policy = build_policy(spec, draft=bench.draft, draft_tokenizer=bench.tokenizer,
                          max_draft_len=bench.decoding.max_draft_len, force=bench.decoding.force)
    kw = generate_kwargs(bench)
    per_prompt: list[dict] = []

    def decode(i: int, x: torch.Tensor) -> torch.Tensor:
        out, st = generate_with_policy(bench.target, bench.draft, x, policy, bench.decoding.top_k_features,
                                       attention_mask=torch.ones_like(x), **kw)
        per_prompt.append(st)
        return out

    row = timed_prompts(bench, Row(f"hfp:{spec}", "transformers + policy", kind=policy.kind), decode)
    for st in per_prompt:
        rounds = [(d, a) for d, a in zip(st.drafted_lengths, st.accepted_lengths) if d > 0]
        row.count_prompt(len(rounds), sum(d for d, _ in rounds), sum(a for _, a in rounds))
        row.rounds += len(rounds)
        row.target_calls += len(st.accepted_lengths)
        row.draft_tokens += sum(d for d, _ in rounds)
        row.accepted += sum(a for _, a in rounds)
    row.note = f"stop time {sum(st.stop_time for st in per_prompt):.3f}s"
    return row


def engine_row(bench: Bench, spec: str | Any, label: str | None = None,
               rebuild: dict[str, Any] | None = None) -> tuple[Row, SpeculativeDecoder]:
    """An engine row's decoder (a spec or a ready policy) and its empty row; ``rebuild`` ({"spec", "threshold"})
    records how a ready policy is built again (default: the spec itself)."""
    d = bench.decoding
    dec = build_decoder(
        bench.draft, bench.target, spec, draft_tokenizer=bench.tokenizer, target_tokenizer=bench.tokenizer,
        companion=bench.companion, force=d.force, temperature=d.temperature, top_p=d.top_p,
        max_draft_len=d.max_draft_len, top_k_features=d.top_k_features, cost_model=bench.cost_model,
    )
    pol = dec.policy
    row = Row(label or policy_label(spec, pol), "engine", kind=pol.kind, exact_by_design=pol.exact,
              verification=pol.verification,
              thresholded=pol.has_threshold and pol.round_rule.exact and pol.round_rule.sends_all)
    info = rebuild or {"spec": spec if isinstance(spec, str) else ""}
    row.spec, row.threshold = info.get("spec", ""), info.get("threshold")
    return row, dec


def engine_lane(bench: Bench, spec: str | Any, label: str | None = None,
                rebuild: dict[str, Any] | None = None) -> Lane | None:
    """The engine row on the bench's one prompt a round at a time (``benchmark.interleave``); None for a policy
    whose time is not all measured (the sampling oracle's look-ahead) or that needs target-only's output first."""
    if len(bench.prompts) != 1:
        return None
    row, dec = engine_row(bench, spec, label, rebuild)
    if dec.policy.needs_target:
        return None
    ids = bench.prompts[0]
    x = torch.tensor([ids], device=bench.target.device)
    steps = dec.decode_steps(x, None, bench.decoding.max_new_tokens, bench.eos, bench.seed_of(0))

    def finish(result: tuple[torch.Tensor, DecodeStats], seconds: float) -> Row:
        out, st = result
        add_engine_decode(row, bench, out, st, len(ids), 1, seconds)
        return close_engine_row(row, st, dec)

    return Lane(row.name, steps, finish)


def run_engine(bench: Bench, spec: str | Any, label: str | None = None, rebuild: dict[str, Any] | None = None) -> Row:
    """The engine with one policy (a spec or a ready policy), prompts in batches of ``batch_size``; ``rebuild``
    ({"spec", "threshold"}) records how a ready policy is built again (default: the spec itself)."""
    d = bench.decoding
    row, dec = engine_row(bench, spec, label, rebuild)
    pol = dec.policy
    total = None
    pad = bench.tokenizer.pad_token_id if bench.tokenizer.pad_token_id is not None else bench.eos[0]
    for start in range(0, len(bench.prompts), d.batch_size):
        chunk = bench.prompts[start : start + d.batch_size]
        width = max(len(p) for p in chunk)
        x = torch.full((len(chunk), width), pad, dtype=torch.long)  # [B, T] left-padded
        m = torch.zeros_like(x)
        for b, p in enumerate(chunk):
            x[b, width - len(p) :] = torch.tensor(p)
            m[b, width - len(p) :] = 1
        look_ahead = None
        if pol.needs_target and d.temperature == 0 and bench.reference is not None:
            look_ahead = bench.reference[start : start + len(chunk)]  # the greedy oracle: no target steps
        out, st = dec.generate(x, m, d.max_new_tokens, bench.eos, bench.seed_of(start), reference=look_ahead)
        total = st if total is None else total + st
        add_engine_decode(row, bench, out, st, width, len(chunk), st.wall_time)
    assert total is not None
    return close_engine_row(row, total, dec)


def add_engine_decode(row: Row, bench: Bench, out: torch.Tensor, st: DecodeStats, width: int, n: int,
                      seconds: float) -> None:
    """One engine decode of ``n`` prompts (left-padded to ``width``) into ``row``: outputs, seconds (``seconds``
    measured, shared in proportion to tokens), prefill and round counters."""
    row.prefill_seconds += [st.prefill_time / n] * n
    if st.analysis_time > 0:  # sampling oracle: the look-ahead replaced by one priced verification per round
        assert bench.cost_model is not None
        seconds = st.wall_time - st.analysis_time - st.target_time
        seconds += sum(bench.cost_model.target_time(k + 1) for k in st.drafted_lengths)
    for b in range(n):  # a batch's time is shared by its prompts in proportion to their tokens
        row.outputs.append(new_tokens(bench, out[b], width))
    n_new = [len(o) for o in row.outputs[-n:]]
    row.seconds += [seconds * k / max(sum(n_new), 1) for k in n_new]
    for _ in range(n):  # a batch's counters cover its prompts together: per prompt only at batch size 1
        one = n == 1
        row.count_prompt(st.rounds if one else None, st.drafted if one else None, st.accepted if one else None)


def close_engine_row(row: Row, total: DecodeStats, dec: SpeculativeDecoder) -> Row:
    """An engine row's totals and note from its decodes' summed counters."""
    pol = dec.policy
    row.rounds, row.accepted = total.rounds, total.accepted
    row.target_calls = total.target_calls - total.prompt_passes  # target passes after each prompt's (the prefill's)
    row.draft_tokens, row.decode = total.drafted, total
    row.estimated = total.analysis_time > 0
    if total.analysis_time > 0:
        row.note = "analysis only: time estimated (look-ahead replaced by the measured verification curve)"
    elif pol.needs_target:
        row.note = "look-ahead read from target-only's output (greedy); time measured"
    if not dec.policy.exact:
        row.note = "approximate (sequential verification)"
    return row


def run_reference(bench: Bench, models: ModelsConfig, max_new_tokens: int, warmup: bool = True) -> Row:
    """Target-only on the target loaded again as ``models`` says (another compute path: ``reference_compute``; loaded
    once per run, ``release_reference`` frees it), ``max_new_tokens`` per prompt (``warmup``: a short generation
    first)."""
    target = bench.shared.get("reference_target")
    if target is None:
        target, _ = load_model(models.spec(models.target))
        bench.shared["reference_target"] = target
        if warmup:
            kw = generate_kwargs(bench.with_new_tokens(4))
            x = torch.tensor([bench.prompts[0]], device=target.device)
            target.generate(x, attention_mask=torch.ones_like(x), **kw)
    row = run_target_only(bench.with_new_tokens(max_new_tokens), f"target-only ({models.compute})", target)
    row.reference = True
    row.note = (f"reference: target loaded with --models.compute {models.compute}, {max_new_tokens} new tokens a "
                "prompt")
    return row


def release_reference(bench: Bench) -> None:
    """Free the reference target (if one was loaded)."""
    bench.shared.pop("reference_target", None)


def warm_up(bench: Bench) -> None:
    """Each path once on a 4-token generation of the first prompt (kernels, caches, oneDNN primitives)."""
    short = bench.with_new_tokens(4, prompts=1)
    run_target_only(short)
    run_hf(short, "static:3")
    run_engine(short, "static:3")
