"""One-pass labelling: stub models with known logits, token-by-token equivalence, teacher-forced == rollout,
batching."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from compute.models import ModelSpec, load_model, share_truncated_layers
from data_gen.continuations import continue_batch
from data_gen.features import probs_and_entropy, probs_from_logits, token_features, topk_values
from data_gen.labelling import (
    CachedPass,
    LabelModels,
    LabelOptions,
    Segment,
    SequenceSpec,
    _body_hidden,
    draft_pass,
    label_sequences,
    oracle_lengths,
    run_positions,
)


class StubLM(nn.Module):
    """A 'language model' whose next-token logits depend only on the current token: logits(t) = table[t]."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        v = table.shape[0]
        self.embed = nn.Embedding(v, v)
        self.embed.weight.data = torch.eye(v)
        self.head = nn.Linear(v, v, bias=False)
        self.head.weight.data = table.T.contiguous()  # one_hot(t) @ table -> table[t]
        self.config = SimpleNamespace(name_or_path="stub")

    def get_decoder(self):
        def run(input_ids, attention_mask=None, use_cache=False):
            return SimpleNamespace(last_hidden_state=self.embed(input_ids))

        return run

    def get_output_embeddings(self):
        return self.head


def _spec(tokens, segments, seq_id="s0"):
    return SequenceSpec("p:0", "stub", "code", "train", seq_id, tokens, segments)


def _stub_pair(v: int = 4) -> tuple[torch.Tensor, torch.Tensor, LabelModels]:
    """(q table, p table, models). Draft: after any token t, 0.7 on (t+1) % v and 0.1 elsewhere. Target: after t, 0.7
    on (t+1) % v for t < 2, else on t."""
    q = torch.full((v, v), 0.1)
    p = torch.full((v, v), 0.1)
    for t in range(v):
        q[t, (t + 1) % v] = 0.7
        p[t, (t + 1) % v if t < 2 else t] = 0.7
    return q, p, LabelModels(StubLM(q.log()), StubLM(p.log()))


def test_stub_labels_known_exactly():
    q, p, models = _stub_pair()
    tokens = [0, 1, 2, 3, 0]  # the draft's greedy rollout from prompt [0]
    recs, stats = label_sequences(models, [_spec(tokens, [Segment(1, 5, "prompt", True)])], LabelOptions(top_k=2))
    assert stats.records == 4
    # Position alignment: token j is scored by the logits after token j-1.
    assert recs["draft_token"] == [1, 2, 3, 0]
    np.testing.assert_allclose(recs["q"], [0.7] * 4, rtol=1e-5)
    np.testing.assert_allclose(recs["p"], [0.7, 0.7, 0.1, 0.1], rtol=1e-5)
    np.testing.assert_allclose(recs["accept_prob"], [1, 1, 0.1 / 0.7, 0.1 / 0.7], rtol=1e-5)
    assert recs["target_argmax"] == [1, 2, 2, 3]
    assert recs["greedy_match"] == [True, True, False, False]
    np.testing.assert_allclose(recs["tv"], [0.0, 0.0, 0.6, 0.6], atol=1e-5)
    assert recs["oracle_len"] == [2, 1, 0, 0]
    assert recs["oracle_censored"] == [False, False, False, False]
    assert recs["position"] == [0, 1, 2, 3]
    np.testing.assert_allclose(recs["draft_topk"][0], [0.7, 0.1], rtol=1e-5)


def test_oracle_lengths_and_positions():
    match = np.array([1, 1, 0, 1, 1, 1], bool)
    follows = np.array([1, 1, 1, 1, 0, 1], bool)
    length, cens = oracle_lengths(match, follows)
    assert length.tolist() == [2, 1, 0, 2, 1, 1]
    assert cens.tolist() == [False, False, False, True, True, True]
    restart = np.zeros(6, bool)
    restart[0] = True
    assert run_positions(follows, restart).tolist() == [0, 1, 2, 3, 4, 0]


