"""The simulator speaking vLLM's OpenAI-compatible HTTP contract (``SimConfig(api="vllm")``).

Everything vLLM-shaped lives here, apart from the shared engine and model, so that it cannot lean
on the SGLang front end: ``/v1/completions`` and its checks, vLLM's finish rule, error bodies and
metric names.
"""

from simulator.vllm._protocol import VllmOutput, vllm_expected_output
from simulator.vllm.app import VLLM_VERSION, create_vllm_app

__all__ = ["VLLM_VERSION", "VllmOutput", "create_vllm_app", "vllm_expected_output"]
