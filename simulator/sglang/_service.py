"""One simulated SGLang server: turns validated ``/generate`` calls into engine requests and answers.

The HTTP layer (``simulator.sglang.app``) stays thin; this module owns the flow SGLang's tokenizer
manager has: normalize, claim rids, validate each prompt, dispatch, wait, build the body.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request

from simulator.config import SimConfig
from simulator.frontend import Frontend
from simulator.model import FinishType, SimOutput, apply_stop_token_ids, expected_output
from simulator.scheduler import OOM_MESSAGE, Outcome, SimRequest
from simulator.sglang._faults import QUEUE_FULL_MESSAGE, Fault, FaultPlanner
from simulator.sglang._protocol import (
    GenerateReqInput,
    NormalizedRequest,
    RequestError,
    SamplingParams,
    normalize_request,
    validate_prompt,
)
from simulator.sglang.chaos import Chaos
from simulator.sglang.metrics import SimMetrics

__all__ = ["REQUEST_STATE_WAIT_TIMEOUT_S", "SimServer"]

# SGLang polls for client disconnects this often (SGLANG_REQUEST_STATE_WAIT_TIMEOUT).
REQUEST_STATE_WAIT_TIMEOUT_S = 4.0
# Used by SGLang when max_new_tokens is null: "until the context is full".
_UNBOUNDED_NEW_TOKENS = 1 << 30
_INTERNAL_ABORT_MESSAGE = "Internal server error while scheduling the request (simulated fault)."


@dataclass(frozen=True)
class _Planned:
    req: SimRequest
    params: SamplingParams
    input_ids: list[int]


class SimServer(Frontend[SimMetrics]):
    """The shared front end plus SGLang's own state: faults, the warmup window and chaos."""

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config, SimMetrics(config.served_model_name))
        self._faults = FaultPlanner(config)
        self._ready_at = 0.0
        self.chaos = Chaos()

    async def start(self) -> None:
        await super().start()
        self._ready_at = time.monotonic() + self.config.starting_s

    @property
    def is_ready(self) -> bool:
        """False during the simulated warmup, when SGLang's /health answers 503."""
        return time.monotonic() >= self._ready_at

    # -- /generate -------------------------------------------------------------------------

    async def generate(
        self, obj: GenerateReqInput, request: Request
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Raises ``RequestError`` (400), ``ServerBug`` (500 text) or ``HTTPException``."""
        if self.chaos.hang_generate:
            await asyncio.Event().wait()  # until the server shuts down
        norm = normalize_request(obj, tokenize=self.tokenize if self.tokenizer is not None else None)
        for rid in norm.rids:
            if self.engine.in_flight(rid):
                raise RequestError(f"Duplicate request ID detected: {rid}")
        planned = self._plan(norm, log_metrics=obj.log_metrics)
        self._inject_faults(planned)
        self._log_accepted(norm, planned)
        for item in planned:
            self.engine.submit(item.req)
        results = await asyncio.gather(
            *(self._wait(item, obj, request) for item in planned), return_exceptions=True
        )
        outs: list[dict[str, Any]] = []
        for result in results:
            # As in SGLang, one failed item fails the whole call.
            if isinstance(result, BaseException):
                raise result
            outs.append(result)
        return outs[0] if norm.is_single else outs

    def _plan(self, norm: NormalizedRequest, *, log_metrics: bool) -> list[_Planned]:
        cfg = self.config
        params = [
            validate_prompt(
                prompt,
                context_len=cfg.context_len,
                max_req_input_len=cfg.max_req_input_len,
                vocab_size=self.special.vocab_size,
            )
            for prompt in norm.prompts
        ]
        rids = iter(norm.run_rids())
        planned: list[_Planned] = []
        for prompt, sp in zip(norm.prompts, params, strict=True):
            output, max_new = self._output_for(prompt.input_ids, sp)
            for _ in range(norm.parallel_sample_num):
                req = SimRequest(
                    rid=next(rids),
                    prompt_len=len(prompt.input_ids),
                    max_new_tokens=max_new,
                    output=output,
                    log_metrics=log_metrics,
                )
                planned.append(_Planned(req=req, params=sp, input_ids=prompt.input_ids))
        return planned

    def _output_for(self, input_ids: list[int], sp: SamplingParams) -> tuple[SimOutput, int]:
        # The scheduler's init_req_max_new_tokens: never past the request length limit.
        requested = sp.max_new_tokens if sp.max_new_tokens is not None else _UNBOUNDED_NEW_TOKENS
        max_new = min(requested, self.config.max_req_len - len(input_ids) - 1)
        output = expected_output(
            input_ids,
            max_new_tokens=max_new,
            seed=sp.sampling_seed,
            special=self.special,
            mean_reasoning_tokens=self.config.mean_reasoning_tokens,
            mean_answer_tokens=self.config.mean_answer_tokens,
            ignore_eos=sp.ignore_eos,
            tool_call_ids=self.tool_call_ids(input_ids, seed=sp.sampling_seed),
        )
        if sp.stop_token_ids and not sp.ignore_eos:
            output = apply_stop_token_ids(output, sp.stop_token_ids, max_new_tokens=max_new)
        return output, max_new

    def _log_accepted(self, norm: NormalizedRequest, planned: list[_Planned]) -> None:
        # One line per prompt of a batch; with n > 1 it stands for all n samples (its params say
        # n) under the first sample's rid.
        n = norm.parallel_sample_num
        for index, prompt in enumerate(norm.prompts):
            self.log_request(planned[index * n].req.rid, prompt.input_ids, prompt.raw_params)

    def _inject_faults(self, planned: list[_Planned]) -> None:
        for item in planned:
            fault = self._faults.choose(item.req.rid)
            if fault is Fault.UNAVAILABLE:
                raise HTTPException(status_code=503, detail=QUEUE_FULL_MESSAGE)
            if fault is Fault.INTERNAL:
                raise HTTPException(status_code=500, detail=_INTERNAL_ABORT_MESSAGE)
            if fault is Fault.ABORT:
                item.req.abort_after = self._faults.abort_point(item.req.rid, len(item.req.output.output_ids))

    async def _wait(self, item: _Planned, obj: GenerateReqInput, request: Request) -> dict[str, Any]:
        req = item.req
        while not req.done.is_set():
            try:
                await asyncio.wait_for(req.done.wait(), timeout=REQUEST_STATE_WAIT_TIMEOUT_S)
            except TimeoutError:
                # Like SGLang: a non-streaming request is aborted once its client is gone.
                if await request.is_disconnected():
                    self.engine.abort(req.rid)
                    raise RequestError(
                        "Request is disconnected from the client side (type 1). "
                        f"Abort request obj.rid={req.rid!r}"
                    ) from None
        if req.outcome is Outcome.OUT_OF_MEMORY:
            raise HTTPException(status_code=500, detail=OOM_MESSAGE)
        out = self._response(item, obj)
        out["meta_info"]["response_sent_to_client_ts"] = time.time()
        return out

    # -- response bodies -------------------------------------------------------------------

    def _response(self, item: _Planned, obj: GenerateReqInput) -> dict[str, Any]:
        req = item.req
        assert req.finished_at is not None
        e2e_latency = req.finished_at - req.arrived_at
        if req.outcome is Outcome.ABORTED_WAITING:
            # _handle_abort_req: no prompt_tokens or cached_tokens.
            meta: dict[str, Any] = {
                "id": req.rid,
                "finish_reason": {"type": FinishType.ABORT.value, "message": "Abort in waiting queue"},
                "weight_version": self.config.weight_version,
                "e2e_latency": e2e_latency,
                "completion_tokens": 0,
            }
            return {"text": "", "output_ids": [], "meta_info": meta}

        output_ids = req.output_ids
        if req.outcome is Outcome.ABORTED_RUNNING:
            finish: dict[str, Any] = {
                "type": FinishType.ABORT.value,
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            }
        else:
            finish = dict(req.output.finish_reason)
        meta = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": req.prompt_len,
            "weight_version": self.config.weight_version,
            "num_retractions": req.num_retractions,
            "reasoning_tokens": self._reasoning_tokens(output_ids) if obj.require_reasoning else 0,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "e2e_latency": e2e_latency,
        }
        out: dict[str, Any] = {
            "text": self._text(output_ids, finish, item.params),
            "output_ids": list(output_ids),
            "meta_info": meta,
        }
        if obj.return_prompt_token_ids:
            out["prompt_token_ids"] = list(item.input_ids)
        return out

    def _reasoning_tokens(self, output_ids: list[int]) -> int:
        # Tokens up to and including </think>; all of them while still reasoning.
        try:
            return output_ids.index(self.special.think_end_id) + 1
        except ValueError:
            return len(output_ids)

    def _text(self, output_ids: list[int], finish: dict[str, Any], sp: SamplingParams) -> str:
        ids = output_ids
        # DetokenizerManager.trim_matched_stop drops a matched stop token from the text only.
        if (
            finish.get("type") == FinishType.STOP
            and isinstance(finish.get("matched"), int)
            and not sp.no_stop_trim
        ):
            ids = ids[:-1]
        return self.detokenize(
            ids,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
        )
