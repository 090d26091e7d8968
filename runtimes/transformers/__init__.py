"""transformers: a specstop policy inside ``generate``'s assisted generation (``assisted``) and transformers' own curve
(``curve``); its benchmark rows run in the engine benchmark (``configs/benchmark-transformers.yaml``)."""
