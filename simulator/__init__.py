"""A simulated SGLang server that follows the project's SGLang contract.

``expected_output`` is the simulated model: other packages' tests import it to recompute
exactly what a simulator returned for a prompt.
"""

from simulator.app import create_app
from simulator.config import SimConfig
from simulator.model import SimOutput, SpecialIds, expected_output

__all__ = ["SimConfig", "SimOutput", "SpecialIds", "create_app", "expected_output"]
