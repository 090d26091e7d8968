"""Speculative decoding engine: greedy exactness for every exact policy, batches, features, limits, SV, SPRINTER, bad
input."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace

import pytest
import torch
from torch import Tensor

from compute.timing import CostModel, measure_cost_model
from data_gen.features import token_features
from decoding.engine import DecodeStats, SpeculativeDecoder
from decoding.policies import build_decoder, build_policy
from predictors.base import StopPolicy
from predictors.round_rules import GOODPUT, SEQUENTIAL
from tests.tiny_pairs import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


EXACT_SPECS = ["static:1", "static:4", "heuristic", "max_confidence", "max_confidence_fixed:0.3", "svip:0.3", "adaedl",
               "oracle"]


@pytest.fixture(scope="module")
def pair():
    return make_pair()


@pytest.fixture(scope="module")
def companion():
    return make_pair(noise=0.3, seed=0)[1]


PROMPT = torch.tensor([[67, 68, 69, 220, 69, 78, 78, 7, 87, 8, 25]])


def greedy_loop(model, ids: Tensor, n: int) -> list[int]:
    """Target-only greedy decoding, one full forward per token (no cache): the plain reference."""
    out = ids.clone()
    with torch.no_grad():
        for _ in range(n):
            nxt = model(out).logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], 1)
    return out[0, ids.shape[1]:].tolist()


class Recorder(StopPolicy):
    """Continue while the draft's max probability is high; records every features dict it sees."""

    kind = "recorder"
    required_columns = ("draft_max_prob", "draft_entropy")  # the engine computes only what a policy asks for

    def __init__(self, threshold: float = 0.3, max_draft_len: int = 8) -> None:
        super().__init__(threshold, max_draft_len)
        self.seen: list[dict[str, Tensor]] = []

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        self.seen.append({k: v.clone() for k, v in features.items()})
        return features["draft_max_prob"]


@pytest.mark.parametrize("spec", EXACT_SPECS)
def test_greedy_equals_target_only(pair, spec):
    draft, target = pair
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=20, pad_token_id=256, eos_token_id=None)
    dec = SpeculativeDecoder(draft, target, build_policy(spec))
    out, stats = dec.generate(PROMPT, None, max_new_tokens=20, eos_token_id=None, seed=0)
    assert out.tolist() == ref.tolist()
    assert out[0, PROMPT.shape[1]:].tolist() == greedy_loop(target, PROMPT, 20)
    assert stats.tokens == 20
    assert stats.accepted + stats.wasted == stats.drafted
    assert stats.accepted + stats.rounds == stats.tokens  # each round adds accepted + one target token
    assert len(stats.accepted_lengths) == stats.rounds == stats.target_calls
    assert stats.sent == sum(stats.sent_lengths) and stats.accepted <= stats.sent <= stats.drafted


def test_stats_read_back_from_their_dict():
    st = DecodeStats(tokens=6, drafted=9, sent=8, rounds=3, accepted=4, sent_lengths=[3, 3, 2])
    assert DecodeStats.from_dict(asdict(st)) == st


