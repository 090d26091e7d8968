"""The per-draft-token record: column names, meanings and Arrow types of the Parquet shards. Labels are derived from the
raw columns when read (``predictors.labels``)."""
from __future__ import annotations

import datasets

DRAWS = ("greedy", "sample")
"""How a record's drafted token was drawn from q: argmax (greedy decoding) or a sample (speculative sampling)."""

ORIGINS = ("prompt", "draft", "target", "spec", "text")
"""Where the tokens before a labelled position come from: the prompt alone, a draft / target / speculative continuation,
or dataset text (docs/methods.md)."""

COLUMNS: dict[str, str] = {
    "sample_id": "prompt id (source:index); splits are by prompt",
    "source": "prompt source (humaneval, mtbench, sharegpt, jsonl, tiny...)",
    "domain": "code or chat",
    "split": "train / val / test, assigned by a hash of sample_id",
    "seq_id": "id of the labelled sequence (one model pass)",
    "origin": "prefix origin, one of ORIGINS",
    "draw": "how the drafted token was drawn from q: greedy (argmax) or sample; greedy data may hold both per position",
    "rollout": "true when the labelled segment is the draft's own rollout (draft tokens follow one another)",
    "prefix_len": "tokens before this draft token (prompt included)",
    "offset": "index of this token in the labelled segment",
    "position": (
        "draft position: how many preceding tokens the draft itself produced in this run (0 = first drafted token)"
    ),
    "draft_token": "the drafted token x ~ q",
    "next_token": "the token that actually follows in the sequence (-1 at the end)",
    "q": "q(x), draft probability of the drafted token",
    "p": "p(x), target probability of the drafted token",
    "accept_prob": "min(1, p(x)/q(x))",
    "target_argmax": "argmax of the target distribution",
    "greedy_match": "draft_token == target_argmax",
    "tv": "total variation distance TV(p, q)",
    "draft_entropy": "H(q), natural log",
    "draft_max_prob": "max_v q(v)",
    "draft_topk": "top-k draft probabilities, descending",
    "draft_hidden": "draft last hidden state at the position that drafted x (float16), optional",
    "companion_prob": "c(x), optional",
    "companion_sim": "sum_v min(q(v), c(v)), optional",
    "companion_entropy": "H(c), optional",
    "companion_accept": "min(1, c(x)/q(x)), optional",
    "oracle_len": "consecutive greedy matches starting here along the draft's own rollout (the oracle draft length)",
    "oracle_censored": "true when the run of matches was cut by the end of the observed rollout, not by a mismatch",
}


def features_schema(top_k: int, hidden_size: int | None, companion: bool) -> datasets.Features:
    """Arrow schema of one shard for the given options."""
    f = {
        "sample_id": datasets.Value("string"),
        "source": datasets.Value("string"),
        "domain": datasets.Value("string"),
        "split": datasets.Value("string"),
        "seq_id": datasets.Value("string"),
        "origin": datasets.Value("string"),
        "draw": datasets.Value("string"),
        "rollout": datasets.Value("bool"),
        "prefix_len": datasets.Value("int32"),
        "offset": datasets.Value("int32"),
        "position": datasets.Value("int32"),
        "draft_token": datasets.Value("int32"),
        "next_token": datasets.Value("int32"),
        "q": datasets.Value("float32"),
        "p": datasets.Value("float32"),
        "accept_prob": datasets.Value("float32"),
        "target_argmax": datasets.Value("int32"),
        "greedy_match": datasets.Value("bool"),
        "tv": datasets.Value("float32"),
        "draft_entropy": datasets.Value("float32"),
        "draft_max_prob": datasets.Value("float32"),
        "draft_topk": datasets.Sequence(datasets.Value("float32"), length=top_k),
    }
    if hidden_size:
        f["draft_hidden"] = datasets.Sequence(datasets.Value("float16"), length=hidden_size)
    if companion:
        for c in ("companion_prob", "companion_sim", "companion_entropy", "companion_accept"):
            f[c] = datasets.Value("float32")
    f["oracle_len"] = datasets.Value("int32")
    f["oracle_censored"] = datasets.Value("bool")
    return datasets.Features(f)
