"""The runtimes specstop plugs a stopper into, a folder each: its hook, its own curve, the settings the recommendation
prints for it, and its benchmark (``runtimes.vllm``, ``runtimes.llamacpp``, ``runtimes.transformers``)."""
