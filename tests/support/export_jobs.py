"""Jobs as the coordinator and workers leave them in storage (a manifest, an uploaded input file and
committed shards), with output ids written by hand from the real DeepSeek tokenizer: the input of
the export, report and verify tests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datagen.prompts.provenance import canonical_kwargs_json
from datagen.prompts.tokenization import get_renderer
from datagen.records.schema import Record, records_to_table
from datagen.records.storage import Storage
from tests.support.records import make_record, write_manifest_once
from tests.support.specs import job_spec

__all__ = [
    "ASSISTANT",
    "BOS",
    "CLEAN",
    "EOS",
    "HI",
    "HI_MESSAGES",
    "HI_PROMPT",
    "I_THINK",
    "JOB",
    "LET_ME",
    "MULTI",
    "NEWLINE",
    "REASONED",
    "THE_ANSWER",
    "THINK",
    "THINK_END",
    "TOOL_CALLS",
    "USER",
    "Sample",
    "build_job",
    "read_jsonl",
]

# Ids read once off the DeepSeek tokenizer (tokenizer.encode(text, add_special_tokens=False)).
BOS, EOS, USER, ASSISTANT, THINK, NEWLINE, THINK_END, TOOL_CALLS = (
    0,
    1,
    128803,
    128804,
    128821,
    201,
    128822,
    128806,
)
HI = [23166]  # "Hi"
I_THINK = [43, 2118, 16]  # "I think."
THE_ANSWER = [671, 3287, 16]  # "The answer."
LET_ME = [5718, 678]  # "Let me"
# "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"
HI_PROMPT = [BOS, USER, *HI, ASSISTANT, THINK, NEWLINE]
REASONED = [*I_THINK, THINK_END, *THE_ANSWER, EOS]
JOB = "job1"


@dataclass
class Sample:
    """One record to commit, and the dataset row it came from."""

    sample_id: str
    output: list[int]
    finish: str = "stop"
    messages: list[dict[str, Any]] | None = None
    partition: str = "default"
    gen: int = 0
    tools: list[dict[str, Any]] | None = None
    prompt: list[int] | None = None  # planted: instead of the rendered prompt
    in_input: bool = True
    server: str = "sim-a"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return self.messages or [{"role": "user", "content": f"Question {self.sample_id}?"}]

    @property
    def turn(self) -> int:
        return sum(1 for m in self.conversation if m["role"] == "assistant")


def _record(job_id: str, sample: Sample, prompt: list[int]) -> Record:
    params = {"max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95, "sampling_seed": 7}
    return make_record(
        sample.sample_id,
        prompt + sample.output,
        len(prompt),
        job_id=job_id,
        turn=sample.turn,
        gen=sample.gen,
        partition=sample.partition,
        finish_type=sample.finish,
        finish_matched=str(sample.output[-1]) if sample.finish == "stop" else None,
        finish_length=len(sample.output) if sample.finish == "length" else None,
        max_new_tokens=64,
        server=sample.server,
        sampling_params=json.dumps(params, sort_keys=True),
    )


def build_job(
    storage: Storage,
    samples: Sequence[Sample],
    *,
    job_id: str = JOB,
    shards: int = 1,
    spec: dict[str, Any] | None = None,
) -> None:
    """A job as the coordinator and workers leave it: manifest, input upload, committed shards."""
    # The bundled tokenizer and the shipped template; no context length unless ``spec`` gives one.
    validated = job_spec({"context_len": None}, **(spec or {}))
    kwargs = canonical_kwargs_json(validated.chat_template_kwargs)
    render = get_renderer(validated.tokenizer, validated.chat_template, False, kwargs)
    manifest = {
        "job_id": job_id,
        "spec": json.loads(validated.model_dump_json()),
        "tokenizer": render.identity(),
        "servers": {},
    }
    write_manifest_once(storage, job_id, manifest)
    lines, seen = [], set()
    for s in samples:
        if s.in_input and s.sample_id not in seen:
            seen.add(s.sample_id)
            row = {"id": s.sample_id, "messages": s.conversation, "partition": s.partition, **s.extra}
            lines.append(json.dumps({**row, "tools": s.tools} if s.tools else row) + "\n")
    storage.write_input(job_id, ["".join(lines).encode("utf-8")])
    records = [_record(job_id, s, s.prompt or render.render(s.conversation, s.tools)) for s in samples]
    size = -(-len(records) // shards)
    for n in range(shards):
        chunk = records[n * size : (n + 1) * size]
        if chunk:
            storage.commit_shard(job_id, f"w-{n:08d}", records_to_table(chunk), {"worker": "w"})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines()]


# The report tests' clean job: a reasoned answer, a two-turn conversation, a truncated answer.
HI_MESSAGES = [{"role": "user", "content": "Hi"}]
MULTI = Sample(
    "multi",
    [*LET_ME, THINK_END, *THE_ANSWER, EOS],
    messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ],
    partition="chat",
)
CLEAN = [
    Sample("hi", REASONED, messages=HI_MESSAGES, partition="math"),
    MULTI,
    Sample("trunc", [*I_THINK, *LET_ME], finish="length", messages=HI_MESSAGES, partition="math"),
]
