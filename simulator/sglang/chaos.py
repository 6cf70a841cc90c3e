"""Faults switched on and off while a simulator runs, for fault-injection tests and benchmarks.

Not part of SGLang: ``POST /_sim/chaos`` exists only on the simulator (the ``/_sim`` prefix says
so). Rates of random faults are fixed in :class:`simulator.config.SimConfig`; these are the
faults a test needs to start and stop at a moment of its choosing.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Chaos"]


class Chaos(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # /health and /health_generate wait this long before answering (SGLang's probe runs a
    # one-token generation and is slow under load).
    health_delay_s: float = Field(default=0.0, ge=0.0, le=3600.0)
    # Answer /health with this status (503: starting or unhealthy); None: the normal answer.
    health_status: int | None = Field(default=None, ge=200, le=599)
    # /generate requests accept and never answer (a wedged server).
    hang_generate: bool = False
    # /server_info and /v1/models do not say the context length (a server behind a proxy that
    # strips them, or an old one): the context length is unknown.
    hide_context_len: bool = False
