"""llama.cpp as a runtime: the draft hook's drafting loop and stop rules on scripted logits, its cache and feedback
bookkeeping on a fake draft, the vocabulary check and the missing-package message (no llama.cpp needed); with
llama-cpp-python installed and ``--real``, the hook's greedy output against target-only's and the curve measurement
on the packaged pair's GGUF files."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmark.rows import Row
from compute.gguf_files import check_gguf_file, ensure_gguf, gguf_stop_ids, gguf_tokenizer
from compute.timing import CostModel
from decoding.policies import build_policy
from predictors import goodput
from predictors.base import StopPolicy
from predictors.baselines import StaticLength
from predictors.round_rules import GOODPUT, SEQUENTIAL
from predictors.runtime_rules import LlamaCppRule
from runtimes.llamacpp.draft import SpecstopDraftModel, check_policy, draft_greedily, step_features
from runtimes.llamacpp.llama import (
    INSTALL_COMMAND,
    LlamaCppMissing,
    check_same_vocab,
    generate_greedy,
    llama_cpp_module,
    load_pair,
    measure_llamacpp_curve,
)
from runtimes.llamacpp.measure import LlamaCppBenchConfig, comparisons, load_llamacpp_bench

pytestmark = pytest.mark.llamacpp

V = 64


def logits_row(top: int, p: float) -> torch.Tensor:
    """[1, V] logits whose argmax ``top`` has probability ``p`` among the top 10 (nine runners-up at logit 0, the rest
    far below, so that its full-softmax probability is ``p`` too, to 1e-10)."""
    z = torch.full((1, V), -30.0)
    z[0, (top + 1 + torch.arange(9)) % V] = 0.0
    z[0, top] = math.log(9 * p / (1 - p))
    return z


class Script:
    """A scripted draft: step j's candidate is token j + 1 with top-1 probability ``ps[j]``; records what it is fed."""

    def __init__(self, ps: list[float]) -> None:
        self.rows = [logits_row(j + 1, p) for j, p in enumerate(ps)]
        self.fed: list[int] = []

    def feed(self, token: int) -> torch.Tensor:
        self.fed.append(token)
        return self.rows[len(self.fed)]


PS = [0.9, 0.8, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9]


def run(policy: StopPolicy, ps: list[float] = PS, cap: int = 8, cost: goodput.RoundCost | None = None):
    s = Script(ps)
    return draft_greedily(s.rows[0], s.feed, policy, policy.round_cap(cap), cost), s


def test_prefix_rule_drops_the_candidate_below_p_min():
    rnd, s = run(LlamaCppRule(8, 0, 0.5))
    assert rnd.tokens == [1, 2] and rnd.sent == 2 and rnd.steps == 3  # the third step is paid, its token dropped
    assert s.fed == [1, 2]
    assert rnd.scores[:2] == pytest.approx([0.9, 0.8], abs=1e-5)


def test_prefix_rule_n_max_and_n_min():
    rnd, s = run(LlamaCppRule(2, 0, 0.0))
    assert rnd.tokens == [1, 2] and rnd.sent == 2 and s.fed == [1]  # the n_max-th token is not read, as llama.cpp
    rnd, _ = run(LlamaCppRule(8, 3, 0.5))
    assert rnd.tokens == [1, 2] and rnd.sent == 0  # fewer than n_min: nothing sent
    rnd, _ = run(LlamaCppRule(3, 0, 0.0))  # the defaults: three tokens whatever their probability
    assert rnd.tokens == [1, 2, 3] and rnd.sent == 3


def test_threshold_policy_keeps_the_token_that_stops_it():
    rnd, s = run(build_policy("max_confidence_fixed:0.5"))
    assert rnd.tokens == [1, 2, 3] and rnd.sent == 3 and s.fed == [1, 2]
    rnd, s = run(StaticLength(4))
    assert rnd.tokens == [1, 2, 3, 4] and rnd.sent == 4 and s.fed == [1, 2, 3]
    rnd, _ = run(StaticLength(4), cap=2)
    assert rnd.tokens == [1, 2]


