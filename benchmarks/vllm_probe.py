"""What the vLLM probes in ``benchmarks/`` share (``bench_catch_up.py``, ``bench_vllm_proposer.py``): their prompts,
the options naming the pair and the prompts, and the prompts chat-templated for the target. Import it after
``runtimes.vllm.engine.prepare_env`` (it loads transformers)."""
from __future__ import annotations

import argparse

from transformers import AutoTokenizer

from runtimes.vllm.engine import hf_folder

TEXTS = ["Write a Python function that returns the n-th Fibonacci number.",
         "Explain what a hash map is in two sentences.", "def quicksort(xs):", "Write a haiku about the sea.",
         "Write a SQL query that counts the orders per customer.", "What does the Python GIL do?",
         "Write a bash loop that renames every .txt file to .md.", "Summarise what a B-tree is for."]


def add_pair_args(ap: argparse.ArgumentParser) -> None:
    """The pair, the prompts and their length, the concurrent requests and the conversion cache."""
    ap.add_argument("--target", default="packaged:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="packaged:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", type=int, default=4, help=f"how many of the {len(TEXTS)} prompts")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="concurrent requests")
    ap.add_argument("--cache_dir", default="~/.cache/specstop", help="where packaged models are converted")


def pair_and_prompts(args: argparse.Namespace) -> tuple[str, str, list[list[int]]]:
    """The target's and the draft's folders and the first ``args.prompts`` prompts as the target's chat token ids."""
    target, draft = hf_folder(args.target, args.cache_dir), hf_folder(args.draft, args.cache_dir)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in TEXTS[: args.prompts]]
    return target, draft, [p if isinstance(p, list) else p["input_ids"] for p in prompts]
