"""Every input form through ``POST /jobs`` over a real Redis, the real tokenizer and template:
compressed JSONL and Parquet uploads, a Parquet directory and a saved `datasets` directory by
reference; the prompt ids of a few rows written by hand, and bad rows reported with their file and
row while the rest goes on."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import zstandard
from fastapi.testclient import TestClient
from rq.job import Job
from rq.serializers import JSONSerializer

from datagen.control.keys import Keys
from datagen.control.payload import unpack_ids
from datagen.export.pipeline import ExportOptions, export_job
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.states import ExportFormat, PromptClass
from service.app import create_app
from tests.support.ingest import INGEST_TIMEOUT_S, wait_ingested
from tests.support.processes import coordinator_stack
from tests.support.sim import running_simulator
from tests.support.specs import CLASS_LIMITS, spec_json
from tests.support.wait import wait_until
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "fmt"
PROC_NS = "fmtproc"
# The DeepSeek tokenizer and datagen/templates/deepseek_r1.jinja, read off once and written here by
# hand: <｜begin▁of▁sentence｜> [system] <｜User｜> text <｜Assistant｜> <think> "\n".
HI = [0, 128803, 23166, 128804, 128821, 201]
YO = [0, 128803, 76943, 128804, 128821, 201]
HELLO = [0, 128803, 19923, 128804, 128821, 201]
BRIEF_HI = [0, 7153, 9708, 16, 128803, 23166, 128804, 128821, 201]  # system "Be brief." first


@pytest.fixture
def refs(tmp_path: Path) -> Path:
    path = tmp_path / "refs"
    path.mkdir()
    return path


@pytest.fixture
def settings(redis_url: str, tmp_path: Path, refs: Path) -> CoordinatorSettings:
    return CoordinatorSettings(
        redis_url=redis_url, storage=str(tmp_path / "store"), namespace=NS, dataset_allowlist=str(refs)
    )


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _post(client: TestClient, files: Any = None, **fields: str) -> Any:
    return client.post("/jobs", data={"spec": spec_json(CLASS_LIMITS), **fields}, files=files)


def _upload(client: TestClient, name: str, body: bytes, **fields: str) -> str:
    response = _post(client, files={"dataset": (name, body, "application/octet-stream")}, **fields)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _prompt_ids(redis_client: redis.Redis, job_id: str, namespace: str = NS) -> dict[str, list[int]]:
    """Each enqueued prompt's ids, by sample id."""
    found = {}
    for cls in PromptClass:
        for rq_id in redis_client.lrange(Keys(namespace).job_backlog(job_id, cls), 0, -1):
            text = rq_id.decode() if isinstance(rq_id, bytes) else rq_id
            payload = Job.fetch(text, connection=redis_client, serializer=JSONSerializer).args[0]
            found[payload["sample_id"]] = unpack_ids(payload["prompt_ids"])
    return found


def _rejected(client: TestClient, job_id: str) -> list[tuple[int, str | None, int | None]]:
    errors = client.get(f"/jobs/{job_id}/errors", params={"kind": "rejected"}).json()["errors"]
    return [(e["line"], e.get("file"), e.get("row")) for e in errors]


JSONL_ROWS = [
    json.dumps({"id": "hi", "messages": _user("Hi")}).encode(),
    b"{not json",
    json.dumps({"id": "yo", "prompt": "Yo"}).encode(),
]


