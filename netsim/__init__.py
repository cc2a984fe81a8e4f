"""Network-topology cost model for MoE LLM serving (pure Python: numpy / scipy; no torch).

After "Rethinking Network Topologies for Cost-Effective MoE LLM Serving" (§2-4): alpha-beta
collective models per topology (:mod:`netsim.collectives`) and their fit to measurements
(:mod:`netsim.fit`), profile-table compute times (:mod:`netsim.compute`), the decode serving model
with dual-batch overlap and speculative decoding (:mod:`netsim.serving`, :mod:`netsim.schedule`),
cluster cost (:mod:`netsim.cost`), and the sweep with its analyses and plots (:mod:`netsim.sweep`,
:mod:`netsim.plots`). Command line: ``python -m netsim --help``; method: docs/design/netsim.md.
"""

from .collectives import (
    DGX_H100_INTER,
    DGX_H100_INTRA,
    AlphaBeta,
    Collective,
    Network,
    Topology,
    algorithms,
    best_algorithm,
    collective_time,
)
from .compute import ProfileTable, default_table, load_table, project_table, roofline_table
from .cost import CostConfig, cluster_cost, normalized_cost_per_xpu
from .fit import fit_constants, read_csv, read_nccl_tests
from .model import DEEPSEEK_V3, ModelShape
from .serving import Optimization, ServingConfig, SpecDecode, Variant, best_under_slo, evaluate_cases
from .sweep import SweepConfig, run_sweep

__all__ = [
    "AlphaBeta", "Collective", "Network", "Topology", "DGX_H100_INTRA", "DGX_H100_INTER",
    "algorithms", "best_algorithm", "collective_time",
    "ProfileTable", "default_table", "load_table", "project_table", "roofline_table",
    "CostConfig", "cluster_cost", "normalized_cost_per_xpu",
    "fit_constants", "read_csv", "read_nccl_tests",
    "DEEPSEEK_V3", "ModelShape",
    "Optimization", "ServingConfig", "SpecDecode", "Variant", "best_under_slo", "evaluate_cases",
    "SweepConfig", "run_sweep",
]  # fmt: skip