def test_greedy_draft_steps_take_token_and_features_from_one_native_call(pair):
    """Greedy on a CPU the drafted token is the argmax the features' native pass finds: same tokens, rounds and
    features as the separate argmax and statistics."""
    draft, target = pair
    runs = []
    for fused in (True, False):
        pol = Recorder(0.3)
        dec = SpeculativeDecoder(draft, target, pol)
        if not fused:
            dec._fused_greedy = False
        elif not dec._fused_greedy:
            pytest.skip("native statistics unavailable (no compiler)")
        out, stats = dec.generate(PROMPT, None, max_new_tokens=20, eos_token_id=None, seed=0)
        runs.append((out.tolist(), stats.drafted_lengths, pol.seen))
    assert runs[0][:2] == runs[1][:2]
    for a, b in zip(runs[0][2], runs[1][2], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_target_reads_each_prompt_with_the_first_drafts_in_one_pass(pair):
    """No separate target prefill: its pass over the prompt verifies the first drafts (as transformers' assisted
    generation does), booked as prefill; a left-padded batch of prompts of other lengths decodes as each alone."""
    draft, target = pair
    calls: list[int] = []
    hook = target.register_forward_hook(lambda _m, args, kw, _o: calls.append(kw["input_ids"].shape[1]),
                                        with_kwargs=True)
    try:
        dec = SpeculativeDecoder(draft, target, build_policy("static:4"))
        out, stats = dec.generate(PROMPT, None, max_new_tokens=20, eos_token_id=None, seed=0)
    finally:
        hook.remove()
    assert len(calls) == stats.target_calls == stats.rounds  # every target pass verifies
    assert calls[0] == PROMPT.shape[1] + stats.drafted_lengths[0] and stats.prompt_passes == 1
    assert stats.prompt_pass_lengths == stats.sent_lengths[:1] and stats.prefill_time > 0
    short = PROMPT[:, 4:]
    batch = torch.cat([PROMPT, torch.cat([torch.full((1, 4), 256), short], 1)])
    mask = torch.cat([torch.ones_like(PROMPT), torch.cat([torch.zeros(1, 4), torch.ones_like(short)], 1)]).long()
    both, st = dec.generate(batch, mask, max_new_tokens=20, eos_token_id=None, seed=0)
    alone, _ = dec.generate(short, None, max_new_tokens=20, eos_token_id=None, seed=0)
    assert both[0].tolist() == out[0].tolist() and st.prompt_passes == 2
    assert both[1, PROMPT.shape[1]:].tolist() == alone[0, short.shape[1]:].tolist()


def test_oracle_reads_the_reference_output_instead_of_target_steps(pair):
    """Given target-only's output, the oracle drafts exactly the same rounds as when it peeks at the target, without a
    target step per drafted token (no analysis time), and its output is still target-only's."""
    draft, target = pair
    ref = greedy_loop(target, PROMPT, 24)
    dec = SpeculativeDecoder(draft, target, build_policy("oracle"))
    out_peek, peek = dec.generate(PROMPT, None, 24, None, 0)
    out_ref, read = dec.generate(PROMPT, None, 24, None, 0, reference=[ref])
    assert out_ref.tolist() == out_peek.tolist() and out_ref[0, PROMPT.shape[1]:].tolist() == ref
    assert read.drafted_lengths == peek.drafted_lengths and read.accepted_lengths == peek.accepted_lengths
    assert peek.analysis_time > 0 and read.analysis_time == 0 and read.prefill_time > 0
    assert all(a == d or a == d - 1 for a, d in zip(read.accepted_lengths, read.drafted_lengths))
    with pytest.raises(ValueError, match="greedy decoding only"):
        SpeculativeDecoder(draft, target, build_policy("oracle"), temperature=1.0).generate(
            PROMPT, None, 4, None, 0, reference=[ref])


def test_mixed_acceptance_and_draft_cap(pair):
    """The pair really rejects sometimes, and static k never drafts more than k."""
    draft, target = pair
    _, stats = SpeculativeDecoder(draft, target, build_policy("static:4")).generate(PROMPT, None, 30, None, 0)
    assert max(stats.drafted_lengths) <= 4
    assert 0 < stats.wasted < stats.drafted
    _, st2 = SpeculativeDecoder(draft, target, build_policy("static:8"), max_draft_len=3).generate(PROMPT, None, 20)
    assert max(st2.drafted_lengths) <= 3


def test_features_match_data_generation_path(pair):
    """Features the policy sees equal token_features over a whole-sequence draft pass (the data_gen path)."""
    draft, target = pair
    pol = Recorder(threshold=0.0, max_draft_len=4)
    out, stats = SpeculativeDecoder(draft, target, pol).generate(PROMPT, None, 12, None, 0)
    first = pol.seen[0]  # the first drafted token follows the prompt directly
    tok = first["draft_token"]
    with torch.no_grad():
        logits = draft(torch.cat([PROMPT, tok.view(1, 1)], 1)).logits[:, PROMPT.shape[1] - 1]
    ref = token_features(logits, tok, top_k=10)
    for k in ("q", "draft_entropy", "draft_max_prob", "draft_topk"):
        torch.testing.assert_close(first[k], ref[k], rtol=1e-4, atol=1e-5)
    assert int(first["position"]) == 0
    positions = [int(f["position"]) for f in pol.seen]
    assert max(positions) >= 1  # later tokens of a window carry their index


def test_hidden_state_feature(pair):
    draft, target = pair

    class NeedsHidden(Recorder):
        required_columns = ("draft_hidden", "draft_max_prob")

    pol = NeedsHidden()
    SpeculativeDecoder(draft, target, pol).generate(PROMPT, None, 6, None, 0)
    h = pol.seen[0]["draft_hidden"]
    with torch.no_grad():
        ref = draft(PROMPT, output_hidden_states=True).hidden_states[-1][:, -1]
    torch.testing.assert_close(h.float(), ref.to(torch.float16).float())


def disco_policy(threshold: float = 0.5) -> StopPolicy:
    from predictors.disco import DiscoNet, DiscoPolicy
    from predictors.inputs import FeatureSpec

    spec = FeatureSpec.for_disco(top_k=10)
    torch.manual_seed(1)
    return DiscoPolicy(DiscoNet(spec.width, 16), spec, threshold=threshold, max_draft_len=8)


@pytest.mark.parametrize("spec", ["static:3", "svip:0.3", "disco", "llamacpp:4,1,0.5"])
def test_batch_equals_per_sequence(pair, spec):
    draft, target = pair
    policy = disco_policy() if spec == "disco" else build_policy(spec)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 250, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :8] = 0  # a one-token prompt
    dec = SpeculativeDecoder(draft, target, policy)
    out, stats = dec.generate(ids, mask, 12, None, 0)
    for b in range(3):
        single = ids[b : b + 1, mask[b].bool()]
        o1, s1 = dec.generate(single, None, 12, None, 0)
        assert out[b, 9:].tolist() == o1[0, single.shape[1]:].tolist()
    assert stats.tokens == 36
    if spec != "static:3":
        assert len(set(stats.drafted_lengths)) > 1  # per-sequence draft lengths