@pytest.mark.parametrize(
    ("name", "pack", "suffix"),
    [
        ("d.jsonl.gz", gzip.compress, ".jsonl.gz"),
        ("d.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b), ".jsonl.zst"),
        ("d.jsonl.zstd", lambda b: zstandard.ZstdCompressor().compress(b), ".jsonl.zst"),
    ],
)
def test_compressed_jsonl_uploads(
    client: TestClient, redis_client: redis.Redis, tmp_path: Path, name: str, pack: Any, suffix: str
) -> None:
    job_id = _upload(client, name, pack(b"\n".join(JSONL_ROWS) + b"\n"))
    job = wait_ingested(client, job_id)
    assert (job["state"], job["rows"], job["total"], job["rejected"]) == ("running", 3, 2, 1)
    assert _prompt_ids(redis_client, job_id) == {"hi": HI, "yo": YO}
    assert _rejected(client, job_id) == [(2, name, 2)]
    # Stored as uploaded, compressed, named with its format.
    [stored] = Storage(str(tmp_path / "store")).input_names(job_id)
    assert stored.endswith(suffix)


def _parquet_bytes(tmp_path: Path, table: pa.Table) -> bytes:
    path = tmp_path / "upload.parquet"
    pq.write_table(table, path, row_group_size=2)
    return path.read_bytes()


def test_a_parquet_upload_maps_its_columns(
    client: TestClient, redis_client: redis.Redis, tmp_path: Path
) -> None:
    conv_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())]))
    table = pa.table(
        {
            "uid": ["a", "b", "c", "d"],
            # A list of structs: the rows' absent ``name`` comes back null and is dropped.
            "conv": pa.array(
                [
                    [{"role": "user", "content": "Hi", "name": None}],
                    None,
                    [{"role": "wizard", "content": "x", "name": None}],
                    None,
                ],
                type=conv_type,
            ),
            "prompt": [None, "Hi", None, "Hello"],
            "system": [None, "Be brief.", None, None],
        }
    )
    job_id = _upload(
        client, "rows.parquet", _parquet_bytes(tmp_path, table), messages_column="conv", id_column="uid"
    )
    job = wait_ingested(client, job_id)
    assert (job["rows"], job["total"], job["rejected"]) == (4, 3, 1)
    assert _prompt_ids(redis_client, job_id) == {"a": HI, "b": BRIEF_HI, "d": HELLO}
    assert _rejected(client, job_id) == [(3, "rows.parquet", 3)]


def test_the_format_field_names_a_format_the_file_name_does_not(
    client: TestClient, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # ``messages`` as a JSON string, as some exports write it.
    table = pa.table({"id": ["s"], "messages": [json.dumps(_user("Yo"))]})
    job_id = _upload(client, "blob", _parquet_bytes(tmp_path, table), format="parquet")
    assert wait_ingested(client, job_id)["total"] == 1
    assert _prompt_ids(redis_client, job_id) == {"s": YO}


def test_a_parquet_directory_by_reference_numbers_rows_across_its_shards(
    client: TestClient, redis_client: redis.Redis, refs: Path
) -> None:
    shards = refs / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"id": ["y", "bad2"], "prompt": ["Yo", None]}), shards / "part-1.parquet")
    pq.write_table(pa.table({"id": ["h", "bad1"], "prompt": ["Hi", None]}), shards / "part-0.parquet")
    response = _post(client, dataset_url=str(shards))
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    job = wait_ingested(client, job_id)
    assert (job["rows"], job["total"], job["rejected"]) == (4, 2, 2)
    assert _prompt_ids(redis_client, job_id) == {"h": HI, "y": YO}
    assert _rejected(client, job_id) == [(2, "part-0.parquet", 2), (4, "part-1.parquet", 2)]