def _greedy_rollout(tiny_pair, prompt, n):
    draft, target, tok = tiny_pair
    conts, _ = continue_batch(draft, [prompt], [n], pad_token_id=tok.pad_token_id, eos_token_id=None)
    return conts[0]


def test_one_pass_equals_token_by_token(tiny_pair):
    draft, target, tok = tiny_pair
    prompt = tok("def add(a, b):")["input_ids"]
    roll = _greedy_rollout(tiny_pair, prompt, 12)
    seq = prompt + roll
    recs, _ = label_sequences(
        LabelModels(draft, target), [_spec(seq, [Segment(len(prompt), len(seq), "prompt", True)])], LabelOptions()
    )
    with torch.no_grad():
        for i, j in enumerate(range(len(prompt), len(seq))):
            logits = target(torch.tensor([seq[:j]])).logits[0, -1]
            probs = torch.softmax(logits.float(), -1)
            assert recs["target_argmax"][i] == int(logits.argmax())
            assert recs["greedy_match"][i] == (int(logits.argmax()) == seq[j])
            assert recs["p"][i] == pytest.approx(float(probs[seq[j]]), rel=1e-4, abs=1e-6)
            dlogits = draft(torch.tensor([seq[:j]])).logits[0, -1]
            assert int(dlogits.argmax()) == seq[j]  # the rollout is the draft's greedy choice


def test_teacher_forced_equals_rollout_on_greedy_draft_continuation(tiny_pair):
    draft, target, tok = tiny_pair
    prompt = tok("print('hello')")["input_ids"]
    seq = prompt + _greedy_rollout(tiny_pair, prompt, 10)
    models = LabelModels(draft, target)
    a, _ = label_sequences(models, [_spec(seq, [Segment(len(prompt), len(seq), "prompt", True)])], LabelOptions())
    b, _ = label_sequences(models, [_spec(seq, [Segment(len(prompt), len(seq), "draft", False)])], LabelOptions())
    for k in ("draft_token", "target_argmax", "greedy_match", "oracle_len", "position", "next_token"):
        assert a[k] == b[k], k
    for k in ("q", "p", "tv", "draft_entropy"):
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5)


def test_batched_equals_unbatched(tiny_pair, tiny_companion):
    draft, target, tok = tiny_pair
    models = LabelModels(draft, target, tiny_companion)
    seqs = []
    for i, text in enumerate(["x = 1", "for i in range(10):\n    print(i)", "a"]):
        ids = tok(text)["input_ids"]
        seqs.append(_spec(ids + [65, 66, 67], [Segment(len(ids), len(ids) + 3, "text", False)], seq_id=f"s{i}"))
    opts = LabelOptions(pad_token_id=tok.pad_token_id)
    together, _ = label_sequences(models, seqs, opts)
    alone = [label_sequences(models, [s], opts)[0] for s in seqs]
    for k in ("q", "p", "tv", "companion_sim", "companion_accept", "draft_entropy"):
        np.testing.assert_allclose(together[k], sum((r[k] for r in alone), []), rtol=1e-4, atol=1e-6)
    assert together["greedy_match"] == sum((r["greedy_match"] for r in alone), [])


def test_feature_columns_subset_equals_the_full_computation():
    """A decoder asks only for its policy's columns: those it gets equal the full computation's, bit for bit."""
    logits = torch.randn(3, 300) * 4
    tok = logits.argmax(-1)
    full = token_features(logits, tok, top_k=5, temperature=0.0)
    for cols in [(), ("draft_entropy",), ("draft_max_prob",), ("draft_topk", "position"), ("q",)]:
        part = token_features(logits, tok, top_k=5, temperature=0.0, columns=cols)
        assert {"draft_token", "q"} <= set(part)
        assert ("draft_entropy" in part) == ("draft_entropy" in cols)
        assert ("draft_topk" in part) == bool({"draft_topk", "draft_max_prob"} & set(cols))
        for k, v in part.items():
            assert torch.equal(v, full[k]), k