def test_eos_and_max_new_tokens(pair):
    draft, target = pair
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=15, pad_token_id=256)[0, PROMPT.shape[1]:].tolist()
    eos = ref[6]
    out, stats = SpeculativeDecoder(draft, target, build_policy("static:5")).generate(PROMPT, None, 15, eos, 0)
    new = out[0, PROMPT.shape[1]:].tolist()
    assert new[: new.index(eos) + 1] == ref[: ref.index(eos) + 1]
    assert stats.tokens == ref.index(eos) + 1
    out, stats = SpeculativeDecoder(draft, target, build_policy("static:5")).generate(PROMPT, None, 7, None, 0)
    assert out.shape[1] == PROMPT.shape[1] + 7 and stats.tokens == 7


class CompanionAccept(StopPolicy):
    """SV-like stub: score = companion acceptance."""

    kind = "sv"
    round_rule = GOODPUT
    required_columns = ("companion_accept",)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["companion_accept"]


def test_sv_goodput_verification_is_exact(pair, companion):
    draft, target = pair
    table = CostModel(draft_s_per_token=0.1, target_s={1: 0.3, 9: 0.5})
    pol = CompanionAccept(threshold=0.2, max_draft_len=8)
    dec = SpeculativeDecoder(draft, target, pol, companion=companion, cost_model=table)
    out, stats = dec.generate(PROMPT, None, 25, None, 0)
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=25, pad_token_id=256)
    assert out.tolist() == ref.tolist()
    assert stats.accepted + stats.rounds == 25


def test_sv_real_table_policy(pair, companion):
    """The SV bin-table policy from predictors.sv runs in the engine, priced by a measured cost model."""
    from predictors.sv import SVPolicy, SVTable

    draft, target = pair
    table = SVTable(s_bins=4, a_bins=4)
    g = torch.Generator().manual_seed(0)
    s, a = torch.rand(200, generator=g), torch.rand(200, generator=g)
    table.fit(s, a, (s + a) / 2)
    lat = measure_cost_model(draft, target, companion, prompt_len=8, lengths=(1, 3, 9), repeats=1)
    dec = SpeculativeDecoder(draft, target, SVPolicy(table, threshold=0.1, max_draft_len=8), companion=companion,
                             cost_model=lat)
    out, stats = dec.generate(PROMPT, None, 15, None, 0)
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=15, pad_token_id=256)
    assert out.tolist() == ref.tolist()


class Sequential(StopPolicy):
    """SPRINTER-like stub: not exact, verifier score = draft max probability."""

    kind = "sprinter"
    round_rule = SEQUENTIAL
    required_columns = ("draft_max_prob",)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["draft_max_prob"]


