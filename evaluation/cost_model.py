"""Moved to ``data_gen.timing`` (one timing model for the generator, the replay, SV and the benchmark)."""
from data_gen.timing import CostModel, assumed_cost_model, measure_cost_model

__all__ = ["CostModel", "measure_cost_model", "assumed_cost_model"]