class Calibrated(StopPolicy):
    """A goodput policy whose calibrated acceptance is the draft's top-1 probability."""

    kind = "stub-goodput"
    round_rule = GOODPUT
    has_threshold = False
    required_columns = ("draft_max_prob",)

    def score(self, features):
        return features["draft_max_prob"].float()


def test_goodput_policy_drafts_and_sends_as_the_rule():
    cm = CostModel(draft_s_per_token=0.01, target_s={1: 0.05, 2: 0.052, 4: 0.056, 8: 0.2, 16: 0.4})
    cost = goodput.RoundCost.from_cost_model(cm)
    pol = Calibrated()
    for ps in (PS, [0.95, 0.95, 0.9, 0.95, 0.9, 0.9, 0.9, 0.9], [0.2] * 8):
        rnd, _ = run(pol, ps, cap=8, cost=cost)
        acc = [pol.score_list(step_features(logits_row(j + 1, p), pol, 10, j)[1])[0] for j, p in enumerate(ps)]
        assert (len(rnd.tokens), rnd.sent) == goodput.window_round(acc, cost, 8)
        assert rnd.scores == pytest.approx(acc[: len(rnd.tokens)])


def test_unsupported_policies_are_refused():
    class Sequential(StaticLength):
        round_rule = SEQUENTIAL

    class Hidden(StaticLength):
        required_columns = ("draft_hidden",)

    for pol in (Sequential(), Hidden()):
        with pytest.raises(ValueError, match="llama.cpp"):
            check_policy(pol)
    check_policy(LlamaCppRule())


class FakeLlama:
    """What the hook uses of a ``llama_cpp.Llama``: the token buffer, ``n_tokens``, ``eval`` and ``reset``."""

    def __init__(self) -> None:
        self.input_ids = np.zeros(512, dtype=np.intc)
        self.n_tokens = 0
        self.evals: list[list[int]] = []

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens: list[int]) -> None:
        self.input_ids[self.n_tokens: self.n_tokens + len(tokens)] = tokens
        self.n_tokens += len(tokens)
        self.evals.append(list(tokens))

    def n_ctx(self) -> int:
        return 512

    def n_vocab(self) -> int:
        return V


class FakeHook(SpecstopDraftModel):
    """The hook on a fake draft that always predicts the last token + 1, confidently."""

    def _logits(self) -> torch.Tensor:
        last = int(self.draft.input_ids[self.draft.n_tokens - 1])
        return logits_row((last + 1) % V, 0.9)


class Spy(StaticLength):
    def __init__(self) -> None:
        super().__init__(3)
        self.updates: list[tuple[int, int]] = []
        self.resets = 0

    def update(self, feedback) -> None:
        self.updates.append((feedback.n_drafted, feedback.n_accepted))

    def reset(self) -> None:
        self.resets += 1


def test_hook_keeps_its_cache_hears_the_outcome_and_resets():
    draft, spy = FakeLlama(), Spy()
    hook = FakeHook(draft, spy)
    hook.begin()
    assert hook(np.array([5, 6, 7], dtype=np.intc)).tolist() == [8, 9, 10]
    assert draft.evals == [[5, 6, 7], [8], [9]]
    # the target accepted 8, 9 and corrected 10 to 42: the draft reads only 42 (8 and 9 are cached)
    assert hook(np.array([5, 6, 7, 8, 9, 42], dtype=np.intc)).tolist() == [43, 44, 45]
    assert spy.updates == [(3, 2)] and draft.evals[3] == [42]
    hook.finish([5, 6, 7, 8, 9, 42, 43, 44, 45, 46])
    st = hook.decode_stats(hook.calls[0].started, 1.0, 5)
    assert (st.rounds, st.drafted, st.sent, st.accepted) == (2, 6, 6, 5)
    assert st.draft_forwards == 5 and st.stop_decisions == 6  # the prompt's read is the prefill
    resets = spy.resets
    hook(np.array([1, 2], dtype=np.intc))  # does not extend the last input: a new sequence
    assert spy.resets == resets + 1 and spy.updates == [(3, 2)]
    hook.begin(end=10)
    assert len(hook(np.arange(8, dtype=np.intc))) == 1  # one draft and the target's token fit before the end


