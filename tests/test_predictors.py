"""Feature builders, predictor modules and policies, the SV bin table (no training loop; see test_training.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compute.draft_stats import native_available
from predictors.disco import DiscoNet, DiscoPolicy
from predictors.inputs import FeatureSpec, build_features, topk_entropy
from predictors.sprinter import SprinterNet, SprinterPolicy
from predictors.sv import SVPolicy, SVTable, binary_entropy_bits
from tests.synthetic import make_records


@pytest.fixture(scope="module")
def rec() -> dict[str, np.ndarray]:
    return make_records(n_prompts=10, tokens_per_prompt=10, hidden_size=8)


def test_disco_features_numpy_and_decode_time_tensors_agree(rec):
    spec = FeatureSpec.for_disco(top_k=10, extra=("draft_max_prob", "draft_entropy"))
    x_np = build_features(spec, rec)  # Parquet path: numpy columns
    feats = {c: torch.as_tensor(rec[c]) for c in ("draft_topk", "position", "draft_max_prob", "draft_entropy")}
    x_t = build_features(spec, feats)  # decode path: tensors
    assert x_np.shape == (100, 14) == (100, spec.width)
    assert torch.equal(x_np, x_t)
    t = torch.as_tensor(rec["draft_topk"]) / torch.as_tensor(rec["draft_topk"]).sum(1, keepdim=True)
    assert torch.allclose(x_np[:, 10], -(t * t.log()).sum(1), atol=1e-5)
    assert torch.allclose(x_np[:, 11], torch.as_tensor(rec["position"]).float() / 40.0)
    # one token at decode time, position as a plain int
    one = build_features(
        spec,
        {
            "draft_topk": feats["draft_topk"][3],
            "position": 3,
            "draft_max_prob": feats["draft_max_prob"][3:4],
            "draft_entropy": feats["draft_entropy"][3:4],
        },
    )
    assert torch.allclose(one[0], x_np[3])


def test_topk_entropy_uniform():
    assert torch.allclose(topk_entropy(torch.full((2, 4), 0.1)), torch.full((2,), float(np.log(4))))


def test_feature_errors(rec):
    spec = FeatureSpec.for_disco(top_k=10)
    with pytest.raises(KeyError, match="position"):
        build_features(spec, {"draft_topk": rec["draft_topk"]})
    with pytest.raises(ValueError, match="width mismatch.*width 5.*width 10"):
        build_features(spec, {"draft_topk": rec["draft_topk"][:, :5], "position": rec["position"]})
    bad = rec["draft_topk"].copy()
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        build_features(spec, {"draft_topk": bad, "position": rec["position"]})
    with pytest.raises(ValueError, match="width mismatch"):
        build_features(FeatureSpec.for_sprinter(16), {"draft_hidden": rec["draft_hidden"]})
    with pytest.raises(ValueError, match="extra"):
        FeatureSpec.for_disco(extra=("p",))


def test_spec_roundtrip():
    specs = (FeatureSpec.for_disco(8, 20.0, ("draft_entropy",)), FeatureSpec.for_sprinter(12), FeatureSpec.for_sv())
    for spec in specs:
        assert FeatureSpec.from_dict(spec.to_dict()) == spec


def test_policies_score_threshold_and_cap(rec):
    spec = FeatureSpec.for_disco(10)
    net = DiscoNet(spec.width, hidden_size=8)
    pol = DiscoPolicy(net, spec, threshold=0.5, max_draft_len=7)
    feats = {"draft_topk": torch.as_tensor(rec["draft_topk"]), "position": torch.as_tensor(rec["position"])}
    s = pol.score(feats)
    assert s.shape == (100,) and ((s >= 0) & (s <= 1)).all()
    assert torch.equal(pol.keep_drafting(feats), s >= 0.5)
    assert pol.draft_cap() == 7 and pol.exact and pol.kind == "disco"
    assert pol.required_columns == ("draft_topk", "position")
    sp = SprinterPolicy(SprinterNet(8), FeatureSpec.for_sprinter(8))
    assert not sp.exact and sp.kind == "sprinter"
    assert sp.score({"draft_hidden": torch.as_tensor(rec["draft_hidden"])}).shape == (100,)
    with pytest.raises(ValueError, match="width"):
        DiscoPolicy(DiscoNet(5), spec)


def test_standardise_buffers(rec):
    net = SprinterNet(8)
    x = torch.as_tensor(rec["draft_hidden"]).float()
    net.norm.fit(x)
    z = net.norm(x)
    assert torch.allclose(z.mean(0), torch.zeros(8), atol=1e-4)
    assert torch.allclose(z.std(0, unbiased=False), torch.ones(8), atol=1e-3)
    assert set(net.state_dict()) >= {"norm.mean", "norm.std"}


@pytest.mark.parametrize("prior_index", [-1, 3])
def test_disco_folded_weights_give_the_forward_logit(prior_index):
    """DiscoNet.folded (the standardisation folded into the first layer, the native call's weights) computes the
    forward's logit to float32 rounding, from the weights as they are when it is called."""
    torch.manual_seed(0)
    net = DiscoNet(15, 16, prior_index=prior_index).eval()
    net.norm.fit(torch.randn(200, 15) * 3 + 1)
    x = torch.rand(40, 15)

    def from_fold() -> torch.Tensor:
        (w1, b1, w2, b2), (index, scale, bias) = net.folded()
        out = torch.relu(x @ w1.T + b1) @ w2 + b2
        return out + scale * torch.logit(x[:, index], eps=1e-6) + bias if index >= 0 else out

    torch.testing.assert_close(from_fold(), net(x))
    with torch.no_grad():
        net.norm.mean.add_(0.5)
        net.body[0].weight.mul_(1.5)
    torch.testing.assert_close(from_fold(), net(x))
    with pytest.raises(ValueError, match="hybrid"):
        DiscoNet(15, 8, hidden_dim=5, hidden_rank=2).folded()


def test_disco_policy_prepare_takes_the_weights_in_hand():
    """DiscoPolicy reads the native call's weights at construction and prepare(); a weight changed in place reaches
    the scores after prepare(); moving the policy prepares again."""
    if not native_available():
        pytest.skip("native statistics unavailable (no compiler)")
    torch.manual_seed(0)
    spec = FeatureSpec.for_disco(top_k=10)
    pol = DiscoPolicy(DiscoNet(spec.width, 8).eval(), spec)
    feats = {"draft_topk": _topk(5), "position": torch.arange(5)}
    before = pol.score(feats)
    with torch.no_grad():
        pol.net.head.bias.add_(1.0)
    torch.testing.assert_close(pol.score(feats), before)  # the weights taken at construction
    pol.prepare()
    after = pol.score(feats)
    assert (after > before).all()
    pol.native = False
    torch.testing.assert_close(pol.score(feats), after, rtol=1e-5, atol=1e-6)
    pol.native = True
    with torch.no_grad():
        pol.net.head.bias.sub_(1.0)
    torch.testing.assert_close(pol.to("cpu").score(feats), before)


def _topk(n: int) -> torch.Tensor:
    """[n, 10] sorted top-10 probabilities of random 40-token distributions."""
    return torch.softmax(torch.randn(n, 40) * 3, -1).sort(-1, descending=True).values[:, :10].contiguous()


def _native_and_torch(pol, feats) -> tuple[torch.Tensor, torch.Tensor]:
    """A policy's scores on its native path and on the torch path (DISCO's public ``native`` switch, SPRINTER's own)."""
    switch = "native" if isinstance(pol, DiscoPolicy) else "_native"
    native = pol.score(feats)
    setattr(pol, switch, False)
    try:
        return native, pol.score(feats)
    finally:
        setattr(pol, switch, True)


@pytest.mark.parametrize("prior_index", [-1, 12])
def test_disco_native_score_equals_the_torch_path(prior_index):
    """DiscoPolicy.score's native call (inputs and network in one: the engine's stop decision) gives the torch path's
    scores to float32 rounding, for the engine's column types (int64 position, float32 extras, log extras), one row
    or many; a NaN input is refused by the torch path's message."""
    if not native_available():
        pytest.skip("native statistics unavailable (no compiler)")
    torch.manual_seed(1)
    spec = FeatureSpec.for_disco(top_k=10, extra=("draft_max_prob", "draft_entropy", "log_max_prob"))
    net = DiscoNet(spec.width, 64, prior_index=prior_index)
    net.norm.fit(torch.rand(300, spec.width) * 2)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    pol = DiscoPolicy(net, spec, threshold=0.5)
    topk = _topk(7)
    topk[3, 5:] = 0  # fewer than k tokens with mass
    feats = {"draft_topk": topk, "position": torch.arange(7), "draft_max_prob": topk[:, 0].clone(),
             "draft_entropy": torch.rand(7) * 4}
    native, torch_path = _native_and_torch(pol, feats)
    torch.testing.assert_close(native, torch_path, rtol=1e-5, atol=1e-6)
    one = {k: v[2:3] for k, v in feats.items()}
    torch.testing.assert_close(pol.score(one), torch_path[2:3], rtol=1e-5, atol=1e-6)
    bad = {**feats, "draft_entropy": feats["draft_entropy"].clone()}
    bad["draft_entropy"][4] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        pol.score(bad)


@pytest.mark.parametrize("prior_index,tv_head", [(-1, False), (12, False), (12, True)])
def test_disco_scores_equal_the_batch_formula_on_random_features(prior_index, tv_head):
    """DiscoPolicy.score, batched and one row at a time as the engine calls it, equals the batch scoring formula
    (sigmoid of head(ReLU(body((x - mean) / std))) plus the prior, on build_features' matrix) within 1e-6 on random
    features, through the native call and through the module."""
    torch.manual_seed(3)
    spec = FeatureSpec.for_disco(top_k=10, extra=("draft_max_prob", "draft_entropy", "log_max_prob"))
    net = DiscoNet(spec.width, 64, tv_head=tv_head, prior_index=prior_index)
    net.norm.fit(torch.rand(500, spec.width) * 3)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    pol = DiscoPolicy(net, spec, threshold=0.5)
    n = 300
    topk = _topk(n)
    feats = {"draft_topk": topk, "position": torch.randint(0, 40, (n,)), "draft_max_prob": topk[:, 0].clone(),
             "draft_entropy": torch.rand(n) * 5}
    x = build_features(spec, feats).double()
    first, head = net.body[0], net.head
    z = (x - net.norm.mean.double()) / net.norm.std.double()
    logit = (torch.relu(z @ first.weight.double().T + first.bias.double()) @ head.weight[0].double()
             + head.bias[0].double())
    if prior_index >= 0:
        q = x[:, prior_index].clamp(1e-6, 1 - 1e-6)
        logit = logit + net.prior.scale.double() * torch.log(q / (1 - q)) + net.prior.bias.double()
    want = torch.sigmoid(logit).float().detach()
    for native in (True, False):
        pol.native = native
        torch.testing.assert_close(pol.score(feats), want, rtol=0, atol=1e-6)
        rows = torch.cat([pol.score({k: v[i : i + 1] for k, v in feats.items()}) for i in range(0, n, 7)])
        torch.testing.assert_close(rows, want[::7], rtol=0, atol=1e-6)


@pytest.mark.parametrize("prior", [False, True])
def test_sprinter_native_score_equals_the_torch_path(prior):
    """SprinterPolicy.score's native call (the DISCO inputs and the hidden-state term in one, the linear layer with its
    standardisation folded) gives the torch path's scores to float32 rounding, on float16 hidden states as the engine
    passes them, one row or many; the fold follows the weights; a NaN is refused by the torch path's message."""
    if not native_available():
        pytest.skip("native statistics unavailable (no compiler)")
    torch.manual_seed(2)
    hd = 24
    spec = FeatureSpec.for_sprinter(hd, top_k=10, extra=("draft_max_prob", "q", "log_q"))
    net = SprinterNet(spec.width, prior_index=hd if prior else -1)  # the prior on the first top-k probability
    net.norm.fit(torch.rand(300, spec.width) * 2)
    with torch.no_grad():
        net.linear.weight.copy_(torch.randn_like(net.linear.weight) * 0.2)
        net.linear.bias.fill_(0.3)
    pol = SprinterPolicy(net, spec, threshold=0.5)
    topk = _topk(6)
    feats = {"draft_topk": topk, "position": torch.arange(6), "draft_max_prob": topk[:, 0].clone(),
             "q": topk[:, 1].clone(), "draft_hidden": torch.randn(6, hd).to(torch.float16)}
    native, torch_path = _native_and_torch(pol, feats)
    torch.testing.assert_close(native, torch_path, rtol=1e-5, atol=1e-6)
    one = {k: v[4:5] for k, v in feats.items()}
    torch.testing.assert_close(pol.score(one), torch_path[4:5], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        net.linear.bias.fill_(-2.0)  # the fold follows a changed weight
    torch.testing.assert_close(*_native_and_torch(pol, feats), rtol=1e-5, atol=1e-6)
    bad = {**feats, "draft_hidden": feats["draft_hidden"].clone()}
    bad["draft_hidden"][1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        pol.score(bad)


def _planted_sv(n: int = 32_000, seed: int = 0):
    """S, A_c on a 4 x 4 grid of equally filled cells (values kept 10% away from the cell borders, so equal-count edges
    fall between cells); acceptance constant per cell, at the centres of 16 equal-width levels."""
    rng = np.random.default_rng(seed)
    i, j = np.arange(n) % 4, (np.arange(n) // 4) % 4
    s = (i + rng.uniform(0.1, 0.9, n)) / 4
    a = (j + rng.uniform(0.1, 0.9, n)) / 4
    means = (np.arange(16).reshape(4, 4) + 0.5) / 16  # [4, 4], all distinct
    return s, a, means[i, j], means


def test_sv_table_recovers_cell_means():
    s, a, y, means = _planted_sv()
    table = SVTable(s_bins=4, a_bins=4, prior_count=1.0)
    table.fit(s, a, y)
    assert table.table.shape == (4, 4)
    assert np.allclose(table.table.numpy(), means, atol=1e-3)
    assert np.allclose(table.s_edges.numpy(), np.linspace(0, 1, 5), atol=0.03)
    pol = SVPolicy(table)
    x = {"companion_sim": torch.tensor([0.1, 0.9]), "companion_accept": torch.tensor([0.1, 0.6])}
    assert torch.allclose(pol.score(x), torch.tensor([means[0, 0], means[3, 2]], dtype=torch.float32), atol=0.03)


def test_sv_score_list_looks_up_the_cells_the_tensor_path_finds():
    """The engine's per-token call (Python lists after reset) gives the tensor path's values, edges included; before a
    reset, on NaN or on a wide batch it takes the tensor path (which names a NaN column)."""
    s, a, y, _ = _planted_sv()
    table = SVTable(s_bins=4, a_bins=4, prior_count=1.0)
    table.fit(s, a, y)
    pol = SVPolicy(table)
    edges = table.s_edges.float().tolist()
    xs = torch.tensor([0.0, 1.0, -0.5, 2.0, *edges, 0.3])
    xa = torch.tensor([*table.a_edges.float().tolist(), 0.5, 1.5, 0.2, 0.7, 0.9, 0.01])[: xs.numel()]
    assert pol._lists is None
    pol.reset()
    for i in range(xs.numel()):
        one = {"companion_sim": xs[i : i + 1], "companion_accept": xa[i : i + 1]}
        assert pol.score_list(one) == pol.score(one).tolist(), i
    bad = {"companion_sim": torch.tensor([float("nan")]), "companion_accept": torch.tensor([0.5])}
    with pytest.raises(ValueError, match="NaN or inf"):
        pol.score_list(bad)


def test_sv_information_gain_known_value():
    s, a, y, means = _planted_sv()
    table = SVTable(4, 4, prior_count=0.0)
    info = table.fit(s, a, y)
    # Bernoulli events: H(A) = h2(mean), H(A | cell) = mean over (equally likely) cells of h2(cell mean)
    expected = binary_entropy_bits(means.mean()) - binary_entropy_bits(means).mean()
    assert info["information_gain_bits"] == pytest.approx(float(expected), abs=0.01)
    assert info["h_a_bits"] == pytest.approx(float(binary_entropy_bits(means.mean())), abs=0.01)
    # levels: accept_prob is a deterministic function of the cell, 16 distinct values in 16 levels -> H(A | cell) = 0
    lv = table.information_gain(s, a, y, levels=16)
    assert lv["h_a_given_cells_bits"] == pytest.approx(0.0, abs=0.02)
    assert lv["information_gain_bits"] == pytest.approx(4.0, abs=0.02)  # 16 equally likely levels
    # no signal: the gain vanishes
    rng = np.random.default_rng(1)
    noise = table.information_gain(rng.random(20000), rng.random(20000), np.full(20000, 0.3))
    assert noise["information_gain_bits"] == pytest.approx(0.0, abs=1e-9)


def test_sv_table_smooths_thin_cells():
    rng = np.random.default_rng(0)
    s = np.concatenate([rng.random(1000) * 0.5, [0.9]])  # the top S bin gets a single token
    a = rng.random(1001)
    y = np.concatenate([np.full(1000, 0.5), [1.0]])
    table = SVTable(2, 2, prior_count=5.0)
    table.fit(s, a, y)
    top_row = table.table[-1]
    assert (top_row < 1.0).all() and (top_row > 0.5).all()  # shrunk toward the (shrunk) row / global mean
    assert not torch.isnan(table.table).any()


def test_sv_table_duplicate_quantiles_merge():
    s = np.random.default_rng(0).random(1000)
    a = np.concatenate([np.random.default_rng(1).random(400), np.ones(600)])  # A_c = 1 for most tokens
    table = SVTable(10, 10)
    table.fit(s, a, a)
    assert table.a_bins < 10 and table.table.shape == (10, table.a_bins)
    i, j = table.cells(torch.tensor([0.5]), torch.tensor([1.0]))
    assert int(j) == table.a_bins - 1


def test_log_extras_read_their_column():
    """log_q / log_max_prob enter as the log of q / draft_max_prob, on the training and the decode path alike."""
    spec = FeatureSpec.for_disco(top_k=2, extra=("q", "log_q", "log_max_prob"))
    assert spec.columns == ("draft_topk", "position", "q", "draft_max_prob")
    cols = {"draft_topk": np.array([[0.5, 0.2], [0.9, 0.05]], np.float32), "position": np.array([0, 3]),
            "q": np.array([0.2, 0.9], np.float32), "draft_max_prob": np.array([0.5, 0.9], np.float32)}
    x = build_features(spec, cols)
    np.testing.assert_allclose(x[:, -3].numpy(), [0.2, 0.9], rtol=1e-6)
    np.testing.assert_allclose(x[:, -2].numpy(), np.log([0.2, 0.9]), rtol=1e-6)
    np.testing.assert_allclose(x[:, -1].numpy(), np.log([0.5, 0.9]), rtol=1e-6)
    one = build_features(spec, {k: torch.as_tensor(v[1]) for k, v in cols.items()})  # a single decode-time token
    np.testing.assert_allclose(one.numpy(), x[1:].numpy(), rtol=1e-6)
