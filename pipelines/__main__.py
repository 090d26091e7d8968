"""``specstop``: one command for every entry point; ``specstop COMMAND [flags]`` runs ``python -m pipelines.COMMAND
[flags]`` (the same ``main``, the same flags and config files).

Usage:
    specstop train --config configs/smoke.yaml
    specstop benchmark --config configs/benchmark-smoke.yaml
    specstop results --check true
    specstop --help                                   # the commands
    python -m pipelines train --config configs/smoke.yaml   # the same, without the installed script
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": "labelled draft tokens: prompts, rollouts, one-pass labels, Parquet shards",
    "train": "the main job: generate, train, evaluate, cross-validate, recommend, register, print the table",
    "evaluate": "score stop policies on held-out labelled tokens (ROC / F1, replayed speedup, tuned thresholds)",
    "crossval": "cross-validate learned predictors against the training-free scores over folds of prompts",
    "calibrate": "fit the calibration maps of an export or a training-free score, for goodput: specs",
    "recommend": "each runtime's speculative settings tuned on a data folder under its measured curve",
    "measure_costs": "measure a pair's verification curve (specstop, llama.cpp, transformers or vLLM)",
    "benchmark": "end-to-end decoding: target-only, transformers assisted generation, every stop policy",
    "replay_check": "replay a finished benchmark's rows offline and set predicted beside measured tokens/s",
    "llamacpp_bench": "llama.cpp's speculative decoding with specstop's stop policies",
    "vllm_bench": "vLLM's draft-model speculation with specstop's stop policies",
    "results": "render the README's and docs' tables from the stored run summaries (--check compares)",
}
"""Command -> what it does; each is the module ``pipelines.<command>`` (a hyphen may stand for the underscore)."""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    return "\n".join(["usage: specstop COMMAND [flags]   (specstop COMMAND --help: its flags)", "", "commands:",
                      *lines])


def main(argv: list[str] | None = None) -> int:
    """Run ``pipelines.<command>.main`` on the remaining flags; returns the exit code (the command's own, where it
    returns one, else 0)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name = args[0].replace("-", "_")
    if name not in COMMANDS:
        print(f"specstop: error: unknown command {args[0]!r}; use one of {', '.join(COMMANDS)} (specstop --help)",
              file=sys.stderr)
        return 2
    code = importlib.import_module(f"pipelines.{name}").main(args[1:])
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