class FakeVocab:
    def __init__(self, texts: list[bytes]) -> None:
        self.texts = texts

    def n_vocab(self) -> int:
        return len(self.texts)

    def token_text(self, token: int) -> bytes:
        return self.texts[token]


def test_vocabulary_check_names_both_files():
    texts = [f"t{i}".encode() for i in range(1000)]
    check_same_vocab(FakeVocab(texts), FakeVocab(list(texts)), "a.gguf", "b.gguf")
    with pytest.raises(ValueError, match=r"a\.gguf.*b\.gguf.*1000 vs 999"):
        check_same_vocab(FakeVocab(texts), FakeVocab(texts[:999]), "a.gguf", "b.gguf")
    other = list(texts)
    other[998] = b"x"
    with pytest.raises(ValueError, match=r"token 998"):
        check_same_vocab(FakeVocab(texts), FakeVocab(other), "a.gguf", "b.gguf")


def test_missing_llama_cpp_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp then raises ImportError
    with pytest.raises(LlamaCppMissing, match=INSTALL_COMMAND):
        llama_cpp_module()


def test_gguf_specs(tmp_path):
    good, bad = tmp_path / "m.gguf", tmp_path / "n.gguf"
    good.write_bytes(b"GGUF" + bytes(12))
    bad.write_bytes(b"nope")
    assert ensure_gguf(str(good), tmp_path) == good == check_gguf_file(good)
    with pytest.raises(ValueError, match="not a GGUF file"):
        ensure_gguf(str(bad), tmp_path)
    with pytest.raises(FileNotFoundError):
        ensure_gguf(str(tmp_path / "missing.gguf"), tmp_path)
    for spec in ("Qwen/Qwen2.5-0.5B", "packaged:nope"):
        with pytest.raises(ValueError):
            ensure_gguf(spec, tmp_path)


def test_bench_config_and_comparisons():
    with pytest.raises(ValueError, match="llamacpp:N_MAX"):
        LlamaCppBenchConfig(settings=["adaedl:0.6"], prompt_texts=["x"])

    def row(name: str, spec: str, secs: list[float]) -> Row:
        kind = "llamacpp" if spec.startswith("llamacpp:") else ""  # llama.cpp's own rule, as run_hooked sets it
        return Row(name, "llamacpp", kind=kind, spec=spec, seconds=secs, outputs=[[0] * 10 for _ in secs])

    rows = [row("llama.cpp target-only", "", [2.0, 2.0]),
            row("llamacpp:3,0,0.0 (default)", "llamacpp:3,0,0.0", [1.0, 1.0]),
            row("llamacpp:8,0,0.7", "llamacpp:8,0,0.7", [0.8, 0.8]), row("adaedl:0.6", "adaedl:0.6", [0.4, 0.4])]
    boot = np.random.default_rng(0).integers(0, 2, (50, 2))
    got = {(c["row"], c["against"]): c["ratio"] for c in comparisons(rows, boot)}
    assert got == pytest.approx({("llama.cpp target-only", "llamacpp:3,0,0.0 (default)"): 0.5,
                                 ("llamacpp:8,0,0.7", "llamacpp:3,0,0.0 (default)"): 1.25,
                                 ("adaedl:0.6", "llamacpp:3,0,0.0 (default)"): 2.5,
                                 ("adaedl:0.6", "llamacpp:8,0,0.7"): 2.0})


CACHE = Path("~/.cache/specstop").expanduser()
DRAFT, TARGET = "packaged:qwen2.5-coder-0.5b-instruct", "packaged:qwen2.5-coder-1.5b-instruct"