def test_entropy_from_logits_matches_float64():
    """probs_and_entropy: probs_from_logits's probabilities bit for bit and their entropy (log max p - sum p (z - m)),
    flat or peaked, equal a float64 reference."""
    torch.manual_seed(0)
    for scale, peak in ((2.5, 0.0), (2.5, 25.0), (5.0, 40.0)):
        logits = torch.randn(3, 5000) * scale
        logits[:, 7] += peak
        probs, ent = probs_and_entropy(logits)
        assert torch.equal(probs, probs_from_logits(logits))
        # max p read at the argmax of the logits is the max over p, bit for bit
        assert torch.equal(probs.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1), probs.amax(-1))
        ref = torch.softmax(logits.double(), -1)
        torch.testing.assert_close(probs.double(), ref, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(ent.double(), torch.special.entr(ref).sum(-1), rtol=1e-5, atol=1e-6)
    p, h = probs_and_entropy(logits, top_p=0.5)  # nucleus: the renormalised cut's entropy
    assert (p > 0).sum(-1).max() < 5000 and torch.all(h >= 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("columns", [None, ("draft_max_prob", "draft_topk")])
def test_token_features_refuse_non_finite_draft_logits_with_or_without_the_entropy(bad, columns):
    """The draft's finiteness check rides on the entropy when it is computed (NaN for NaN, +inf and -inf logits) and
    has its own reduction when it is not: either way a NaN or inf logit raises."""
    logits = torch.randn(2, 3000)
    logits[1, 17] = bad
    with pytest.raises(FloatingPointError, match="draft logits contain NaN or inf"):
        token_features(logits, torch.tensor([3, 4]), columns=columns)
    feats = token_features(logits[:1], torch.tensor([3]), columns=columns)  # the finite row alone passes
    assert torch.isfinite(feats["q"]).all()


@pytest.mark.parametrize("shape", [(1, 151936), (3, 5000), (2, 6161), (2, 3, 4096)])
def test_topk_values_equal_torch_topk(shape):
    """topk_values (block maxima, then the top-k of the k best blocks) gives torch.topk's values: random, tied,
    padded (V not a multiple of the block), batched and non-contiguous inputs."""
    torch.manual_seed(0)
    for scale in (0.5, 3.0, 30.0):
        x = torch.randn(*shape) * scale
        x[..., 100:110] = x.amax()  # ties at the top, all in one block
        for k in (1, 5, 10, 20):
            assert torch.equal(topk_values(x, k), x.topk(k, dim=-1).values), (shape, scale, k)
    rounded = torch.randn(*shape).round()  # many ties across blocks
    assert torch.equal(topk_values(rounded, 10), rounded.topk(10, dim=-1).values)
    strided = rounded.unsqueeze(-2).expand(*shape[:-1], 2, shape[-1])[..., -1, :]
    assert torch.equal(topk_values(strided, 10), strided.topk(10, dim=-1).values)


def test_nan_logits_raise(tiny_pair):
    v = 4
    bad = torch.zeros(v, v)
    bad[0, 0] = float("nan")
    models = LabelModels(StubLM(bad), StubLM(torch.zeros(v, v)))
    with pytest.raises(FloatingPointError, match=r"draft model .* NaN or inf logits on sample\(s\) \['s0'\]"):
        label_sequences(models, [_spec([0, 1], [Segment(1, 2, "text", False)])], LabelOptions())


def test_batched_rollouts_equal_unbatched(tiny_pair):
    draft, _, tok = tiny_pair
    prompts = [tok(t)["input_ids"] for t in ("def f(x):", "import numpy as np\nx = np.zeros(3)", "print(1)")]
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    together, _ = continue_batch(draft, prompts, [8, 5, 8], **kw)
    alone = [continue_batch(draft, [p], [n], **kw)[0][0] for p, n in zip(prompts, [8, 5, 8])]
    assert together == alone
    assert [len(c) for c in together] == [8, 5, 8]


def test_draft_pass_decodes_as_generate_and_its_states_equal_a_full_pass(tiny_pair):
    """draft_pass: right-padded prefixes of different lengths, then decoding from that pass's cache, gives each row the
    tokens transformers' generate gives it alone, and hidden states equal to one pass over prefix + new tokens; a row
    stops at an end-of-sequence token (kept) and n_new = 0 only passes the prefix."""
    draft, _, tok = tiny_pair
    prefixes = [tok(t)["input_ids"] for t in ("def f(x):", "import numpy as np\nx = np.zeros(3)", "print(1)", "a")]
    n_new = [8, 0, 5, 12]
    pad = tok.pad_token_id
    new, hidden, stats, _ = draft_pass(draft, prefixes, n_new, pad_token_id=pad, eos_token_id=None)
    alone = [continue_batch(draft, [p], [n], pad_token_id=pad, eos_token_id=None)[0][0]
             for p, n in zip(prefixes, n_new)]
    assert new == alone and [len(c) for c in new] == n_new
    assert stats.steps == max(n_new) - 1
    for p, c, h in zip(prefixes, new, hidden):
        ids = torch.tensor([p + c])
        full = _body_hidden(draft, ids, torch.ones_like(ids))[0, :-1]
        assert h.shape == full.shape
        torch.testing.assert_close(h, full, rtol=1e-3, atol=1e-3)
    stop = new[0][2]  # end of sequence at row 0's third token: it stops there, the others go on
    cut, _, _, _ = draft_pass(draft, prefixes, n_new, pad_token_id=pad, eos_token_id=stop)
    assert cut[0] == new[0][: new[0].index(stop) + 1]
    with pytest.raises(ValueError, match="non-empty prefix"):
        draft_pass(draft, [[]], [3], pad_token_id=pad, eos_token_id=None)


def test_cached_pass_continuation_then_fed_tokens_equal_a_full_pass(tiny_pair):
    """CachedPass: the target's continuation (decode) and then other tokens fed to the same cache (the draft's
    rollout) give the tokens generate gives and the states of one pass over the whole sequence."""
    _, target, tok = tiny_pair
    pad = tok.pad_token_id
    prefixes = [tok(t)["input_ids"] for t in ("def f(x):", "import numpy as np", "a")]
    run = CachedPass(target, prefixes, pad_token_id=pad)
    conts = run.decode([5, 8, 3], eos_token_id=None)
    alone = [continue_batch(target, [p], [n], pad_token_id=pad, eos_token_id=None)[0][0]
             for p, n in zip(prefixes, [5, 8, 3])]
    assert conts == alone
    tails = [[65, 66, 67, 68], [], [70]]
    run.feed(tails)  # the last token of a sequence is never passed: no state scores past it
    for r, (p, c, t) in enumerate(zip(prefixes, conts, tails)):
        ids = torch.tensor([p + c + t])
        full = _body_hidden(target, ids, torch.ones_like(ids))[0, :-1]
        assert run.states(r).shape == full.shape
        torch.testing.assert_close(run.states(r), full, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="runs once"):
        run.decode([1, 1, 1], eos_token_id=None)


def test_labels_from_draft_pass_states_equal_the_labelling_pass(tiny_pair):
    """Sequences that carry draft_pass's states skip the draft's labelling pass and get the same records."""
    draft, target, tok = tiny_pair
    prefixes = [tok(t)["input_ids"] for t in ("def f(x):", "import numpy as np\nx = np.zeros(3)")]
    new, hidden, _, _ = draft_pass(draft, prefixes, [6, 6], pad_token_id=tok.pad_token_id, eos_token_id=None)

    def seqs(with_states: bool):
        return [SequenceSpec("p", "t", "code", "train", f"s{i}", p + c, [Segment(len(p) - 1, len(p) + len(c), "draft",
                             True)], states={"draft": h} if with_states else {})
                for i, (p, c, h) in enumerate(zip(prefixes, new, hidden))]

    opts = LabelOptions(pad_token_id=tok.pad_token_id, sample_draw=True)
    models = LabelModels(draft, target)
    fused, _ = label_sequences(models, seqs(True), opts, generator=torch.Generator().manual_seed(0))
    plain, _ = label_sequences(models, seqs(False), opts, generator=torch.Generator().manual_seed(0))
    assert fused["draft_token"] == plain["draft_token"] and fused["greedy_match"] == plain["greedy_match"]
    np.testing.assert_allclose(fused["q"], plain["q"], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.array(fused["draft_topk"]), np.array(plain["draft_topk"]), rtol=1e-3, atol=1e-4)


def test_shared_prompt_pass_equals_separate_passes(tiny_pair, tiny_companion):
    """Sequences of one prompt share its KV cache in one pass; records equal labelling each sequence alone."""
    draft, target, tok = tiny_pair
    models = LabelModels(draft, target, tiny_companion)
    prompt = tok("def add(a, b):\n    return a + b\n# now a longer shared prompt for the cache")["input_ids"]
    conts = [[65, 66, 67, 68], [70, 71], [65, 66, 80, 81, 82, 83]]
    seqs = [_spec(prompt + c, [Segment(len(prompt) - 2, len(prompt) + len(c), "text", False)], seq_id=f"s{i}")
            for i, c in enumerate(conts)]
    opts = LabelOptions(pad_token_id=tok.pad_token_id, min_shared_prefix=8)
    together, stats = label_sequences(models, seqs, opts)
    assert stats.tokens_passed == len(prompt) + sum(len(c) for c in conts)  # the prompt passed once
    alone = [label_sequences(models, [s], opts)[0] for s in seqs]
    for k in ("q", "p", "tv", "companion_sim", "companion_accept", "draft_entropy"):
        np.testing.assert_allclose(together[k], sum((r[k] for r in alone), []), rtol=1e-4, atol=1e-6)
    for k in ("greedy_match", "draft_token", "target_argmax", "oracle_len", "position"):
        assert together[k] == sum((r[k] for r in alone), [])
    np.testing.assert_allclose(np.stack(together["draft_hidden"]).astype(np.float32),
                               np.concatenate([np.stack(r["draft_hidden"]) for r in alone]).astype(np.float32),
                               rtol=1e-2, atol=1e-3)


def test_sample_draw_records_known_exactly():
    """sample_draw: every position also gives a record of a token sampled from q, with that token's q, p and labels."""
    q, p, models = _stub_pair()
    spec = _spec([0, 1, 2, 3, 0], [Segment(1, 5, "prompt", True)])
    greedy, _ = label_sequences(models, [spec], LabelOptions(top_k=2))
    recs, stats = label_sequences(models, [spec], LabelOptions(top_k=2, sample_draw=True),
                                  generator=torch.Generator().manual_seed(0))
    assert stats.records == 8
    assert recs["draw"] == ["greedy"] * 4 + ["sample"] * 4
    # the greedy half is exactly the single-draw labelling
    for k in ("draft_token", "q", "p", "greedy_match", "oracle_len", "position"):
        assert list(np.asarray(recs[k][:4])) == list(np.asarray(greedy[k])), k
    # the sampled half: each token's own q(x), p(x), min(1, p/q) and match, from the same distributions
    prev = [0, 1, 2, 3]  # token before each labelled position
    for i, x in enumerate(recs["draft_token"][4:]):
        t = prev[i]
        np.testing.assert_allclose(recs["q"][4 + i], float(q[t, x]), rtol=1e-5)
        np.testing.assert_allclose(recs["p"][4 + i], float(p[t, x]), rtol=1e-5)
        np.testing.assert_allclose(recs["accept_prob"][4 + i], min(1.0, float(p[t, x] / q[t, x])), rtol=1e-5)
        assert recs["greedy_match"][4 + i] == (x == int(p[t].argmax()))
        np.testing.assert_allclose(recs["draft_topk"][4 + i], recs["draft_topk"][i], rtol=1e-6)  # same position
    with pytest.raises(ValueError, match="sample_draw"):
        label_sequences(models, [spec], LabelOptions(temperature=1.0, sample_draw=True))


def test_sample_draw_follows_q():
    """Sampled draws are distributed as q: over many positions the drafted token is q's mode about 70% of the time."""
    v = 4
    q, _, _ = _stub_pair(v)
    models = LabelModels(StubLM(q.log()), StubLM(q.log()))
    tokens = [i % v for i in range(801)]
    recs, _ = label_sequences(models, [_spec(tokens, [Segment(1, 801, "text", False)])],
                              LabelOptions(top_k=2, sample_draw=True), generator=torch.Generator().manual_seed(1))
    d = np.asarray(recs["draw"])
    sampled = np.asarray(recs["draft_token"])[d == "sample"]
    mode = (np.asarray(tokens[:800]) + 1) % v
    assert 0.64 < float((sampled == mode).mean()) < 0.76
    # q == p here: every sampled draw is accepted with probability 1
    np.testing.assert_allclose(np.asarray(recs["accept_prob"])[d == "sample"], 1.0, rtol=1e-5)


def test_a_truncated_companion_shares_the_drafts_layers_and_its_states_come_from_the_draft_pass():
    """truncated:N:<draft> as the companion: its N layers become the draft's own (one copy in memory), the draft
    pass's tap gives its final-norm states (equal to a pass of its own), and labels from those states equal the
    labelling pass's; another model, or a truncation of another, is left alone."""
    draft, tok = load_model(ModelSpec("tiny:1:32:3"))
    target, _ = load_model(ModelSpec("tiny:2:32:3"))
    companion, _ = load_model(ModelSpec("truncated:2:tiny:1:32:3"))
    own = _body_hidden(companion, torch.tensor([tok("def g(y): return y")["input_ids"]]),
                       torch.ones(1, len(tok("def g(y): return y")["input_ids"]), dtype=torch.long))
    assert share_truncated_layers(target, draft) is None
    assert share_truncated_layers(load_model(ModelSpec("truncated:2:tiny:2:32:3"))[0], draft) is None
    assert share_truncated_layers(companion, draft) == 2
    assert all(a is b for a, b in zip(companion.get_decoder().layers, draft.get_decoder().layers))
    ids = tok("def g(y): return y")["input_ids"]
    torch.testing.assert_close(_body_hidden(companion, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)),
                               own)  # the shared layers are the ones it had

    models = LabelModels(draft, target, companion)
    assert models.companion_tap()[0] == 2
    prefixes = [tok(t)["input_ids"] for t in ("def f(x):", "import numpy as np\nx = np.zeros(3)")]
    new, hidden, _, tapped = draft_pass(draft, prefixes, [6, 6], pad_token_id=tok.pad_token_id, eos_token_id=None,
                                        tap=models.companion_tap())
    for p, c, h, t in zip(prefixes, new, hidden, tapped):
        full = torch.tensor([p + c])
        assert t.shape == h.shape
        torch.testing.assert_close(t, _body_hidden(companion, full, torch.ones_like(full))[0, :-1], rtol=1e-3,
                                   atol=1e-3)

    def seqs(with_states: bool):
        return [SequenceSpec("p", "t", "code", "train", f"s{i}", p + c, [Segment(len(p) - 1, len(p) + len(c), "draft",
                             True)], states={"draft": h, "companion": t} if with_states else {})
                for i, (p, c, h, t) in enumerate(zip(prefixes, new, hidden, tapped))]

    opts = LabelOptions(pad_token_id=tok.pad_token_id)
    fused, stats = label_sequences(models, seqs(True), opts)
    plain, _ = label_sequences(models, seqs(False), opts)
    for col in ("companion_prob", "companion_sim", "companion_entropy"):
        np.testing.assert_allclose(fused[col], plain[col], rtol=1e-3, atol=1e-4)
