"""The simulator speaking SGLang's HTTP contract (``SimConfig(api="sglang")``, the default).

Everything SGLang-shaped lives here, apart from the shared engine and model, so that the vLLM front
end cannot lean on it: ``/generate`` and its checks, the fault and warmup options, ``/_sim/chaos``,
``/parse_function_call`` and SGLang's metric names.
"""

from simulator.sglang.app import SGLANG_VERSION, create_sglang_app

__all__ = ["SGLANG_VERSION", "create_sglang_app"]
