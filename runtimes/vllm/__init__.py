"""vLLM: a specstop policy per request inside vLLM's draft proposer (``proposer``, ``stopper``), vLLM's own curve per
batch size (``engine``, ``curve``), its K per batch size (``settings``), and its benchmark (``run``: ``bench``,
``check``, ``ties``, ``bench_report``; ``results`` stores and renders it). Needs ``bash scripts/setup.sh --vllm``."""
