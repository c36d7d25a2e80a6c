"""Prequential MDL: block schedules, code lengths, the driver, run records and the report."""

from mdl.codelength import online_codelength, paper_mdl, uniform_codelength
from mdl.schedule import block_boundaries

__all__ = ["block_boundaries", "online_codelength", "paper_mdl", "uniform_codelength"]
