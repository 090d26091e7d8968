"""transformers: a specstop policy inside ``generate``'s assisted generation (``assisted``) and transformers' own curve
(``costs``); its benchmark rows run in the engine benchmark (``configs/benchmark-transformers.yaml``)."""
