"""Pre-flight refusals at submit, end to end: CLI → coordinator → what a live worker learnt from
the simulator. Each refusal is a 409 whose message says what to fix; a job that passes sends the
stop ids the checks resolved with every request."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from datagen.prompts.tokenization import bundled_tokenizer_path
from tests.support.processes import ProcessStack, coordinator_stack
from tests.support.specs import make_spec

pytestmark = pytest.mark.e2e

NS = "pre"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    # No wait for servers: these tests check the refusal itself, not submit's patience.
    env = {"DATAGEN_TOKENIZER_ALLOWLIST": str(tmp_path), "COLUMNS": "200", "DATAGEN_WAIT_FOR_SERVERS_S": "0"}
    with coordinator_stack(tmp_path, NS, env) as stack:
        stack.sim_url = stack.spawn_sim("sim")  # type: ignore[attr-defined]
        yield stack


def _dataset(stack: Any) -> Path:
    path = stack.tmp / "d.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path  # type: ignore[no-any-return]


# No context length: the pre-flight checks learn it from a live worker, or refuse.
SPEC_DEFAULTS: dict[str, Any] = {
    "context_len": None,
    "short_max_new_tokens": 64,
    "sampling": {"sampling_seed": 3},
}


def _refused_with_409(stack: Any, *, tokenizer: str | None = None, **fields: Any) -> bool:
    """Whether POST /jobs itself answers the pre-flight refusal as a 409 Conflict."""
    with open(_dataset(stack), "rb") as fh:
        response = httpx.post(
            f"{stack.coordinator}/jobs",
            data={
                "spec": json.dumps(
                    make_spec(SPEC_DEFAULTS, tokenizer=tokenizer or bundled_tokenizer_path(), **fields)
                )
            },
            files={"dataset": ("d.jsonl", fh, "application/jsonl")},
            timeout=60,
        )
    return response.status_code == 409 and response.json()["type"] in ("PreflightError", "NoServersYetError")


def _submit(stack: Any, *, tokenizer: str | None = None, **fields: Any) -> tuple[int, str]:
    spec = make_spec(SPEC_DEFAULTS, tokenizer=tokenizer or bundled_tokenizer_path(), **fields)
    spec_file = stack.tmp / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    result = stack.cli("submit", str(_dataset(stack)), "--spec", str(spec_file), "--wait")
    return result.returncode, " ".join((result.stdout + result.stderr).split())


def _start_worker(stack: Any) -> None:
    stack.spawn("worker", "worker", "--server", f"sim={stack.sim_url}")
    stack.wait_server_up(stack.coordinator, "sim")


def test_unknown_context_length_is_refused_until_a_worker_reports_one(stack: Any) -> None:
    code, out = _submit(stack)
    assert code != 0
    assert "the context length is unknown" in out and "set context_len" in out
    assert _refused_with_409(stack)
    assert httpx.get(f"{stack.coordinator}/jobs", timeout=5).json()["jobs"] == []  # nothing was created
    # The dry run shows the same refusal, and still renders the rows.
    dry = stack.submit(_dataset(stack), "--dry-run")
    assert dry.returncode == 0
    assert "pre-flight: submit would be refused: the context length is unknown" in " ".join(
        dry.stdout.split()
    )
    _start_worker(stack)
    code, out = _submit(stack)
    assert code == 0, out


def test_a_spec_pinning_another_model_or_weight_version_is_refused(stack: Any) -> None:
    _start_worker(stack)
    code, out = _submit(stack, weight_version="v2")
    assert code != 0 and _refused_with_409(stack, weight_version="v2")
    # Written by hand: the simulator's /model_info says model_path "sim/deepseek-r1", weight "default".
    assert "v2" in out and "default" in out and "sim" in out, out
    code, out = _submit(stack, model_path="deepseek-ai/DeepSeek-V3")
    assert code != 0 and "sim/deepseek-r1" in out and "deepseek-ai/DeepSeek-V3" in out, out
    code, out = _submit(stack, model_path="sim/deepseek-r1", weight_version="default")
    assert code == 0, out


def test_a_tokenizer_beyond_the_models_vocabulary_is_refused(stack: Any, tmp_path: Path) -> None:
    _start_worker(stack)
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(bundled_tokenizer_path(), tokenizer, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    # The model's config says 128,000 ids: the tokenizer's added tokens lie beyond it.
    (tokenizer / "config.json").write_text(json.dumps({"vocab_size": 128000}))
    code, out = _submit(stack, tokenizer=str(tokenizer))
    assert code != 0 and _refused_with_409(stack, tokenizer=str(tokenizer))
    assert "128804" in out and "Assistant" in out and "128000" in out, out


def test_a_job_that_passes_sends_the_resolved_stop_ids(stack: Any) -> None:
    _start_worker(stack)
    code, out = _submit(stack)
    assert code == 0, out
    job_id = httpx.get(f"{stack.coordinator}/jobs", timeout=5).json()["jobs"][0]["id"]
    records = [r for b in stack.storage.iter_record_batches(job_id) for r in b.to_pylist()]
    assert len(records) == 5
    # The bundled tokenizer's EOS, <｜end▁of▁sentence｜>, is id 1; it has no generation_config.json.
    assert {json.dumps(json.loads(r["sampling_params"])["stop_token_ids"]) for r in records} == {"[1]"}
    manifest = stack.storage.read_manifest(job_id)
    assert manifest is not None and manifest["preflight"]["stop_ids"] == [1]
    assert manifest["preflight"]["context_len"] == 32768
    assert stack.redis.hget(f"{NS}:job:{job_id}", "context_len") == b"32768"
