"""One simulated vLLM server: turns ``/v1/completions`` calls into engine requests and answers.

The same engine (admission, KV pool, preemption) and the same token model as the SGLang mode;
only the contract around them differs: vLLM's length checks, its finish rule (EOS before the
length cap), its response body and its metric names. The flow follows
``OpenAIServingCompletion._create_completion``: check the model, render (length checks), lower
``max_tokens``, build the sampling params, run every prompt and sample, build one body. With
``capture_dir`` set, every scheduled request also leaves a hidden-states file (``capture``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from simulator.config import SimConfig
from simulator.frontend import Frontend
from simulator.model import SimOutput
from simulator.scheduler import Outcome, SimRequest
from simulator.vllm._protocol import (
    DEFAULT_MAX_TOKENS,
    CompletionRequest,
    VllmError,
    VllmFinish,
    VllmOutput,
    check_prompt,
    check_sampling,
    check_token_ids,
    effective_max_tokens,
    vllm_expected_output,
)
from simulator.vllm.capture import Capture, CaptureFault
from simulator.vllm.metrics import VllmMetrics

__all__ = ["VllmServer"]

log = logging.getLogger(__name__)

_NO_TOKENIZER_MESSAGE = (
    "Text prompts need a tokenizer and the simulator has none (start it with --tokenizer); "
    "send the prompt as token ids."
)
_OOM_MESSAGE = "The simulated engine ran out of KV cache for a lone request."


@dataclass(frozen=True)
class _Planned:
    prompt_index: int
    req: SimRequest
    output: VllmOutput


class VllmServer(Frontend[VllmMetrics]):
    """The shared front end, speaking vLLM."""

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config, VllmMetrics(config.served_model_name))
        self.capture = Capture(config) if config.capture_dir is not None else None

    async def close(self) -> None:
        await super().close()
        if self.capture is not None:
            await self.capture.close()

    # -- /v1/completions -------------------------------------------------------------------

    async def complete(self, req: CompletionRequest, request_id: str) -> dict[str, Any]:
        """Raises ``VllmError``; cancelling it (the client went away) aborts its engine requests."""
        req.refuse_unsimulated()
        self._check_model(req.model)
        prompts = self._prompt_ids(req.prompt)
        planned = self._plan(req, prompts, request_id)
        fault = self.capture.plan(request_id) if self.capture is not None else None
        self._log_accepted(req, prompts, request_id)
        for item in planned:
            self.engine.submit(item.req)
        try:
            await asyncio.gather(*(item.req.done.wait() for item in planned))
        except asyncio.CancelledError:
            for item in planned:
                self.engine.abort(item.req.rid)
            try:
                self._capture(req, prompts, planned, request_id, fault)  # orphans nobody learns of
            except VllmError as exc:  # nobody is left to answer
                log.warning("no orphan hidden-states file for %s: %s", request_id, exc.message)
            raise
        paths = self._capture(req, prompts, planned, request_id, fault)
        body = self._response(req, prompts, planned, request_id)
        if paths and paths[0] is not None:
            # Only the first sub-request's path comes back (final_res_batch[0].kv_transfer_params).
            body["kv_transfer_params"] = {"hidden_states_path": paths[0]}
        return body

    def _log_accepted(self, req: CompletionRequest, prompts: list[list[int]], request_id: str) -> None:
        # One line per prompt (a batch's i-th under "<id>-<i>", vLLM's sub-request id); with n > 1
        # it stands for all n samples (its params say n).
        sampling = req.sampling_fields()
        for index, ids in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            self.log_request(rid, ids, sampling)

    def _capture(
        self,
        req: CompletionRequest,
        prompts: list[list[int]],
        planned: list[_Planned],
        request_id: str,
        fault: CaptureFault | None,
    ) -> list[str | None]:
        """Lock (and later write) the file of every request that was scheduled; None for the others."""
        if self.capture is None:
            return []
        params = req.kv_transfer_params or {}
        if "hidden_states_path" in params:
            log.warning("provided hidden_states_path but allow_custom_save_path is disabled. Ignoring")
        paths: list[str | None] = []
        for item in planned:
            sim_req = item.req
            if sim_req.admitted_at is None:  # aborted before it was scheduled: no lock, no file
                paths.append(None)
                continue
            ids = prompts[item.prompt_index]
            if params.get("include_output_tokens"):
                ids = (ids + sim_req.output_ids)[:-1]  # the last generated token was never an input
            prefilled = sim_req.first_token_at is not None
            paths.append(
                self.capture.begin(request_id, item.prompt_index, ids, fault=fault, prefilled=prefilled)
            )
        return paths

    def _check_model(self, model: str | None) -> None:
        name = self.config.served_model_name
        if model and model != name:
            raise VllmError(
                f"The model `{model}` does not exist. Valid aliases: {name}.",
                status=HTTPStatus.NOT_FOUND,
                err_type="NotFoundError",
                param="model",
            )

    def _prompt_ids(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt or isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], list):
            return [list(ids) for ids in prompt]
        if self.tokenizer is None:
            raise VllmError(_NO_TOKENIZER_MESSAGE, param="prompt")
        # Completions add the tokenizer's special tokens (add_special_tokens defaults to true).
        return [self.tokenize(text) for text in prompt]

    def _plan(self, req: CompletionRequest, prompts: list[list[int]], request_id: str) -> list[_Planned]:
        max_model_len = self.config.context_len
        asked = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
        for ids in prompts:
            check_prompt(len(ids), max_tokens=asked, max_model_len=max_model_len)
        planned: list[_Planned] = []
        for index, ids in enumerate(prompts):
            max_tokens = effective_max_tokens(len(ids), max_tokens=asked, max_model_len=max_model_len)
            check_sampling(req, max_tokens=max_tokens)
            check_token_ids(ids, vocab_size=self.special.vocab_size)
            for sample in range(req.n):
                # Parallel sampling gives child i the seed seed + i (vllm/v1/engine/parallel_sampling.py).
                seed = None if req.seed is None else req.seed + sample
                output = self._output_for(ids, req, max_tokens=max_tokens, seed=seed)
                sim_req = SimRequest(
                    rid=f"{request_id}-{index}-{sample}-{uuid.uuid4().hex}",
                    prompt_len=len(ids),
                    max_new_tokens=max_tokens,
                    output=SimOutput(output.token_ids, {"finish_reason": output.finish_reason.value}),
                )
                planned.append(_Planned(prompt_index=index, req=sim_req, output=output))
        return planned

    def _output_for(
        self, ids: list[int], req: CompletionRequest, *, max_tokens: int, seed: int | None
    ) -> VllmOutput:
        cfg = self.config
        return vllm_expected_output(
            ids,
            max_tokens=max_tokens,
            seed=seed,
            special=self.special,
            ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids or (),
            mean_reasoning_tokens=cfg.mean_reasoning_tokens,
            mean_answer_tokens=cfg.mean_answer_tokens,
            tool_call_ids=self.tool_call_ids(ids, seed=seed),
        )

    # -- response bodies -------------------------------------------------------------------

    def _response(
        self, req: CompletionRequest, prompts: list[list[int]], planned: list[_Planned], request_id: str
    ) -> dict[str, Any]:
        choices = [
            self._choice(index, item, req, prompts[item.prompt_index]) for index, item in enumerate(planned)
        ]
        prompt_tokens = sum(len(ids) for ids in prompts)
        completion_tokens = sum(len(item.req.output_ids) for item in planned)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.config.served_model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _choice(
        self, index: int, item: _Planned, req: CompletionRequest, prompt: list[int]
    ) -> dict[str, Any]:
        sim_req = item.req
        if sim_req.outcome is Outcome.OUT_OF_MEMORY:
            raise VllmError(
                _OOM_MESSAGE, status=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError"
            )
        token_ids = list(sim_req.output_ids)
        if sim_req.outcome is Outcome.FINISHED:
            finish, stop_reason = item.output.finish_reason, item.output.stop_reason
            self.metrics.request_success[finish.value].inc()
        else:  # aborted (the server is shutting down); the engine counted it
            finish, stop_reason = VllmFinish.ABORT, None
        return {
            "index": index,
            "text": self._text(token_ids, finish, req),
            "logprobs": None,
            "finish_reason": finish.value,
            "stop_reason": stop_reason,
            "token_ids": token_ids if req.return_token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(prompt) if req.return_token_ids else None,
            "routed_experts": None,
            "weight_versions": None,
        }

    def _text(self, token_ids: list[int], finish: VllmFinish, req: CompletionRequest) -> str:
        # The detokenizer skips the token that stopped the request (EOS or a stop id) unless
        # include_stop_str_in_output; token_ids keep it either way.
        ids = (
            token_ids[:-1] if finish is VllmFinish.STOP and not req.include_stop_str_in_output else token_ids
        )
        skip_special = True if req.skip_special_tokens is None else req.skip_special_tokens
        return self.detokenize(
            ids,
            skip_special_tokens=skip_special,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
        )
