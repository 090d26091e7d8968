"""Does a better forecast of the not-yet-drafted tokens' acceptance move goodput DISCO? Offline replay only (no model
runs): stored records of the real pair, the exported DISCO and its calibration maps, the measured curves.

The goodput rule (``predictors.goodput``) keeps drafting while the best expected tokens/s over the lengths still
reachable beats stopping now; the acceptances of tokens not yet drafted are forecast by the last drafted token's
(``a_j = a_k``, j > k). This study swaps that forecast, everything else equal (the rule, the best-prefix verification,
the curve, the rounds of ``evaluation.replay``), and prints, per data set, replayed speedup over target-only of:

- thresholded DISCO (its export's threshold, tuned on validation), thresholded SVIP (threshold tuned on validation by
  replay, as the benchmark's ``svip:tuned``), the oracle (drafts the acceptable run) and the schedule oracle;
- goodput DISCO with the forecasts, as survival S_m = P(next m tokens all accepted | what is known at token k):
  ``last`` (the current rule: a_k ** m), ``base`` (rho ** m, rho the base rate of a token after an accepted one),
  ``shrink`` ((w a_k + (1 - w) rho) ** m, w chosen on validation), ``next-iso`` (f(a_k) ** m, f the isotonic map of
  the next token's greedy match on the current token's calibrated acceptance, after an accepted token), ``surv-iso``
  (S_m = g_m(a_k), one isotonic map per m of the next m tokens' joint acceptance), ``markov`` (a Markov chain of
  binned calibrated acceptances: draft on when the expected best ratio after one more token, over the chain's next
  bin and the best fixed horizon from there, beats stopping now), ``power`` (every acceptance raised to gamma, chosen
  on validation: the joint acceptance of a long prefix runs below the product of its tokens');
- a linear-objective variant (``rate-lambda``): draft while the best reachable E_n - lambda (n d + t(n + 1)) beats
  stopping, lambda the long-run tokens/s (chosen on validation), i.e. without sunk costs;
- upper bounds of the rule, fed in hindsight: ``hindsight-scores`` (the future tokens' actual calibrated
  acceptances), ``hindsight-truth`` (their actual 0/1 greedy match), ``all-truth`` (every acceptance, drafted ones
  included, 0/1: the rule as its own oracle).

Every fitted forecast is fitted on the train + val splits' target sequences (DISCO's scores there are in-sample for
the network, its calibration map is cross-fitted); the choices (w, lambda) are made on val; test and the benchmark
prompts are held out. Intervals: 95% paired bootstrap over sequences (val, test) or prompts (benchmark), of the ratio
to thresholded DISCO. Greedy mode; data sets:

- val / test: ``outputs/default/data`` greedy draws, origin ``target`` teacher-forced sequences (the exact replay the
  main job tunes and reports on), its ``cost_model.json``;
- bench: the benchmark prompts' records (``outputs/benchmark/replay_check_records.npz``), replayed as
  ``pipelines.replay_check`` does (draft rollouts past a mismatch, ``max_new_tokens`` 96, ``max_draft_len`` 16) under
  the benchmark's ``cost_model.json``.

Usage (a few seconds: numpy and DISCO's small network on stored records, no language model; 1 thread):
    OMP_NUM_THREADS=1 python benchmarks/bench_goodput_forecast.py
    OMP_NUM_THREADS=1 python benchmarks/bench_goodput_forecast.py --root /work/main/outputs --cost costs-other-host.json
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from sklearn.isotonic import IsotonicRegression
from sklearn.metrics import roc_auc_score

import evaluation.replay.rounds as replay_mod
from compute.timing import CostModel
from evaluation.data import load_columns, subset
from evaluation.replay import (
    OracleSchedule,
    ReplayConfig,
    ReplayData,
    position_score_matrix,
    prepare_replay_data,
    replay_policy,
    tune_threshold,
    with_threshold,
)
from predictors import goodput
from predictors.baselines import SVIP, Oracle
from predictors.export import load_predictor
from predictors.labels import draw_mask

torch.set_num_threads(1)

Rule = Callable[[np.ndarray, np.ndarray, goodput.RoundCost, int], tuple[int, int]]
"""(calibrated acceptances of the round's rows, their 0/1 survival in hindsight, cost, cap) -> (drafted, verified)."""


# ------------------------------------------------------------------------------------------------------ the rules
def _round_so_far(acc: np.ndarray, cost: goodput.RoundCost) -> tuple[float, float, float]:
    """(expected tokens/s of stopping now, E_k, P_k) of a round that drafted ``acc``."""
    return goodput.best_prefix(acc, cost)[1], float(goodput.expected_tokens(acc)[-1]), float(np.prod(acc))


def ratio_rule(forecast: Callable[[np.ndarray, np.ndarray, int], np.ndarray]) -> Rule:
    """The goodput rule with ``forecast(acc[:k], truth, m) -> [m]`` survival S_1..S_m of the next m tokens."""

    def keep(acc: np.ndarray, truth: np.ndarray, cost: goodput.RoundCost, cap: int) -> bool:
        k = len(acc)
        if k >= cap or k == 0:
            return k == 0 and cap > 0
        now, e_k, p_k = _round_so_far(acc, cost)
        ns = np.arange(k + 1, cap + 1)
        tokens = e_k + p_k * np.cumsum(forecast(acc, truth, cap - k))
        rate = tokens / (ns * cost.per_draft + cost.verify_times(cap)[k + 1:])
        return bool(rate.max() > now)

    def rule(acc: np.ndarray, truth: np.ndarray, cost: goodput.RoundCost, cap: int) -> tuple[int, int]:
        n = 0
        while n < cap:
            n += 1
            if not keep(acc[:n], truth, cost, cap):
                break
        return n, goodput.best_prefix(acc[:n], cost)[0]

    return rule


def geometric(r: Callable[[float], float]) -> Callable[[np.ndarray, np.ndarray, int], np.ndarray]:
    return lambda acc, truth, m: float(r(float(acc[-1]))) ** np.arange(1, m + 1)


def hindsight_scores(acc_all: dict[str, np.ndarray]) -> Callable[[np.ndarray, np.ndarray, int], np.ndarray]:
    """The future tokens' own calibrated acceptances (the round's window, read in hindsight)."""

    def f(acc: np.ndarray, truth: np.ndarray, m: int) -> np.ndarray:
        fut = acc_all["w"][len(acc): len(acc) + m]
        return np.cumprod(fut)

    return f


def hindsight_truth(acc: np.ndarray, truth: np.ndarray, m: int) -> np.ndarray:
    k = len(acc)
    fut = truth[k: k + m] / max(truth[k - 1], 1e-12) if truth[k - 1] > 0 else np.zeros(m)
    return np.minimum(fut, 1.0)


def rate_lambda_rule(lam: float, forecast: Callable[[np.ndarray, np.ndarray, int], np.ndarray]) -> Rule:
    """Linear objective: maximise E - lam * seconds per round (long-run tokens/s lam; no sunk cost)."""

    def best(acc: np.ndarray, cost: goodput.RoundCost) -> tuple[int, float]:
        v = goodput.expected_tokens(acc) - lam * cost.verify_times(len(acc))
        n = int(np.argmax(v))
        return n, float(v[n])

    def rule(acc: np.ndarray, truth: np.ndarray, cost: goodput.RoundCost, cap: int) -> tuple[int, int]:
        n = 0
        while n < cap:
            n += 1
            if n >= cap:
                break
            a = acc[:n]
            _, now = best(a, cost)
            ns = np.arange(n + 1, cap + 1)
            tokens = goodput.expected_tokens(a)[-1] + float(np.prod(a)) * np.cumsum(forecast(a, truth, cap - n))
            gain = tokens - lam * ((ns - n) * cost.per_draft + cost.verify_times(cap)[n + 1:])
            if not gain.max() > now:
                break
        return n, best(acc[:n], cost)[0]

    return rule


def power_rule(gamma: float, rule: Rule) -> Rule:
    """Every acceptance (drafted and forecast) raised to ``gamma`` (> 1: the joint acceptance of a long prefix below
    the product of its tokens')."""
    return lambda acc, truth, cost, cap: rule(acc ** gamma, truth, cost, cap)


# ----------------------------------------------------------------------------------------- forecasts fitted on data
@dataclasses.dataclass
class Fitted:
    rho: float
    next_iso: IsotonicRegression
    surv: list[IsotonicRegression]
    """surv[m - 1]: a_k -> P(next m accepted | token k accepted)."""
    bins: np.ndarray
    """Markov chain: bin edges of calibrated acceptance."""
    trans: np.ndarray
    """[B, B] P(bin of token k+1 | bin of token k, token k accepted)."""
    acc_bin: np.ndarray
    """[B] P(token accepted | its bin)."""
    start: np.ndarray
    """[B] bin distribution of a round's first token."""


def pairs(data: ReplayData, acc: np.ndarray, m_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(a_t, [m_max] survival of tokens t+1..t+m) over every accepted token t of the target sequences (NaN past the
    stored end)."""
    xs, ys = [], []
    g = data.greedy.astype(float)
    for a, b in zip(data.starts.tolist(), data.ends.tolist()):
        for t in range(a, b - 1):
            if not g[t]:
                continue
            fut = g[t + 1: min(b, t + 1 + m_max)]
            s = np.full(m_max, np.nan)
            s[: len(fut)] = np.cumprod(fut)
            xs.append(acc[t])
            ys.append(s)
    return np.asarray(xs), np.asarray(ys)


def fit_forecasts(data: ReplayData, acc: np.ndarray, m_max: int = 40, n_bins: int = 8) -> Fitted:
    x, y = pairs(data, acc, m_max)
    rho = float(np.nanmean(y[:, 0]))
    iso = lambda xx, yy: IsotonicRegression(y_min=0, y_max=1, out_of_bounds="clip").fit(xx, yy)  # noqa: E731
    surv = []
    for m in range(m_max):
        ok = ~np.isnan(y[:, m])
        surv.append(iso(x[ok], y[ok, m]) if ok.sum() > 50 else surv[-1])
    edges = np.unique(np.quantile(acc, np.linspace(0, 1, n_bins + 1)))
    edges[0], edges[-1] = -np.inf, np.inf
    nb = len(edges) - 1
    bin_of = np.clip(np.searchsorted(edges, acc, side="right") - 1, 0, nb - 1)
    g = data.greedy.astype(float)
    trans = np.full((nb, nb), 1.0)  # Laplace
    acc_bin = np.array([g[bin_of == i].mean() if (bin_of == i).any() else rho for i in range(nb)])
    for a, b in zip(data.starts.tolist(), data.ends.tolist()):
        for t in range(a, b - 1):
            if g[t]:
                trans[bin_of[t], bin_of[t + 1]] += 1
    trans /= trans.sum(1, keepdims=True)
    start = np.bincount(bin_of, minlength=nb) / len(bin_of)
    return Fitted(rho, iso(x, y[:, 0]), surv, edges, trans, acc_bin, start)


def markov_rule(fit: Fitted) -> Rule:
    """Stopping under a Markov chain of binned acceptances, priced by the round's ratio: with the drafted prefix's
    (E_k, P_k) and the last token's bin, draft on when the expectation over the next token's bin of the best of
    (stop there, the best fixed horizon from there) beats stopping now (one step of the dynamic programme, fixed
    horizons after it)."""
    nb = len(fit.acc_bin)

    def future_surv(bin_k: int, m: int) -> np.ndarray:
        # S_j = P(tokens k+1..k+j all accepted | bin_k), j = 1..m, under the chain
        out, dist = np.zeros(m), np.eye(nb)[bin_k]
        for j in range(m):
            dist = dist @ fit.trans  # bin of token k+j+1 (given the previous accepted)
            alive = dist * fit.acc_bin
            out[j] = alive.sum()
            dist = alive
        return out

    cache: dict[tuple[int, int], np.ndarray] = {}

    def surv(bin_k: int, m: int) -> np.ndarray:
        key = (bin_k, m)
        if key not in cache:
            cache[key] = future_surv(bin_k, m)
        return cache[key]

    def binof(a: float) -> int:
        return int(np.clip(np.searchsorted(fit.bins, a, side="right") - 1, 0, nb - 1))

    def keep(acc: np.ndarray, cost: goodput.RoundCost, cap: int) -> bool:
        k = len(acc)
        if k >= cap or k == 0:
            return k == 0 and cap > 0
        now, e_k, p_k = _round_so_far(acc, cost)
        b = binof(float(acc[-1]))
        ns = np.arange(k + 1, cap + 1)
        times = ns * cost.per_draft + cost.verify_times(cap)[k + 1:]
        # one-step look-ahead: draft token k+1, observe its bin, then take the best fixed horizon from there
        if k + 1 >= cap:
            fixed = (e_k + p_k * np.cumsum(surv(b, cap - k))) / times
            return bool(fixed.max() > now)
        dist = fit.trans[b]
        val = 0.0
        for j in range(nb):
            a1 = float(fit.acc_bin[j])
            e1, p1 = e_k + p_k * a1, p_k * a1
            s = np.concatenate([[0.0], np.cumsum(surv(j, cap - k - 1))])  # horizons k+1 .. cap
            r = (e1 + p1 * s) / times
            # stopping at k+1 may verify a shorter prefix: never worse than now re-priced with one more draft step
            stop1 = max(goodput.best_prefix(np.append(acc, a1), cost)[1], float(r[0]))
            val += dist[j] * max(stop1, float(r.max()))
        return bool(val > now)

    def rule(acc: np.ndarray, truth: np.ndarray, cost: goodput.RoundCost, cap: int) -> tuple[int, int]:
        n = 0
        while n < cap:
            n += 1
            if not keep(acc[:n], cost, cap):
                break
        return n, goodput.best_prefix(acc[:n], cost)[0]

    return rule


# ------------------------------------------------------------------------------------------------------- replay
class Study:
    """Replays of one data set: thresholded and oracle policies as they are, the goodput policy under each rule."""

    def __init__(self, data: ReplayData, cm: CostModel, gp: goodput.GoodputPolicy, max_draft_len: int | None) -> None:
        self.data, self.cm, self.gp, self.mdl = data, cm, gp, max_draft_len
        width = gp.max_draft_len if max_draft_len is None else min(gp.max_draft_len, max_draft_len)
        self.scores = position_score_matrix(gp, data.features, width)  # calibrated acceptance per row and position
        self.seqs = [dataclasses.replace(data, starts=data.starts[i:i + 1], ends=data.ends[i:i + 1])
                     for i in range(data.n_seqs)]

    def per_seq(self, policy, rule: Rule | None = None) -> np.ndarray:
        """[S, 2] (target-only seconds, replayed seconds) per sequence."""
        out = []
        patch = mock.patch.object(replay_mod, "_draft_round", self._drafter(rule)) if rule else _null()
        with patch:
            for d in self.seqs:
                r = replay_policy(copy.deepcopy(policy), d, self.cm, "greedy", max_draft_len=self.mdl,
                                  scores=self.scores if rule else None)
                out.append((r.target_only_s, r.time_s))
        return np.asarray(out)

    def _drafter(self, rule: Rule):
        data, holder = self.data, hindsight_holder

        def draft(rp, s, rows, rem, plan):  # same signature as evaluation.replay.rounds._draft_round
            cap = len(rows)
            if cap == 0:
                return 0, 0
            w = np.clip(rp.scores[rows, np.arange(cap)], 0.0, 1.0)
            holder["w"] = w
            truth = np.cumprod(data.greedy[rows].astype(float))
            return rule(w, truth, rp.goodput, cap)

        return draft


hindsight_holder: dict[str, np.ndarray] = {}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def speedup(x: np.ndarray) -> float:
    return float(x[:, 0].sum() / x[:, 1].sum())


def boot_ratio(a: np.ndarray, b: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% paired bootstrap over sequences of speedup(a) / speedup(b)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(n, len(a)))
    r = (a[idx, 0].sum(1) / a[idx, 1].sum(1)) / (b[idx, 0].sum(1) / b[idx, 1].sum(1))
    return float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))


# -------------------------------------------------------------------------------------------------------- main
@dataclasses.dataclass
class Inputs:
    """What every replay of the study reads: DISCO's export (thresholded and as a goodput policy), the data set's
    greedy-draw columns, its curve and the benchmark's."""

    root: Path
    disco: Any
    gp: goodput.GoodputPolicy
    cols: dict[str, np.ndarray]
    cm: CostModel
    bcm: CostModel

    def split_data(self, *splits: str) -> ReplayData:
        """The replay data of the target sequences of ``splits``."""
        return prepare_replay_data(subset(self.cols, np.isin(self.cols["split"].astype(str), splits)), ReplayConfig())


def load_inputs(root: Path, cost: str | None) -> Inputs:
    """DISCO's export, the data set's greedy draws of every split, and the curves (``cost``: another file for the data
    set's, under ``root``)."""
    export = root / "default/train/disco/export"
    disco = load_predictor(export)
    gp = goodput.goodput_policy(load_predictor(export), str(export))
    cols = load_columns(root / "default/data", ["train", "val", "test"], tuple(disco.required_columns))
    cols = subset(cols, draw_mask(cols, "greedy"))
    cm = CostModel.from_json(root / (cost or "default/data/cost_model.json"))
    return Inputs(root, disco, gp, cols, cm, CostModel.from_json(root / "benchmark/cost_model.json"))


def fit_on_train_val(inp: Inputs) -> Fitted:
    """The forecasts fitted on the train + val target sequences, described on a grid of acceptances."""
    fit_data = inp.split_data("train", "val")
    fit_acc = position_score_matrix(inp.gp, fit_data.features, 1)[:, 0]
    fit = fit_forecasts(fit_data, fit_acc)
    print(f"fit on train+val: {fit_data.note}; base rate after an accepted token rho = {fit.rho:.3f}")
    grid = np.linspace(0.5, 1.0, 6)
    print("  next-iso f(a):", ", ".join(f"{a:.2f}->{fit.next_iso.predict([a])[0]:.3f}" for a in grid))
    print("  surv-iso S_4(a):", ", ".join(f"{a:.2f}->{fit.surv[3].predict([a])[0]:.3f}" for a in grid),
          "| a**4:", ", ".join(f"{a ** 4:.3f}" for a in grid))
    return fit


def forecast_rules(fit: Fitted) -> tuple[dict[str, Rule], dict[str, Rule]]:
    """(the fitted forecasts' rules, the hindsight bounds' rules)."""
    rules: dict[str, Rule] = {
        "last (current)": ratio_rule(geometric(lambda a: a)),
        "base": ratio_rule(geometric(lambda a: fit.rho)),
        "next-iso": ratio_rule(geometric(lambda a: float(fit.next_iso.predict([a])[0]))),
        "surv-iso": ratio_rule(lambda acc, truth, m: np.array(
            [fit.surv[min(j, len(fit.surv) - 1)].predict([acc[-1]])[0] for j in range(m)])),
        "markov": markov_rule(fit),
    }
    hind: dict[str, Rule] = {
        "hindsight-scores": ratio_rule(hindsight_scores(hindsight_holder)),
        "hindsight-truth": ratio_rule(hindsight_truth),
    }
    return rules, hind


def choose_on_val(inp: Inputs, fit: Fitted, rules: dict[str, Rule], val: Study) -> float:
    """The shrink weight w, rate-lambda's speedup s (lambda = s / t(1)) and the power gamma of highest replayed
    speedup on val; the power and shrink rules join ``rules``. Returns s."""
    gp, cm = inp.gp, inp.cm
    ws = np.round(np.linspace(0, 1, 11), 2)
    best_w = max(ws, key=lambda w: speedup(val.per_seq(gp, ratio_rule(geometric(
        lambda a, w=w: w * a + (1 - w) * fit.rho)))))
    ss = np.round(np.arange(1.0, 2.01, 0.1), 2)
    best_s = max(ss, key=lambda s: speedup(val.per_seq(gp, rate_lambda_rule(s / cm.target_time(1), geometric(
        lambda a: a)))))
    gs = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
    best_g = max(gs, key=lambda g: speedup(val.per_seq(gp, power_rule(g, rules["last (current)"]))))
    print(f"chosen on val: shrink w = {best_w}, rate-lambda speedup s = {best_s} (lambda = s / t(1)), power "
          f"gamma = {best_g}")
    rules[f"power (gamma={best_g})"] = power_rule(best_g, rules["last (current)"])
    rules[f"shrink (w={best_w})"] = ratio_rule(geometric(lambda a: best_w * a + (1 - best_w) * fit.rho))
    return float(best_s)


def bench_data(root: Path) -> ReplayData:
    """The benchmark prompts' records, replayed as ``pipelines.replay_check`` does."""
    z = np.load(root / "benchmark" / "replay_check_records.npz", allow_pickle=False)
    bcols = {k: z[k] for k in z.files if not k.startswith("_")}
    return prepare_replay_data(bcols, ReplayConfig(mode="greedy", origins=("target",), branch_rollouts=True,
                                                   max_new_tokens=96, fallback_to_all=False))


def replay_sets(inp: Inputs, sets: dict[str, tuple[Study, CostModel, int, float]], rules: dict[str, Rule],
                hind: dict[str, Rule], best_s: float) -> dict[str, dict[str, np.ndarray]]:
    """Data set -> row name -> [S, 2] (target-only, replayed) seconds per sequence, for every policy and rule."""
    gp = inp.gp
    table: dict[str, dict[str, np.ndarray]] = {}
    for name, (st, c, mdl, thr) in sets.items():
        print(f"{name}: {st.data.note}")
        res = {
            "DISCO thresholded": st.per_seq(inp.disco),
            "SVIP thresholded": st.per_seq(with_threshold(SVIP(max_draft_len=mdl), thr)),
            "goodput DISCO (library)": st.per_seq(gp),
        }
        for rn, rule in rules.items():
            res[f"goodput DISCO, {rn}"] = st.per_seq(gp, rule)
        res[f"rate-lambda (s={best_s}), last"] = st.per_seq(gp, rate_lambda_rule(best_s / c.target_time(1),
                                                                                 geometric(lambda a: a)))
        for rn, rule in hind.items():
            res[f"bound: {rn}"] = st.per_seq(gp, rule)
        res["oracle"] = st.per_seq(Oracle(max_draft_len=mdl))
        res["oracle schedule"] = st.per_seq(OracleSchedule(max_draft_len=mdl))
        table[name] = res
    for name, res in table.items():  # the patched round loop reproduces the library's rule
        if not np.allclose(res["goodput DISCO (library)"], res["goodput DISCO, last (current)"]):
            raise RuntimeError(f"{name}: the study's round loop no longer matches evaluation.replay's")
    return table


def print_next_token_auc(inp: Inputs) -> None:
    """On test, after an accepted token: how well the current and the next token's calibrated acceptance rank the
    next token's greedy match."""
    test = inp.split_data("test")
    a_test = position_score_matrix(inp.gp, test.features, 1)[:, 0]
    x, y = pairs(test, a_test, 1)
    nxt = np.asarray([a_test[t + 1] for a, b in zip(test.starts, test.ends) for t in range(a, b - 1) if test.greedy[t]])
    print(f"test, after an accepted token: AUC of the next token's greedy match from the current token's calibrated "
          f"acceptance {roc_auc_score(y[:, 0], x):.3f}, from its own {roc_auc_score(y[:, 0], nxt):.3f}")


def print_table(table: dict[str, dict[str, np.ndarray]]) -> None:
    """Per policy and data set: replayed speedup, its ratio to thresholded DISCO with the interval, and to the
    oracle."""
    names = list(table["val"])
    head = f"{'policy':38s}" + "".join(f"| {n:^35s}" for n in table)
    print("\nreplayed speedup over target-only; x DISCO thresholded [95% paired bootstrap]; / oracle")
    print(head)
    for n in names:
        line = f"{n:38s}"
        for res in table.values():
            a, base, orc = res[n], res["DISCO thresholded"], res["oracle"]
            lo, hi = boot_ratio(a, base)
            sa = speedup(a)
            line += f"| {sa:.3f} {sa / speedup(base):.3f} [{lo:.2f},{hi:.2f}] {sa / speedup(orc):.2f} "
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="outputs", help="the main job's and the benchmark's outputs folder")
    ap.add_argument("--cost", default=None, help="price val / test with this curve (a file under --root) instead of "
                                                 "the data folder's cost_model.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    inp = load_inputs(Path(args.root), args.cost)
    fit = fit_on_train_val(inp)
    # thresholded SVIP tuned on val (greedy draws; the benchmark's svip:tuned)
    val_cols = subset(inp.cols, inp.cols["split"].astype(str) == "val")
    svip_thr, _ = tune_threshold(SVIP(max_draft_len=40), val_cols, inp.cm, split=None)
    svip_thr_b = tune_threshold(SVIP(max_draft_len=16), val_cols, inp.bcm, split=None)[0]
    rules, hind = forecast_rules(fit)
    val = Study(inp.split_data("val"), inp.cm, inp.gp, None)
    best_s = choose_on_val(inp, fit, rules, val)
    sets = {"val": (val, inp.cm, 40, svip_thr),
            "test": (Study(inp.split_data("test"), inp.cm, inp.gp, None), inp.cm, 40, svip_thr),
            "bench": (Study(bench_data(inp.root), inp.bcm, inp.gp, 16), inp.bcm, 16, svip_thr_b)}
    print(f"SVIP threshold tuned on val: {svip_thr:.4f} (data curve), {svip_thr_b:.4f} (benchmark curve)")
    table = replay_sets(inp, sets, rules, hind, best_s)
    print_next_token_auc(inp)
    print_table(table)
    print(f"\n{time.perf_counter() - t0:.0f} s")

if __name__ == "__main__":
    main()