def test_sprinter_sequential_verification(pair):
    draft, target = pair
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=20, pad_token_id=256)
    # Stopping after every token: the single drafted token is always verified -> exact output.
    one = SpeculativeDecoder(draft, target, Sequential(threshold=2.0, max_draft_len=8))
    out, _ = one.generate(PROMPT, None, 20, None, 0)
    assert out.tolist() == ref.tolist()
    # Never stopping before the cap: only every 8th token is checked; the output may differ but the counts add up.
    seq = SpeculativeDecoder(draft, target, Sequential(threshold=-1.0, max_draft_len=8))
    out, stats = seq.generate(PROMPT, None, 20, None, 0)
    assert stats.tokens == 20 and stats.accepted + stats.rounds == 20
    assert stats.accepted_lengths[0] >= 7  # the 7 tokens before the checked one are taken unverified


def test_sprinter_policy_from_predictors(pair):
    from predictors.inputs import FeatureSpec
    from predictors.sprinter import SprinterNet, SprinterPolicy

    draft, target = pair
    pol = SprinterPolicy(SprinterNet(32), FeatureSpec.for_sprinter(32), threshold=0.5, max_draft_len=6)
    out, stats = SpeculativeDecoder(draft, target, pol).generate(PROMPT, None, 12, None, 0)
    assert stats.tokens == 12


def test_bad_input(pair, companion):
    draft, target = pair
    dec = SpeculativeDecoder(draft, target, build_policy("static:3"))
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate(torch.zeros(1, 0, dtype=torch.long), None, 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate(PROMPT, None, 0)
    with pytest.raises(ValueError, match="companion"):
        SpeculativeDecoder(draft, target, CompanionAccept())
    with pytest.raises(ValueError, match="unknown policy"):
        build_policy("nonsense:3")


def test_tokenizer_and_fingerprint_checks(tmp_path, tiny_pair):
    from compute.models import byte_tokenizer, model_fingerprint
    from predictors.baselines import SVIP
    from predictors.export import export_predictor

    draft, target, tok = tiny_pair
    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="tokenizers differ|vocabulary"):
        build_decoder(draft, target, "static:3", draft_tokenizer=tok, target_tokenizer=other)
    fp = model_fingerprint(draft, tok)
    fp_other = dict(fp, hidden_size=fp["hidden_size"] + 1, name="another-draft")
    export_predictor(SVIP(0.4), tmp_path / "svip", {"draft_fingerprint": fp_other})
    with pytest.raises(ValueError, match="trained for draft model"):
        build_decoder(draft, target, str(tmp_path / "svip"), draft_tokenizer=tok, target_tokenizer=tok)
    export_predictor(SVIP(0.4), tmp_path / "ok", {"draft_fingerprint": fp})
    dec = build_decoder(draft, target, str(tmp_path / "ok"), draft_tokenizer=tok, target_tokenizer=tok)
    assert dec.policy.kind == "svip" and abs(dec.policy.h - 0.4) < 1e-9


def test_sv_batch_greedy_selection(pair, companion):
    from predictors.goodput import batch_lengths as sv_batch_lengths

    cm = CostModel(draft_s_per_token=0.0, target_s={1: 1.0, 11: 2.0})
    lat = lambda n: cm.round_time(n)  # noqa: E731
    # Confident sequence 0 gets its tokens, hopeless sequence 1 none.
    assert sv_batch_lengths([[0.99, 0.99, 0.99], [0.01, 0.9]], lat) == [3, 0]
    assert sv_batch_lengths([[], []], lat) == [0, 0]
    draft, target = pair
    pol = CompanionAccept(threshold=0.2, max_draft_len=6)
    dec = SpeculativeDecoder(draft, target, pol, companion=companion,
                             cost_model=CostModel(draft_s_per_token=0.01, target_s={1: 0.3, 9: 0.4}))
    ids = torch.cat([PROMPT, PROMPT.flip(1)])
    out, _ = dec.generate(ids, None, 10, None, 0)
    for b in range(2):
        ref = target.generate(ids[b : b + 1], do_sample=False, max_new_tokens=10, pad_token_id=256)
        assert out[b].tolist() == ref[0].tolist()


@pytest.mark.real
def test_real_pair_greedy_exact():
    """The packaged Qwen pair: engine output equals target-only greedy output (run with --real under
    flock /tmp/specstop-real.lock)."""
    from compute.models import ModelSpec, load_model

    draft, tok = load_model(ModelSpec("packaged:qwen2.5-coder-0.5b-instruct"))
    target, _ = load_model(ModelSpec("packaged:qwen2.5-coder-1.5b-instruct"))
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a list."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = target.generate(ids, do_sample=False, max_new_tokens=24)
    for spec in ("static:5", "svip:0.3"):
        out, stats = SpeculativeDecoder(draft, target, build_policy(spec)).generate(
            ids, None, 24, target.generation_config.eos_token_id, 0)
        n = min(out.shape[1], ref.shape[1])
        assert out[0, :n].tolist() == ref[0, :n].tolist()
        assert stats.mean_accepted > 0.5


