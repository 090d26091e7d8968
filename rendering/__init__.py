"""Result rendering: small summaries of finished runs (``result_store``), kept in ``results/``, and the Markdown the
README and docs/results.md are rendered from (``result_tables``, ``result_runtimes``); the main job's own table
(``train_results``). Its entry point: ``python -m pipelines.results``.
"""
