"""Does the target's last hidden state tell a stopper more than the draft's own features?

vLLM hands its draft proposer the target's final hidden states (``target_hidden_states``); EAGLE-style drafters read
them. Before a stopper reads them too, this measures what they would add. On validation prompts, the target decodes
greedily; greedy speculative rounds are walked along its output (the draft drafts ``--cap`` tokens from each round's
start, the round accepts its run of tokens equal to the target's and moves past the target's correction), and each
drafted token up to the round's first rejection is kept with the policy's score, its position, whether it was accepted
and the target's final-norm state at the position that chose the round's first token (the state vLLM passes the
proposer for that request: the target has not read the tokens drafted after it). Then ROC AUC, grouped by prompt in
4 folds: the policy's score alone, a logistic model of the score and the position, and the same with the target's
state (standardised, PCA to k dimensions fitted on the training folds) beside them; AUC at the first position too,
and each model's AUC less the score-and-position model's with a 95% bootstrap interval over prompts.

Usage:
    python benchmarks/target_state_signal.py outputs/default/train/disco/export --prompts 40 --new_tokens 64 \\
        --rows outputs/target-state.npz
    python benchmarks/target_state_signal.py outputs/default/train/disco/export --rows outputs/target-state.npz
(the second reads the stored rows back and only scores them).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.decomposition import PCA
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupKFold
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark.bench import PromptChoice, load_benchmark_prompts  # noqa: E402
from compute.models import load_model  # noqa: E402
from data_gen.config import ModelsConfig  # noqa: E402
from data_gen.prompts import PromptSourceConfig  # noqa: E402
from decoding.draft_steps import step_features  # noqa: E402
from decoding.policies import build_policy  # noqa: E402
from predictors.base import StopPolicy  # noqa: E402

SOURCES = [PromptSourceConfig(name="humaneval"), PromptSourceConfig(name="mtbench"),
           PromptSourceConfig(name="sharegpt", limit=160)]  # the main job's sources (configs/generate-default.yaml)
COLUMNS = ("prompt", "position", "score", "accepted", "round")


def draft_rounds(draft, policy: StopPolicy, out: list[int], start: int, cap: int) -> tuple[list[tuple], list[int]]:
    """Greedy rounds along ``out`` (the target's greedy output after its first ``start`` tokens): per drafted token up
    to its round's first rejection (position, score, accepted, round), and each round's first token's index."""
    cache, rows, starts = DynamicCache(), [], []
    draft(torch.tensor([out[:start]]), past_key_values=cache, use_cache=True)
    t = start  # the round's first token: the target's (its correction or bonus), the draft reads it first
    while t < len(out) - 1:
        if cache.get_seq_length() > t:
            cache.crop(t - cache.get_seq_length())
        logits = draft(torch.tensor([[out[t]]]), past_key_values=cache, use_cache=True).logits[0, -1:].float()
        run, clean = 0, True
        for p in range(cap):
            tok, feats = step_features(logits, policy, 10, p)
            if clean and t + 1 + p < len(out):
                ok = tok == out[t + 1 + p]
                rows.append((p + 1, float(policy.score(feats)[0]), ok, len(starts)))
                clean, run = ok, run + ok
            logits = draft(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1:].float()
        starts.append(t)
        t += run + 1
    return rows, starts


def collect(args: argparse.Namespace, policy: StopPolicy) -> dict[str, np.ndarray]:
    """The rows of every prompt (``COLUMNS``) and the target's state at each round's start."""
    models = ModelsConfig()
    draft, tok = load_model(models.spec(models.draft, "draft"))
    target, _ = load_model(models.spec(models.target, "target"))
    choice = PromptChoice(prompt_texts=None, prompts=SOURCES, seed=0, split=args.split, n_prompts=args.prompts,
                          use_chat_template=True, max_prompt_tokens=512)
    prompts, _, _ = load_benchmark_prompts(choice, tok)
    seen: dict[str, torch.Tensor] = {}
    target.get_decoder().norm.register_forward_hook(lambda m, i, o: seen.__setitem__("h", o))
    rows: list[tuple] = []
    states: list[np.ndarray] = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            x = torch.tensor([ids])
            out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                                  do_sample=False)[0].tolist()
            logits = target(torch.tensor([out])).logits[0]
            wrong = (logits[len(ids) - 1:-1].argmax(-1) != torch.tensor(out[len(ids):])).nonzero()
            out = out[:len(ids) + int(wrong[0])] if len(wrong) else out  # one pass must choose what decoding chose
            h = seen["h"][0].float()
            got, starts = draft_rounds(draft, policy, out, len(ids), args.cap)
            rows += [(i, p, s, ok, r + len(states)) for p, s, ok, r in got]
            states += [h[t - 1].numpy() for t in starts]
            print(f"prompt {i + 1}/{len(prompts)}: {len(rows)} drafted tokens, {time.perf_counter() - t0:.0f} s",
                  flush=True)
    table = np.array(rows, dtype=np.float64)
    return {**{c: table[:, k] for k, c in enumerate(COLUMNS)}, "states": np.stack(states).astype(np.float32)}