def test_sv_stops_drafting_when_goodput_says_verify_nothing(pair, companion):
    """When verification is so dear that the goodput-best prefix stays empty, SV stops drafting after one token (no
    reachable length promises more tokens/s than verifying nothing) instead of drafting to the cap and throwing
    everything away; the output stays exact."""
    draft, target = pair
    dear = CostModel(draft_s_per_token=0.1, target_s={1: 0.3, 2: 10.0, 9: 80.0})
    pol = CompanionAccept(threshold=0.0, max_draft_len=8)  # the policy alone would always draft to the cap
    dec = SpeculativeDecoder(draft, target, pol, companion=companion, cost_model=dear)
    out, stats = dec.generate(PROMPT, None, 10, None, 0)
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=10, pad_token_id=256)
    assert out.tolist() == ref.tolist()
    assert stats.accepted == 0 and stats.drafted <= stats.rounds  # at most one drafted per round, none sent


def test_companion_runs_only_for_policies_that_read_it(pair, companion):
    """A companion passed to a decoder whose policy does not read it is not run (it would slow every draft step)."""
    draft, target = pair
    assert SpeculativeDecoder(draft, target, build_policy("static:3"), companion=companion).companion is None
    pol = CompanionAccept(threshold=0.2, max_draft_len=4)
    assert SpeculativeDecoder(draft, target, pol, companion=companion).companion is companion


def test_a_companion_sharing_the_drafts_layers_reads_its_states_from_the_draft_step():
    """SV with truncated:N:<draft> loaded as the generator loads it (its layers the draft's own): the engine runs no
    companion pass, its companion logits equal a separate companion model's, the output is target-only's and the
    cost model prices the companion as its LM head."""
    from compute.models import ModelSpec, load_model, share_truncated_layers
    from compute.timing import measure_cost_model
    from predictors.sv import SVPolicy

    draft, _ = load_model(ModelSpec("tiny:1:32:3"))
    target, _ = load_model(ModelSpec("tiny:2:32:3"))
    separate, _ = load_model(ModelSpec("truncated:2:tiny:1:32:3"))
    shared, _ = load_model(ModelSpec("truncated:2:tiny:1:32:3"))
    assert share_truncated_layers(shared, draft) == 2
    seen = {}

    class Spy(SVPolicy):
        def score_list(self, features):  # the engine's per-token call
            seen.setdefault(self.tag, []).append(features["companion_prob"].clone())
            return super().score_list(features)

    runs = {}
    for tag, comp in (("separate", separate), ("shared", shared)):
        pol = Spy(_sv_table(), threshold=0.1, max_draft_len=6)
        pol.tag = tag
        lat = measure_cost_model(draft, target, comp, prompt_len=8, lengths=(1, 3, 7), repeats=1)
        # rounds priced with a curve on which drafting pays (tiny models' draft steps cost about a target step)
        priced = replace(lat, draft_s_per_token=1e-3, companion_s_per_token=1e-3, target_s={1: 1.0, 3: 1.0, 7: 1.2})
        dec = SpeculativeDecoder(draft, target, pol, companion=comp, cost_model=priced)
        assert (dec.companion_depth == 2) == (tag == "shared")
        runs[tag] = (dec.generate(PROMPT, None, 24, None, 0)[0], lat)
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=256)
    assert runs["shared"][0].tolist() == ref.tolist() == runs["separate"][0].tolist()
    torch.testing.assert_close(torch.cat(seen["shared"]), torch.cat(seen["separate"]), rtol=1e-4, atol=1e-6)
    assert runs["shared"][1].extra.get("companion_shares_draft_layers") is True


def _sv_table():
    """A fitted SV bin table (S, A_c on a 4 x 4 grid, acceptance their mean)."""
    from predictors.sv import SVTable

    table = SVTable(s_bins=4, a_bins=4)
    g = torch.Generator().manual_seed(0)
    s, a = torch.rand(200, generator=g), torch.rand(200, generator=g)
    table.fit(s, a, (s + a) / 2)
    return table
