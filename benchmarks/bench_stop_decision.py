"""What one stop decision costs inside the engine, split into its features and its policy, beside a draft step.

A stop decision runs once per drafted token right after a draft forward that streamed the draft's weights through the
caches, so its small ops cost several times their warm cost: this measures it where it runs. For each policy spec the
engine decodes one prompt (a warm-up of 16 tokens, then ``--repeats`` runs of ``--new_tokens``) on the real pair and
prints, per decision, the stop time (``DecodeStats.stop_time``), the part spent in the features (``token_features``
and, greedy, ``greedy_draft_stats``: the statistics with the drafted token's argmax) and the rest
(inputs, network, calibration, the rule), and the decision as a share of one draft forward (the benchmark's
``stop_overhead`` column, here with the split). The policies take turns run by run (a load that drifts during the
run reaches each alike), and a last table gives each policy's medians over its runs with its policy part as a ratio
to the first row's. ``--compare_paths`` adds, for each policy that scores through a native call where it applies
(``native``, e.g. DISCO), a row scoring through its torch module instead: what the native call saves per decision.

Usage:
    python benchmarks/bench_stop_decision.py outputs/default/train/disco/export svip outputs/default/train/sv/export
    python benchmarks/bench_stop_decision.py outputs/default/train/disco/export --compare_paths --repeats 5
    python benchmarks/bench_stop_decision.py goodput:outputs/default/train/disco/export --cost_file \
        outputs/benchmark/cost_model.json
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import decoding.engine as engine
from compute.models import load_model, share_truncated_layers
from compute.timing import CostModel
from data_gen.config import ModelsConfig
from decoding.engine import SpeculativeDecoder
from decoding.policies import build_policy
from predictors.base import StopPolicy

PROMPT = "Write a Python function that merges two sorted lists into one sorted list, with a docstring and tests."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policies", nargs="+", help="policy specs (export folders, goodput:<spec>, svip, static:5, ...)")
    ap.add_argument("--draft", default="packaged:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--target", default="packaged:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--companion", default="truncated:12:packaged:qwen2.5-coder-0.5b-instruct",
                    help="companion for policies that read one (SV); shares the draft's layers as load_models does")
    ap.add_argument("--cost_file", default=None, help="a cost model for goodput policies (else measured on the fly)")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compare_paths", action="store_true",
                    help="also time each native-scoring policy (DISCO) through its torch module")
    args = ap.parse_args()

    models = ModelsConfig()  # the precision the pipelines load each role with
    draft, tok = load_model(models.spec(args.draft, "draft"))
    target, _ = load_model(models.spec(args.target, "target"))
    companion, _ = load_model(models.spec(args.companion, "companion"))
    share_truncated_layers(companion, draft)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    cost = CostModel.from_json(args.cost_file) if args.cost_file else None
    spent = {"features": 0.0}

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent["features"] += time.perf_counter() - t0
            return out
        return run

    # the features: the greedy step's native statistics (with the drafted token's argmax) and token_features
    engine.token_features = timed(engine.token_features)
    engine.greedy_draft_stats = timed(engine.greedy_draft_stats)
    decoders = {}
    for label, policy in policy_rows(args.policies, args.compare_paths):
        decoders[label] = SpeculativeDecoder(draft, target, policy, max_draft_len=16, companion=companion,
                                             cost_model=cost)
        decoders[label].generate(ids, max_new_tokens=16)  # warm-up
    runs: dict[str, list[tuple[float, float, float, float, float]]] = {label: [] for label in decoders}
    print("| policy | tokens/s | stop decision, ms | features, ms | policy, ms | draft step, ms | share of a step |")
    print("|---|---|---|---|---|---|---|")
    for _ in range(args.repeats):
        for label, dec in decoders.items():
            spent["features"] = 0.0
            _, st = dec.generate(ids, max_new_tokens=args.new_tokens)
            n = max(st.stop_decisions, 1)
            stop, feat = 1e3 * st.stop_time / n, 1e3 * spent["features"] / n
            step = 1e3 * st.draft_time / max(st.draft_forwards, 1)
            runs[label].append((st.tokens_per_s, stop, feat, stop - feat, step))
            print(f"| {label} | {st.tokens_per_s:.2f} | {stop:.3f} | {feat:.3f} | {stop - feat:.3f} | {step:.1f} | "
                  f"{st.stop_overhead:.1%} |")
    print_medians(runs)


def policy_rows(specs: list[str], compare_paths: bool) -> list[tuple[str, StopPolicy]]:
    """(row label, policy) for each spec; with ``compare_paths`` a second row for a policy with a native call
    (``native``) scoring through its torch module."""
    rows: list[tuple[str, StopPolicy]] = []
    for spec in specs:
        rows.append((spec, build_policy(spec, max_draft_len=16)))
        if compare_paths and hasattr(rows[-1][1], "native"):
            module_path = build_policy(spec, max_draft_len=16)
            module_path.native = False  # type: ignore[attr-defined]
            rows.append((f"{spec} (module forward)", module_path))
    return rows


def print_medians(runs: dict[str, list[tuple[float, float, float, float, float]]]) -> None:
    """Each policy's medians over its runs; its policy part (stop decision less features) over the first row's."""
    print("\n| policy (median of runs) | tokens/s | stop decision, ms | features, ms | policy, ms | "
          "policy vs first row |")
    print("|---|---|---|---|---|---|")
    medians = {label: [statistics.median(col) for col in zip(*rows)] for label, rows in runs.items()}
    first = next(iter(medians.values()))[3]
    for label, (tps, stop, feat, pol, _) in medians.items():
        print(f"| {label} | {tps:.2f} | {stop:.3f} | {feat:.3f} | {pol:.3f} | {pol / first:.2f}x |")


if __name__ == "__main__":
    main()