def test_a_saved_dataset_by_reference(client: TestClient, redis_client: redis.Redis, refs: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [
        {"key": "sg", "conversations": [{"from": "human", "value": "Hi"}], "prompt": None},
        {"key": "bad", "conversations": [{"from": "alien", "value": "x"}], "prompt": None},
        {"key": "p", "conversations": None, "prompt": "Hello"},
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(refs / "saved"))
    response = _post(client, dataset_url=str(refs / "saved"), id_column="key")
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    job = wait_ingested(client, job_id)
    assert (job["rows"], job["total"], job["rejected"]) == (3, 2, 1)
    assert _prompt_ids(redis_client, job_id) == {"sg": HI, "p": HELLO}
    assert _rejected(client, job_id) == [(2, "data-00000-of-00001.arrow", 2)]


@pytest.mark.parametrize(
    ("files", "fields", "status", "message"),
    [
        (
            {"dataset": ("d.txt", b"{}\n", "text/plain")},
            {"format": "csv"},
            400,
            "unknown dataset format 'csv': use one of jsonl, jsonl.gz, jsonl.zst, parquet, parquet-dir, "
            "hf-dataset",
        ),
        (
            {"dataset": ("d.jsonl", b"{}\n", "application/jsonl")},
            {"messages_column": "conv"},
            400,
            "--messages-column and --id-column map Parquet and Arrow columns; this dataset is jsonl: name "
            "its fields messages and id",
        ),
        (
            {"dataset": ("d", b"{}\n", "application/jsonl")},
            {"format": "parquet-dir"},
            400,
            "a parquet-dir dataset is a directory and cannot be uploaded: give it by reference (dataset_url)",
        ),
        (
            None,
            {},
            422,
            "give the dataset as an upload (`dataset`) or by reference (`dataset_url`), one of the two",
        ),
    ],
)
def test_a_submit_that_cannot_be_read_is_refused_in_one_line(
    client: TestClient, files: Any, fields: dict[str, str], status: int, message: str
) -> None:
    response = _post(client, files=files, **fields)
    assert (response.status_code, response.json()["error"]) == (status, message)
    assert client.get("/jobs").json()["jobs"] == []


def test_a_wrong_column_fails_the_job_with_one_line(client: TestClient, tmp_path: Path) -> None:
    table = pa.table({"conversation": [_user("Hi")]})
    job_id = _upload(client, "x.parquet", _parquet_bytes(tmp_path, table), messages_column="conv")
    job = wait_ingested(client, job_id)
    assert (job["state"], job["error"]) == (
        "failed",
        "--messages-column 'conv': x.parquet has no such column (it has: conversation)",
    )


@pytest.mark.e2e
def test_datagen_submit_over_real_processes_uploads_parquet_and_names_a_reference(tmp_path: Path) -> None:
    """``datagen submit`` and a ``datagen coordinator`` process: a Parquet upload with its columns
    mapped, and a saved dataset by reference (nothing uploaded)."""
    datasets = pytest.importorskip("datasets")
    refs = tmp_path / "refs"
    refs.mkdir()
    datasets.Dataset.from_list([{"id": "y", "messages": _user("Yo")}]).save_to_disk(str(refs / "saved"))
    upload = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"key": ["h", "bad"], "conv": [_user("Hi"), _user("")]}), upload)
    common = (
        *("--tokenizer", bundled_tokenizer_path(), "--chat-template", str(default_chat_template_path())),
        *("--context-len", "4096", "--wait-for-servers-s", "0"),
    )
    with coordinator_stack(tmp_path, PROC_NS, {"DATAGEN_DATASET_ALLOWLIST": str(refs)}) as stack:
        ran = stack.cli("submit", str(upload), "--messages-column", "conv", "--id-column", "key", *common)
        assert ran.returncode == 0, ran.stderr + stack.logs()
        uploaded = ran.stdout.strip()
        ran = stack.cli("submit", "--dataset-url", str(refs / "saved"), "--job-id", "byref", *common)
        assert (ran.returncode, ran.stdout.strip()) == (0, "byref"), ran.stderr + stack.logs()
        outside = stack.cli("submit", "--dataset-url", str(tmp_path), *common)
        assert outside.returncode != 0 and "DATAGEN_DATASET_ALLOWLIST" in outside.stderr
        for job_id, prompts in ((uploaded, {"h": HI}), ("byref", {"y": YO})):

            def ingested(job_id: str = job_id) -> dict[str, Any] | None:
                job: dict[str, Any] = httpx.get(f"{stack.coordinator}/jobs/{job_id}", timeout=10).json()
                return job if job["state"] != "ingesting" else None

            job = wait_until(ingested, INGEST_TIMEOUT_S, f"job {job_id} to be ingested")
            assert job["state"] == "running", job
            assert _prompt_ids(stack.redis, job_id, PROC_NS) == prompts
        errors = httpx.get(f"{stack.coordinator}/jobs/{uploaded}/errors", timeout=10).json()["errors"]
        assert [(e["line"], e["file"], e["row"]) for e in errors] == [(2, "rows.parquet", 2)]
        assert [n.endswith(".ref.json") for n in stack.storage.input_names("byref")] == [True]


