"""A simulated SGLang server that follows the project's SGLang contract.

``expected_output`` is the simulated model: other packages' tests import it to recompute
exactly what a simulator returned for a prompt; with ``tool_call_format`` set, pass it
``tool_call_ids=tool_call_ids_for(...)`` (``tool_call_plan`` says which call that is).
"""

from simulator.app import create_app
from simulator.config import SimConfig
from simulator.model import SimOutput, SpecialIds, expected_output, tool_call_ids_for, tool_call_plan

__all__ = [
    "SimConfig",
    "SimOutput",
    "SpecialIds",
    "create_app",
    "expected_output",
    "tool_call_ids_for",
    "tool_call_plan",
]
