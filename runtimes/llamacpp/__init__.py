"""llama.cpp through llama-cpp-python: loading a GGUF pair and llama.cpp's own curve (``llama``), a specstop policy as
its draft model (``draft``), a GGUF model as the labeller's causal LM (``causal_lm``), and its benchmark (``measure``,
``replay_check``). Needs ``bash scripts/setup.sh --llamacpp``."""
