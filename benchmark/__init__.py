"""The end-to-end decoding benchmark, one concern per module (its entry point: ``python -m pipelines.benchmark``).

From the config down: ``config`` (what a run does) -> ``run`` (a run from start to end) -> ``plan`` (which rows, in
what order; ``resume`` beside it) -> ``runners`` (one row on the prompts of a ``bench``; ``tuning`` picks
the tuned rows' thresholds) -> ``rows`` (a row's counters and entry) -> ``report`` (tables; ``plots``) and ``tracking``
(MLflow); ``curve`` holds the run's verification curve. The replay check, which the run ends with and
``python -m pipelines.replay_check`` runs alone: ``check_inputs`` (what it is asked, the finished folder) ->
``check_records`` (the labelled prompts) -> ``check`` (replay against measurement) -> ``check_report``. The runtimes'
own benchmarks (``runtimes.llamacpp.measure``, ``runtimes.vllm.run``) use this harness from their folders.

Nothing is imported here, so ``import benchmark.config`` loads no model code.
"""