@pytest.fixture(scope="module")
def real_pair():
    pytest.importorskip("llama_cpp")
    return load_pair(ensure_gguf(DRAFT, CACHE), ensure_gguf(TARGET, CACHE), n_threads=torch.get_num_threads(),
                     n_ctx=512)


@pytest.mark.real
def test_hook_output_equals_target_only(real_pair):
    draft, target = real_pair
    tok = gguf_tokenizer(TARGET, CACHE)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    stop = gguf_stop_ids(TARGET, CACHE, tok)
    target.draft_model = None
    ref = generate_greedy(target, ids, 32, stop)
    for spec in ("llamacpp:3,0,0.0", "adaedl:0.6"):
        hook = SpecstopDraftModel(draft, build_policy(spec))
        target.draft_model = hook
        hook.begin(end=len(ids) + 32)
        try:
            out = generate_greedy(target, ids, 32, stop)
        finally:
            target.draft_model = None
        assert out == ref, spec
        assert hook.calls and sum(c.sent for c in hook.calls) > 0


@pytest.mark.real
def test_curve_is_a_valid_cost_model(real_pair, tmp_path):
    draft, target = real_pair
    cm = measure_llamacpp_curve(draft, target, lengths=(1, 2, 4), prompt_len=16, repeats=1, decode_steps=2,
                                n_threads=2, draft_name=DRAFT, target_name=TARGET)
    assert cm.runtime == "llamacpp" and cm.compute_path == "llamacpp" and cm.extra["runtime"] == "llamacpp"
    assert sorted(cm.target_s) == [1, 2, 4] and cm.draft_s_per_token > 0 and cm.dtype
    assert len(cm.extra["draft_raw_s_L2"]) == 1 and cm.draft_catchup_s >= 0  # the draft's two-token forward, timed
    ts = [cm.target_s[L] for L in (1, 2, 4)]
    assert ts == sorted(ts)
    cm.to_json(tmp_path / "c.json")
    assert CostModel.from_json(tmp_path / "c.json").target_s == cm.target_s


class ScriptedLlama:
    """A ``logits_all`` llama.cpp model of scripted logits: each position's argmax is ``nxt(token there)``; counts the
    tokens it evaluates."""

    def __init__(self, nxt, n_ctx: int = 256) -> None:
        self._logits_all, self.model_path, self.nxt = True, "fake.gguf", nxt
        self.input_ids = np.zeros(n_ctx, dtype=np.intc)
        self.scores = np.zeros((n_ctx, V), dtype=np.float32)
        self.n_tokens = self.evaluated = 0

    def n_vocab(self) -> int:
        return V

    def eval(self, tokens: list[int]) -> None:
        for t in tokens:
            self.scores[self.n_tokens] = -5.0
            self.scores[self.n_tokens, self.nxt(t)] = 5.0
            self.input_ids[self.n_tokens] = t
            self.n_tokens += 1
            self.evaluated += 1


def test_llama_causal_lm_labels_with_llama_logits_and_reuses_its_cache():
    from data_gen.continuation_labels import label_continuation
    from data_gen.labelling import LabelModels, LabelOptions
    from runtimes.llamacpp.causal_lm import LlamaCausalLM

    target = ScriptedLlama(lambda t: (t + 1) % V)
    draft = ScriptedLlama(lambda t: (t + 2) % V if t % 5 == 0 else (t + 1) % V)  # leaves the target after a 5, 10, ...
    prompt, cont = [1, 2, 3], list(range(4, 24))  # the target's greedy continuation
    models = LabelModels(LlamaCausalLM(draft), LlamaCausalLM(target))  # type: ignore[arg-type]
    opts = LabelOptions(top_k=4, store_hidden=False, min_shared_prefix=0)
    recs, st = label_continuation(models, prompt, cont, opts, sample_id="p", rollout_len=4, gen_batch_size=1,
                                  label_batch_tokens=1)
    main = [(o, d, m) for o, d, m, r in zip(recs["offset"], recs["draft_token"], recs["greedy_match"],
                                            recs["rollout"]) if not r]
    assert [d for _, d, _ in main] == [draft.nxt(t) for t in [3, *cont[:-1]]]
    assert [m for _, _, m in main] == [t % 5 != 0 for t in [3, *cont[:-1]]]
    assert st.rollouts == 4 + 1  # after the 5, 10, 15, 20 and at the end
    rolled = [d for d, r in zip(recs["draft_token"], recs["rollout"]) if r]
    assert rolled[:4] == [7, 8, 9, 10]  # the first rollout: the draft's own from [..., 4, 5], where it drafts 7 for 6
    # each rollout read on top of the cached prefix: the output once (23 tokens), then per rollout the output's tokens
    # since the previous branch point and its own 4
    assert target.evaluated == 23 + (0 + 4) + (5 + 4) + (5 + 4) + (5 + 4) + (3 + 4)
    with pytest.raises(ValueError, match="logits_all"):
        fake = ScriptedLlama(lambda t: t)
        fake._logits_all = False
        LlamaCausalLM(fake)