def test_an_upload_over_the_limit_leaves_neither_the_file_nor_how_to_read_it(
    settings: CoordinatorSettings, tmp_path: Path
) -> None:
    small = settings.model_copy(update={"max_upload_bytes": 10})
    with TestClient(create_app(small)) as client:
        body = gzip.compress(b"\n".join(JSONL_ROWS))
        response = _post(client, files={"dataset": ("d.jsonl.gz", body, "application/gzip")}, job_id="big")
    assert response.status_code == 413, response.text
    assert sorted(p.name for p in (tmp_path / "store").rglob("*") if p.is_file()) == [
        "datagen-namespace.json"
    ]


async def test_the_conversations_export_reads_a_parquet_upload_s_rows(
    client: TestClient, redis_url: str, tmp_path: Path, tokenizer_path: str
) -> None:
    """The conversations export finds each record's dataset row again: in a Parquet upload's rows,
    not in its bytes (which hold no lines to seek to)."""
    table = pa.table({"id": ["a", "b"], "prompt": ["Hi", "Hello"]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    job_id = _upload(client, "rows.parquet", sink.getvalue().to_pybytes())
    wait_ingested(client, job_id)
    storage = Storage(str(tmp_path / "store"))
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0) as url:
        settings = fast_worker_settings(redis_url, storage, NS, short_concurrency=2)
        await Worker(settings, [ServerSpec("s0", url)], burst=True, install_signal_handlers=False).main()
    out = tmp_path / "conversations.jsonl"
    # The job's short limit cuts every answer; the cut turns are what there is to export here.
    stats = export_job(storage, job_id, ExportFormat.CONVERSATIONS, out, ExportOptions(drop_truncated=False))
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert stats.written == 2 and sorted(rows) == ["a", "b"]
    assert rows["a"]["conversations"][0] == {"role": "user", "content": "Hi"}
    assert rows["b"]["conversations"][0] == {"role": "user", "content": "Hello"}
    assert rows["b"]["conversations"][-1]["role"] == "assistant"


def test_an_ingesting_job_shows_how_far_it_read_its_input(redis_url: str, tmp_path: Path) -> None:
    """A Parquet upload of 50 rows whose ingestion waits for room (a window of 10 prompts, no worker):
    the job shows the rows read of the total from the file's footer."""
    settings = CoordinatorSettings(
        redis_url=redis_url, storage=str(tmp_path / "waits"), namespace="fmtwait", max_queued_per_class=10
    )
    table = pa.table({"id": [f"r{i}" for i in range(50)], "prompt": [f"Question {i}?" for i in range(50)]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    with TestClient(create_app(settings)) as waiting:
        job_id = _upload(waiting, "rows.parquet", sink.getvalue().to_pybytes())
        job = wait_until(
            lambda: (j := waiting.get(f"/jobs/{job_id}").json())["waiting_for_room"] and j,
            INGEST_TIMEOUT_S,
            "the ingestion to wait for room",
        )
        assert job["state"] == "ingesting"
        read = job["input"]
        assert (read["format"], read["rows_total"]) == ("parquet", 50)
        assert 10 <= read["rows_read"] <= 50
        waiting.delete(f"/jobs/{job_id}")
