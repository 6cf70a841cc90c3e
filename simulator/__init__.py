"""A simulated SGLang server that follows the project's SGLang contract (or vLLM's, with ``api="vllm"``).

``expected_output`` is the simulated model: other packages' tests import it to recompute
exactly what a simulator returned for a prompt; with ``tool_call_format`` set, pass it
``tool_call_ids=tool_call_ids_for(...)`` (``tool_call_plan`` says which call that is).
``vllm_expected_output`` is the same model under vLLM's finish rule, for a simulator speaking vLLM.

One scheduler, model and config are shared; ``simulator.sglang`` and ``simulator.vllm`` each own one
contract and never import each other, so neither can pass for the other by accident.
"""

from simulator.app import create_app
from simulator.config import SimApi, SimConfig
from simulator.model import SimOutput, SpecialIds, expected_output, tool_call_ids_for, tool_call_plan
from simulator.vllm import VllmOutput, vllm_expected_output

__all__ = [
    "SimApi",
    "SimConfig",
    "SimOutput",
    "SpecialIds",
    "VllmOutput",
    "create_app",
    "expected_output",
    "tool_call_ids_for",
    "tool_call_plan",
    "vllm_expected_output",
]
