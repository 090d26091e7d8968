"""Results rendered from stored run summaries: the README and docs/results.md agree with results/, a malformed or
missing summary is named with its field, and runs of another pair or compute path get their own tables."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines import results as results_cli
from rendering.result_store import SCHEMA, SummaryError, cpu_label, load_summaries, summary_name, write_summary
from rendering.result_tables import fill, render_docs, render_readme

ROOT = Path(__file__).resolve().parents[1]
MACHINE = {"model_name": "AMD EPYC", "simd_flags": ["avx2", "avx512_bf16", "avx512f"], "torch": "2.13.0+cpu",
           "threads": 2, "vendor": "AuthenticAMD", "family": "25", "model": "17"}


def bench_summary(**over) -> dict:
    rows = [
        {"row": "target-only", "kind": "", "tokens_per_s": 6.0, "speedup": 1.0, "speedup_lo": 1.0, "speedup_hi": 1.0},
        {"row": "svip (val-tuned 0.35)", "kind": "svip", "tokens_per_s": 9.0, "speedup": 1.5, "speedup_lo": 1.4,
         "speedup_hi": 1.6, "vs_best_entropy": 1.0, "vs_best_entropy_lo": 1.0, "vs_best_entropy_hi": 1.0,
         "exact": True, "identical_prompts": 4},
        {"row": "disco (val-tuned 0.4)", "kind": "disco", "tokens_per_s": 9.1, "speedup": 1.52, "speedup_lo": 1.41,
         "speedup_hi": 1.63, "vs_best_entropy": 1.01, "vs_best_entropy_lo": 0.98, "vs_best_entropy_hi": 1.04,
         "exact": True, "identical_prompts": 4},
    ]
    base = {"schema": SCHEMA, "kind": "benchmark", "config": "benchmark-full", "command": "python -m x", "date":
            "2026-11-25", "machine": MACHINE, "pair": {"draft": "d", "target": "t"}, "compute_path": "packed-bf16",
            "rows": rows, "n_prompts": 4, "max_new_tokens": 128, "temperature": 0.0}
    return {**base, **over}


def main_summary(**over) -> dict:
    preds = [{"predictor": "disco", "label": "greedy match", "test_auc": 0.80, "best_free": "max-prob",
              "test_auc_best_free": 0.79, "cv_diff": 0.002, "cv_diff_lo": 0.001, "cv_diff_hi": 0.003,
              "test_speedup": 1.6}]
    base = {"schema": SCHEMA, "kind": "main_job", "config": "default", "command": "python -m y", "date": "2026-11-25",
            "machine": MACHINE, "pair": {"draft": "d", "target": "t"}, "compute_path": "packed-bf16",
            "predictors": preds, "records": 20000}
    return {**base, **over}


def test_readme_and_docs_match_the_stored_results():
    """What CI checks: python -m pipelines.results --check true on the repository exits 0."""
    assert results_cli.main(["--check", "true", "--root", str(ROOT)]) == 0


def test_render_then_check_round_trip(tmp_path):
    (tmp_path / "docs").mkdir()
    for name, rel in results_cli.DOCUMENTS.items():
        (tmp_path / rel).write_text(f"# doc\n<!-- results:{name} -->\nold\n<!-- /results:{name} -->\ntail\n")
    write_summary(bench_summary(), tmp_path / "results")
    write_summary(main_summary(), tmp_path / "results")
    assert results_cli.main(["--check", "true", "--root", str(tmp_path)]) == 1
    assert results_cli.main(["--root", str(tmp_path)]) == 0
    assert results_cli.main(["--check", "true", "--root", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "1.01x [0.98, 1.04]" in readme and "interval holds 1" in readme and readme.endswith("tail\n")
    assert "AMD EPYC (Zen 4, AVX-512 BF16)" in readme
    assert "+0.0020 [+0.0010, +0.0030]" in readme


def test_summaries_elsewhere_never_render_the_documents(tmp_path):
    """Storing into a scratch folder leaves the README and docs as results/ renders them."""
    (tmp_path / "docs").mkdir()
    for name, rel in results_cli.DOCUMENTS.items():
        (tmp_path / rel).write_text(f"# doc\n<!-- results:{name} -->\nold\n<!-- /results:{name} -->\ntail\n")
    write_summary(bench_summary(), tmp_path / "scratch")
    before = {rel: (tmp_path / rel).read_text() for rel in results_cli.DOCUMENTS.values()}
    assert results_cli.main(["--root", str(tmp_path), "--results_dir", "scratch"]) == 0
    assert {rel: (tmp_path / rel).read_text() for rel in results_cli.DOCUMENTS.values()} == before


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("rows"), "'rows' missing"),
    (lambda d: d.update(schema="x"), "field 'schema'"),
    (lambda d: d["pair"].pop("target"), "'pair.target' missing"),
    (lambda d: d["rows"][1].pop("tokens_per_s"), "'tokens_per_s' missing in entry 1"),
])
def test_malformed_summary_names_file_and_field(tmp_path, mutate, field):
    data = bench_summary(pair={"draft": "d", "target": "t"})
    data["rows"] = [dict(r) for r in data["rows"]]
    mutate(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(SummaryError, match=field) as e:
        load_summaries(tmp_path)
    assert "bad.json" in str(e.value)


def test_unreadable_and_missing(tmp_path, capsys):
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SummaryError, match="broken.json: not valid JSON"):
        load_summaries(tmp_path)
    with pytest.raises(SystemExit):
        results_cli.main(["--results_dir", "nope", "--root", str(tmp_path)])
    assert "no such results folder" in capsys.readouterr().err


def test_another_pair_or_path_gets_its_own_group():
    from rendering.result_store import Summary

    a = Summary(Path("a.json"), bench_summary())
    b = Summary(Path("b.json"), bench_summary(compute_path="packed"))
    c = Summary(Path("c.json"), bench_summary(pair={"draft": "x", "target": "y"}))
    text = render_docs([a, b, c])
    assert text.count("### ") == 3 and "`packed`" in text and "x -> y" in text
    assert "vs target-only" in render_readme([a, b, c])


def test_a_headline_runs_replay_check_is_rendered_beside_its_table():
    from rendering.result_store import Summary

    replay = {"replay_rows": [{"row": "disco (val-tuned 0.4)", "measured_tokens_per_s": 9.1,
                               "predicted_tokens_per_s": 9.5, "ratio": 1.044}],
              "replay_check": {"worst_row": "disco (val-tuned 0.4)", "worst_error": 0.044, "within_band": 1,
                               "rows_scored": 1, "band": 0.1}}
    text = render_docs([Summary(Path("a.json"), bench_summary(**replay))])
    assert "| `disco (val-tuned 0.4)` | 9.10 | 9.50 | 1.044 |" in text and "1 of 1 rows within 10%" in text
    assert "The replay against" not in render_docs([Summary(Path("a.json"), bench_summary())])


def test_summary_name_and_fill_errors(tmp_path):
    assert summary_name(bench_summary()) == "benchmark-benchmark-full-zen-4-avx-512-bf16-2026-11-25.json"
    xeon = {**bench_summary(), "machine": {"model_name": "Intel(R) Xeon(R) Processor", "vendor": "GenuineIntel",
                                           "family": "6", "model": "207", "simd_flags": ["avx512_bf16", "amx_bf16"]}}
    assert summary_name(xeon) == "benchmark-benchmark-full-emerald-rapids-amx-bf16-2026-11-25.json"
    assert cpu_label(xeon["machine"]) == "Intel Xeon Processor (Emerald Rapids, AMX-BF16)"
    with pytest.raises(ValueError, match="no <!-- results:readme -->"):
        fill("no markers", "readme", "x", tmp_path / "README.md")


def test_readme_and_docs_links_resolve():
    """Every relative link of the README and docs/ names a file of the repository."""
    import re

    docs = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for doc in docs:
        for m in re.finditer(r"\]\(([^)#\s]+)(#[^)]*)?\)", doc.read_text()):
            target = m.group(1)
            if not target.startswith(("http://", "https://")) and not (doc.parent / target).exists():
                broken.append(f"{doc.name}: {target}")
    assert not broken, broken
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_a_runtime_benchmark_renders_its_comparisons_and_replay_check():
    from rendering.result_runtimes import runtime_block
    from rendering.result_store import Summary

    rows = [{"row": "llama.cpp target-only", "tokens_per_s": 20.0, "speedup": 1.0},
            {"row": "llamacpp:3,0,0.0 (default)", "tokens_per_s": 13.0, "speedup": 0.65, "speedup_lo": 0.6,
             "speedup_hi": 0.7, "mean_accepted": 1.8, "mean_drafted": 2.9, "identical_prompts": 3},
            {"row": "goodput:adaedl", "tokens_per_s": 20.2, "speedup": 1.01, "speedup_lo": 0.99, "speedup_hi": 1.03,
             "mean_accepted": 0.0, "mean_drafted": 0.0, "identical_prompts": 4}]
    data = bench_summary(config="benchmark-llamacpp", compute_path="llamacpp", rows=rows,
                         recommended="llama.cpp target-only", recommendation=["llamacpp: do not speculate"],
                         comparisons=[{"row": "llama.cpp target-only (recommended)",
                                       "against": "llamacpp:3,0,0.0 (default)", "ratio": 1.54, "lo": 1.5, "hi": 1.6}],
                         replay_rows=[{"row": "goodput:adaedl", "measured_tokens_per_s": 20.2,
                                       "predicted_tokens_per_s": 20.0, "ratio": 0.99}],
                         replay_check={"worst_row": "goodput:adaedl", "worst_error": 0.01, "within_band": 1,
                                       "rows_scored": 1, "band": 0.1})
    text = runtime_block([Summary(Path("x.json"), data)], "benchmark-llamacpp")
    assert "`llama.cpp target-only (recommended)` | 20.00" in text and "drafts nothing" in text
    assert "against `llamacpp:3,0,0.0 (default)`: 1.54x [1.50, 1.60]" in text
    assert "| `goodput:adaedl` | 20.20 | 20.00 | 0.990 |" in text and "1 of 1 rows within 10%" in text
    assert "do not speculate" in text and "3/4" in text and "The run's curve" not in text  # stored without it
    assert "No stored run yet" in runtime_block([], "benchmark-transformers")
    data["curve"] = {"draft_ms": 21.9, "catchup_ms": 13.1, "target_ms_L1": 36.5, "target_ms_L2": 65.5}
    text = runtime_block([Summary(Path("x.json"), data)], "benchmark-llamacpp")
    assert "one new token 36.5 ms, of two 65.5 ms; a draft step 21.9 ms" in text and "13.1 ms more" in text


def test_a_summary_reads_the_runs_curve(tmp_path):
    from rendering.result_store import curve_facts

    cm = tmp_path / "cost_model.llamacpp.json"
    cm.write_text(json.dumps({"draft_s_per_token": 0.022, "draft_catchup_s": 0.013,
                              "target_s": {"1": 0.0365, "2": 0.0655, "4": 0.098}}))
    assert curve_facts(cm) == {"draft_ms": 22.0, "catchup_ms": 13.0, "target_ms_L1": 36.5, "target_ms_L2": 65.5}
    cm.write_text(json.dumps({"draft_s_per_token": 0.022, "target_s": {"1": 0.0365, "2": 0.0655}}))  # no catch-up
    assert curve_facts(cm)["catchup_ms"] == 0.0 and curve_facts(tmp_path / "none.json") is None


def test_a_sampled_headline_renders_beside_the_greedy_one_with_its_quality_columns(tmp_path):
    from rendering.result_store import load_summaries

    sampled = bench_summary(config="benchmark-full-t1", temperature=1.0, date="2026-11-26")
    for r in sampled["rows"]:
        r.update(mean_accepted=2.5, humaneval_pass=0.5, rouge_l=0.31)
    write_summary(bench_summary(), tmp_path)
    only_greedy = render_readme(load_summaries(tmp_path))
    assert "configs/benchmark-full-t1.yaml --results_dir results" in only_greedy
    write_summary(sampled, tmp_path)
    both = render_readme(load_summaries(tmp_path))
    assert "sampling at temperature 1.0" in both and "| 2.50 | 50% | 0.310 |" in both
    assert "greedy" in both and both.count("interval holds 1") == 2 and "no headline run is stored" not in both


def test_a_sampled_verdict_leaves_out_sprinter_and_weighs_its_rouge_against_the_exact_rows():
    """Under sampling no row has a greedy exactness check: SPRINTER (sequential verification) is still approximate,
    so the verdict does not pick it even when fastest; the quality sentence reads its ROUGE-L against the exact rows'
    range (two samples of the target's distribution)."""
    from rendering.result_store import Summary
    from rendering.result_tables import sampled_quality, verdict

    data = bench_summary(config="benchmark-full-t1", temperature=1.0)
    for r in data["rows"]:
        r.pop("exact", None)
        r.update(rouge_l=None if r["row"] == "target-only" else 0.36, humaneval_pass=0.0625)
    data["rows"].append({"row": "sprinter (val-tuned 0.5)", "kind": "sprinter", "verification": "sequential",
                         "tokens_per_s": 9.9, "speedup": 1.65, "vs_best_entropy": 1.1, "vs_best_entropy_lo": 1.05,
                         "vs_best_entropy_hi": 1.15, "rouge_l": 0.37, "humaneval_pass": 0.125})
    s = Summary(Path("x.json"), data)
    assert verdict(s).startswith("The best exact learned stopper (disco (val-tuned 0.4)) ran 1.01x")
    text = sampled_quality(s)
    assert "0.360-0.360 for the exact rows" in text and "0.370 for sprinter (val-tuned 0.5), outside that range" in text
    assert "6% of target-only's answers and 6%-12% of the other rows'" in text
    assert sampled_quality(Summary(Path("g.json"), bench_summary())) == ""  # greedy: identical outputs say it


def test_the_verdict_names_the_fastest_entropy_bound_when_two_round_to_one() -> None:
    """The rows' ratios are to the fastest entropy bound; another within rounding of it is not the reference."""
    from rendering.result_store import Summary
    from rendering.result_tables import verdict

    data = bench_summary()
    bounds = [r for r in data["rows"] if r.get("kind") in ("svip", "adaedl")]
    assert len(bounds) >= 1
    twin = {**bounds[0], "row": "adaedl:0.6 (val-tuned)", "kind": "adaedl", "vs_best_entropy": 1.0,
            "tokens_per_s": bounds[0]["tokens_per_s"] - 0.01}  # 0.999x the fastest: shown as 1.00x
    data["rows"].insert(1, twin)
    assert f"the best entropy bound ({bounds[0]['row']})" in verdict(Summary(Path("x.json"), data))
