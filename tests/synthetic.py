"""Synthetic labelled draft-token records with planted signals (all ``data_gen.schema`` columns), for tests.

A latent z per token drives greedy acceptance (greedy_match = z + noise > 0) and the DISCO inputs (the top-1
probability rises with z); r = log(p/q) is z plus noise and is planted along a fixed direction of the hidden state, so
a linear verifier recovers q/p <= lambda; the companion signals (S, A_c) track z and min(1, p/q). Splits are by prompt
(prompt i: train when i % 10 < 7, val when 7-8, test when 9).

Usage::

    from tests.synthetic import make_records, write_shards
    write_shards(tmp_path / "shards", make_records(n_prompts=40))
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from data_gen.schema import ORIGINS, features_schema


def _split(i: int) -> str:
    r = i % 10
    return "train" if r < 7 else ("val" if r < 9 else "test")


def make_records(
    n_prompts: int = 40,
    tokens_per_prompt: int = 30,
    top_k: int = 10,
    hidden_size: int = 16,
    companion: bool = True,
    seed: int = 0,
    noise: float = 0.3,
    vocab_size: int = 260,
) -> dict[str, np.ndarray]:
    """Column -> array (vector columns 2-D) of ``n_prompts * tokens_per_prompt`` tokens."""
    rng = np.random.default_rng(seed)
    n = n_prompts * tokens_per_prompt
    prompt = np.repeat(np.arange(n_prompts), tokens_per_prompt)
    offset = np.tile(np.arange(tokens_per_prompt), n_prompts)
    z = rng.normal(size=n)
    greedy = (z + noise * rng.normal(size=n)) > 0
    # top-k: top-1 rises with z; the rest share the remaining mass geometrically
    top1 = 0.15 + 0.8 / (1 + np.exp(-2.5 * z))
    rest = (1 - top1)[:, None] * 0.6 ** np.arange(1, top_k)[None, :]
    rest = rest / (0.6 ** np.arange(1, top_k)).sum() * 0.9  # keep 10% of the remaining mass outside the top-k
    topk = np.concatenate([top1[:, None], rest], axis=1).astype(np.float32)
    tail = np.clip(1 - topk.sum(1), 1e-6, None)
    ent = -(topk * np.log(topk)).sum(1) - tail * np.log(tail / 50)  # tail spread over 50 tokens
    q = top1.copy()
    r = z + noise * rng.normal(size=n)  # log(p/q)
    p = np.minimum(q * np.exp(r), 1.0)
    accept = np.minimum(1.0, p / q)
    u = np.ones(hidden_size) / np.sqrt(hidden_size)
    hidden = rng.normal(size=(n, hidden_size)) + 3.0 * r[:, None] * u[None, :]
    draft_token = rng.integers(0, vocab_size, size=n)
    target_argmax = np.where(greedy, draft_token, (draft_token + 1) % vocab_size)
    # oracle length: consecutive greedy matches from here within the prompt's run
    oracle = np.zeros(n, dtype=np.int32)
    censored = np.zeros(n, dtype=bool)
    for i in range(n - 1, -1, -1):
        last = offset[i] == tokens_per_prompt - 1
        if greedy[i]:
            oracle[i] = 1 + (0 if last else oracle[i + 1])
            censored[i] = True if last else censored[i + 1]
    rec: dict[str, np.ndarray] = {
        "sample_id": np.array([f"syn:{i}" for i in prompt]),
        "source": np.array(["synthetic"] * n),
        "domain": np.where(prompt % 2 == 0, "code", "chat"),
        "split": np.array([_split(i) for i in prompt]),
        "seq_id": np.array([f"syn:{i}:0" for i in prompt]),
        "origin": np.array([ORIGINS[i % len(ORIGINS)] for i in prompt]),
        "draw": np.array(["greedy"] * n),
        "rollout": np.ones(n, dtype=bool),
        "prefix_len": (20 + offset).astype(np.int32),
        "offset": offset.astype(np.int32),
        "position": offset.astype(np.int32),
        "draft_token": draft_token.astype(np.int32),
        "next_token": target_argmax.astype(np.int32),
        "q": q.astype(np.float32),
        "p": p.astype(np.float32),
        "accept_prob": accept.astype(np.float32),
        "target_argmax": target_argmax.astype(np.int32),
        "greedy_match": greedy,
        "tv": np.clip(1 - accept + 0.05 * rng.normal(size=n), 0, 1).astype(np.float32),
        "draft_entropy": ent.astype(np.float32),
        "draft_max_prob": top1.astype(np.float32),
        "draft_topk": topk,
    }
    if hidden_size:
        rec["draft_hidden"] = hidden.astype(np.float16)
    if companion:
        sim = 1 / (1 + np.exp(-(z + noise * rng.normal(size=n))))
        acc_c = np.clip(accept + 0.1 * rng.normal(size=n), 0, 1)
        rec["companion_sim"] = sim.astype(np.float32)
        rec["companion_accept"] = acc_c.astype(np.float32)
        rec["companion_prob"] = (q * acc_c).astype(np.float32)
        rec["companion_entropy"] = (ent + 0.1 * rng.normal(size=n)).astype(np.float32)
    rec["oracle_len"] = oracle
    rec["oracle_censored"] = censored
    return rec


def write_shards(
    folder: str | Path, records: dict[str, np.ndarray], n_shards: int = 2, top_k: int | None = None,
    hidden_size: int | None = None,
) -> list[Path]:
    """Write ``records`` as ``n_shards`` Parquet files with the schema of ``data_gen.schema.features_schema``."""
    import datasets

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    top_k = top_k or records["draft_topk"].shape[1]
    if hidden_size is None:
        hidden_size = records["draft_hidden"].shape[1] if "draft_hidden" in records else 0
    feats = features_schema(top_k, hidden_size or None, "companion_sim" in records)
    n = len(records["sample_id"])
    paths = []
    for k, idx in enumerate(np.array_split(np.arange(n), n_shards)):
        cols = {c: (records[c][idx].tolist() if records[c].ndim > 1 else records[c][idx]) for c in feats}
        ds = datasets.Dataset.from_dict(cols, features=feats)
        path = folder / f"shard-{k:05d}.parquet"
        ds.to_parquet(str(path))
        paths.append(path)
    return paths


def with_sample_draw(records: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """``records`` (greedy draws) plus a sampled draw per position: same position features, another token with its own
    q(x) (below the top-1), p(x), min(1, p/q) and greedy match (about a third match)."""
    rng = np.random.default_rng(seed)
    n = len(records["sample_id"])
    s = {k: v.copy() for k, v in records.items()}
    s["draw"] = np.array(["sample"] * n)
    s["q"] = (records["draft_max_prob"] * rng.uniform(0.2, 1.0, n)).astype(np.float32)
    s["p"] = np.clip(s["q"] * np.exp(rng.normal(0, 1, n)), 0, 1).astype(np.float32)
    s["accept_prob"] = np.minimum(1.0, s["p"] / s["q"]).astype(np.float32)
    s["greedy_match"] = rng.random(n) < 1 / 3
    return {k: np.concatenate([records[k], s[k]]) for k in records}