def test_bench_comparisons_against_the_recommended_row():
    def row(name: str, spec: str, secs: list[float]) -> Row:
        kind = "llamacpp" if spec.startswith("llamacpp:") else ""  # llama.cpp's own rule, as run_hooked sets it
        return Row(name, "llamacpp", kind=kind, spec=spec, seconds=secs, outputs=[[0] * 10 for _ in secs])

    rows = [row("llama.cpp target-only", "", [1.0, 1.0]),
            row("llamacpp:3,0,0.0 (default)", "llamacpp:3,0,0.0", [1.5, 1.5]), row("goodput:adaedl", "x", [0.9, 1.1])]
    boot = np.random.default_rng(0).integers(0, 2, (50, 2))
    got = {(c["row"], c["against"]): c["ratio"] for c in comparisons(rows, boot, "llama.cpp target-only")}
    assert got == pytest.approx({("llama.cpp target-only (recommended)", "llamacpp:3,0,0.0 (default)"): 1.5,
                                 ("goodput:adaedl", "llamacpp:3,0,0.0 (default)"): 1.5,
                                 ("goodput:adaedl", "llama.cpp target-only (recommended)"): 1.0})
    with pytest.raises(ValueError, match="recommend_data"):  # before any model loads
        load_llamacpp_bench(LlamaCppBenchConfig(recommend_data="/nonexistent", prompt_texts=["x"], policies=[]))


def test_a_cost_aware_hook_that_no_round_can_pay_says_so_before_the_sequence():
    """On a curve where no round can pay even at certainty the cost-aware hook drafts nothing from the first call, so
    the caller may run the target alone; a cheap curve, or a thresholded policy, drafts."""
    from predictors.calibration import Calibrator
    from predictors.goodput import GoodputPolicy

    steep = CostModel(draft_s_per_token=0.03, target_s={1: 0.035, 2: 0.065, 4: 0.11, 8: 0.24, 17: 0.5})
    cheap = CostModel(draft_s_per_token=0.005, target_s={1: 0.05, 2: 0.052, 4: 0.056, 8: 0.2, 17: 0.4})
    cal = {"greedy": Calibrator("isotonic", [0.0, 1.0], [0.0, 1.0])}
    for cm, expect in ((steep, True), (cheap, False)):
        hook = SpecstopDraftModel(FakeLlama(), GoodputPolicy(Calibrated(), cal), cost_model=cm, max_draft_len=16)
        hook.begin(end=40)
        assert hook.drafts_nothing(prompt_len=8) is expect
        if expect:  # and indeed it drafts nothing when called
            assert len(hook(np.arange(1, 9, dtype=np.intc))) == 0 and hook.draft.evals == []
    plain = SpecstopDraftModel(FakeLlama(), build_policy("adaedl:0.6"), max_draft_len=16)
    plain.begin(end=40)
    assert plain.drafts_nothing(prompt_len=8) is False
