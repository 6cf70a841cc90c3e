"""A fresh coordinator process answers 1,001 concurrent first submits with 0 errors: the first
tokenizer and template loads race on `transformers`' lazy imports unless they are loaded once, under
a lock (`datagen.prompts.tokenization`, `datagen.prompts.loaders.preload_libraries` at start).
Before that fix, 5 of 1,001 got a plain-text 500."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.support.processes import coordinator_stack
from tests.support.specs import make_spec

SUBMITS = 1001
CLIENTS = 64


def test_a_thousand_concurrent_first_submits_all_answer_202(tmp_path: Path) -> None:
    body = (json.dumps({"id": "a", "messages": [{"role": "user", "content": "hello"}]}) + "\n").encode()
    spec = json.dumps(make_spec())
    with coordinator_stack(tmp_path, "first") as stack:
        with httpx.Client(
            base_url=stack.coordinator, timeout=120, limits=httpx.Limits(max_connections=CLIENTS)
        ) as http:

            def submit(n: int) -> str:
                response = http.post(
                    "/jobs",
                    data={"spec": spec, "job_id": f"j{n}"},
                    files={"dataset": ("d.jsonl", body, "application/jsonl")},
                )
                return (
                    str(response.status_code)
                    if response.status_code == 202
                    else f"{response.status_code} {response.text[:200]}"
                )

            with ThreadPoolExecutor(CLIENTS) as pool:
                answers = Counter(pool.map(submit, range(SUBMITS)))
        logs = stack.logs()
    assert answers == {"202": SUBMITS}, (answers.most_common(5), logs[-3000:])
    assert "Traceback" not in logs