def grouped_auc(x: np.ndarray, y: np.ndarray, groups: np.ndarray, states: np.ndarray | None = None,
                rounds: np.ndarray | None = None, k: int = 0, c: float = 1.0) -> np.ndarray:
    """Out-of-fold probabilities of a logistic model on ``x`` (and, with ``states``, the PCA-``k`` of each token's
    round's state, fitted on the training folds), 4 folds grouped by prompt."""
    pred = np.zeros(len(y))
    for tr, te in GroupKFold(4).split(x, y, groups):
        feats = x
        if states is not None and rounds is not None:
            seen = np.unique(rounds[tr])
            mu, sd = states[seen].mean(0), states[seen].std(0) + 1e-3
            pca = PCA(min(k, len(seen) - 1), random_state=0)  # a few rounds: fewer components
            z = pca.fit((states[seen] - mu) / sd).transform((states[rounds] - mu) / sd)
            feats = np.column_stack([x, z])
        scale = feats[tr].std(0) + 1e-6
        model = LogisticRegression(C=c, max_iter=4000).fit(feats[tr] / scale, y[tr])
        pred[te] = model.predict_proba(feats[te] / scale)[:, 1]
    return pred


def report(d: dict[str, np.ndarray]) -> None:
    """AUC of the score, of score + position, and of both with the target's state at several sizes."""
    y, pos, groups = d["accepted"].astype(int), d["position"].astype(int), d["prompt"]
    rounds = d["round"].astype(int)
    p = np.clip(d["score"], 1e-4, 1 - 1e-4)
    x = np.column_stack([np.log(p / (1 - p)), np.eye(pos.max() + 1)[pos][:, 1:]])
    first = pos == 1
    print(f"{len(y)} drafted tokens in {len(np.unique(rounds))} rounds of {len(np.unique(groups))} prompts; accepted "
          "by position: " + " ".join(f"{j}: {y[pos == j].mean():.2f}" for j in range(1, pos.max() + 1)))
    rows = [("the policy's score", d["score"]), ("logistic: score, position", grouped_auc(x, y, groups))]
    rows += [(f"  + target state, PCA {k}, C {c}", grouped_auc(x, y, groups, d["states"], rounds, k, c))
             for k in (8, 32, 128) for c in (0.01, 0.1)]
    base = rows[1][1]
    boot = [np.concatenate([np.nonzero(groups == g)[0] for g in pick])
            for pick in np.random.default_rng(0).choice(np.unique(groups), (500, len(np.unique(groups))))]
    for name, pred in rows:
        gain = [roc_auc_score(y[i], pred[i]) - roc_auc_score(y[i], base[i]) for i in boot]
        lo, hi = np.percentile(gain, [2.5, 97.5])
        print(f"{name:34s} AUC {roc_auc_score(y, pred):.3f}   first position "
              f"{roc_auc_score(y[first], pred[first]):.3f}   against score and position "
              f"{roc_auc_score(y, pred) - roc_auc_score(y, base):+.3f} [{lo:+.3f}, {hi:+.3f}]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy", help="the stopper whose score is compared (an export folder, adaedl, ...)")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--split", default="val", choices=["train", "val"], help="the prompts' split (never the test's)")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--cap", type=int, default=6, help="tokens a round drafts")
    ap.add_argument("--rows", default=None, help="an .npz of the collected rows: read when it exists, else written")
    args = ap.parse_args(argv)
    try:
        if args.prompts < 4 or args.cap < 1 or args.new_tokens < 2:
            raise ValueError(f"--prompts {args.prompts} --cap {args.cap} --new_tokens {args.new_tokens}: four prompts "
                             "at least (four folds), a cap of 1 and 2 new tokens at least")
        policy = build_policy(args.policy, max_draft_len=args.cap)
        if args.rows and Path(args.rows).is_file():
            d = dict(np.load(args.rows))
        else:
            d = collect(args, policy)
            if args.rows:
                np.savez(args.rows, **d)
        report(d)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"target_state_signal: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
