"""The seam between the worker and an inference server: :class:`Engine`, and the replies every
engine gives in one shape.

Everything above it (generation, routing, health, the KV controller, pause and drain) talks to a
server through these methods only, and never asks which engine answered. Two implement it:
:class:`workers.engines.sglang.SGLangClient` (SGLang's native ``/generate``) and
:class:`workers.engines.vllm.VllmClient` (vLLM's ``/v1/completions`` with token ids);
:mod:`workers.engines.detect` picks one per server.

Pause and drain need no hook of their own: a paused or draining worker sends nothing new, and a
request it gives up is aborted by closing its connection, which both engines honour (SGLang polls
for it, vLLM cancels at once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from datagen.states import EngineChoice
from workers.engines.sglang_replies import Finish, GenerateResult, ParsedCalls
from workers.fleet.kv_policy import KvSignals

__all__ = ["Engine", "EngineChoice", "Finish", "GenerateResult", "ParsedCalls", "ServerFacts"]


@dataclass(frozen=True)
class ServerFacts:
    """What a server says about itself when it comes up: read once, checked, then published.

    ``context_len`` is None when the server does not say (the worker then keeps off it).
    """

    context_len: int | None
    model_path: str | None
    weight_version: str | None


class Engine(Protocol):
    """One server behind one engine's HTTP API, with long-lived connection pools.

    Errors are the project's (:mod:`datagen.errors`), translated inside the implementation:
    a request that cannot succeed is a ``FatalError`` carrying the server's own message,
    anything worth retrying a ``RetryableError``.
    """

    name: str
    base_url: str

    @property
    def engine(self) -> EngineChoice:
        """What the client speaks (``auto`` only while :mod:`workers.engines.detect` has not asked)."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, object],
        *,
        rid: str,
        read_timeout_s: float | None = None,
    ) -> GenerateResult:
        """Exactly these prompt ids in, the generated ids out (ending with the EOS or stop id when
        the finish is ``stop``). ``sampling_params`` use SGLang's names, the project's vocabulary
        (:class:`datagen.spec.SamplingParams`), with ``max_new_tokens`` always set."""
        ...

    async def health(self, *, timeout_s: float) -> bool:
        """True only when the server says it is ready; timeouts and refused connections raise."""
        ...

    async def facts(self) -> ServerFacts:
        """Context length and model, read when the server comes up (again)."""
        ...

    async def kv_signals(self, *, timeout_s: float) -> KvSignals:
        """The KV controller's inputs from the server's Prometheus metrics."""
        ...

    async def parse_function_call(
        self, text: str, parser: str, tools: Sequence[Mapping[str, object]], *, timeout_s: float
    ) -> ParsedCalls: ...
