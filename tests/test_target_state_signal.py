"""``benchmarks/target_state_signal.py``: greedy rounds walked along a target's output, and the grouped AUC."""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from target_state_signal import draft_rounds, grouped_auc, main  # noqa: E402

from decoding.policies import build_policy  # noqa: E402


def greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out


def test_rounds_accept_the_draft_s_own_output_whole_and_stop_at_a_rejection(tiny_pair) -> None:
    draft, target, _ = tiny_pair
    prompt = [5, 17, 42, 9]
    own = greedy(draft, prompt, 15)  # the draft's own greedy text: every drafted token equals it
    rows, starts = draft_rounds(draft, build_policy("svip"), own, len(prompt), cap=4)
    assert all(ok for _, _, ok, _ in rows)
    assert starts == [4, 9, 14]  # each round takes its 4 and the next token is the round's first (the "target's")
    assert [p for p, _, _, _ in rows][:5] == [1, 2, 3, 4, 1]
    other = greedy(target, prompt, 15)
    rows, starts = draft_rounds(draft, build_policy("svip"), other, len(prompt), cap=4)
    for r in range(len(starts)):  # a round's rows: its accepted run, then at most its first rejection
        oks = [ok for _, _, ok, rr in rows if rr == r]
        assert oks == sorted(oks, reverse=True) and oks.count(False) <= 1
        nxt = starts[r + 1] if r + 1 < len(starts) else None
        assert nxt is None or nxt == starts[r] + oks.count(True) + 1


def test_a_state_that_carries_the_label_raises_the_grouped_auc() -> None:
    rng = np.random.default_rng(0)
    n_rounds, per = 400, 3
    hidden = rng.normal(size=n_rounds)
    # the label's factor loads on half the state's dimensions, so it is the state's first principal component
    states = np.column_stack([hidden[:, None] + 0.3 * rng.normal(size=(n_rounds, 8)),
                              rng.normal(size=(n_rounds, 8))]).astype(np.float32)
    rounds = np.repeat(np.arange(n_rounds), per)
    y = (hidden[rounds] + 0.3 * rng.normal(size=len(rounds)) > 0).astype(int)
    x = rng.normal(size=(len(y), 2))  # the score: no signal
    groups = rounds // 10
    from sklearn.metrics import roc_auc_score

    without = roc_auc_score(y, grouped_auc(x, y, groups))
    with_state = roc_auc_score(y, grouped_auc(x, y, groups, states, rounds, k=4, c=1.0))
    assert without < 0.6 and with_state > 0.85  # out of fold, a signal-free model scores about 0.5 or below


def test_bad_input_is_one_line(tmp_path, capsys) -> None:
    assert main(["no-such-policy", "--rows", str(tmp_path / "r.npz")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("target_state_signal: ") and err.count("\n") == 1
    assert main(["svip", "--prompts", "2"]) == 1
    assert "four prompts at least" in capsys.readouterr().err
