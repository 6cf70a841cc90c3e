"""Decontamination sets at submit: size-bounded as they stream, hashed into the manifest, parsed once."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from datagen.hygiene.benchmark_sets import MAX_SET_EXPANSION
from datagen.hygiene.decontam import INDEX_CACHE
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from tests.support.ingest import wait_ingested
from tests.support.specs import make_spec

NS = "t"
MB = 1_000_000
# How much the test process may grow while a set is refused.
RSS_GROWTH_LIMIT_BYTES = 100 * MB
BENCH_PROMPT = "name every prime number below one hundred and explain how you know that each is prime"


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(
        redis_url=redis_url,
        storage=str(tmp_path / "store"),
        namespace=NS,
        tokenizer_allowlist=str(tmp_path / "benchmarks"),
    )


@pytest.fixture
def benchmarks(tmp_path: Path) -> Path:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    return folder


def _dataset() -> dict[str, Any]:
    rows = [{"id": "a", "messages": [{"role": "user", "content": "Write a haiku about rain."}]}]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return {"dataset": ("d.jsonl", body, "application/jsonl")}


def _post(client: TestClient, route: str, benchmark: Path, job_id: str | None = None) -> Any:
    data = {"spec": json.dumps(make_spec(decontaminate=[str(benchmark)]))}
    if job_id is not None:
        data["job_id"] = job_id
    return client.post(route, data=data, files=_dataset())


def _peak_rss_reset() -> None:
    """Start VmHWM (peak RSS) over from the current RSS (Linux: /proc/PID/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _gzip_bomb(path: Path, block: bytes, copies: int) -> None:
    """A gzip file of ``copies`` members, each ``block`` compressed: written in moments, however
    large it expands (multi-member files are ordinary gzip)."""
    member = gzip.compress(block, compresslevel=9)
    with path.open("wb") as fh:
        for _ in range(copies):
            fh.write(member)


def _refused_without_growth(client: TestClient, benchmark: Path, expected: str) -> int:
    # The tokenizer loads first: what the coordinator holds anyway, before any set is read.
    warm = client.post("/jobs/dry-run", data={"spec": json.dumps(make_spec())}, files=_dataset())
    assert warm.status_code == 200, warm.text
    _peak_rss_reset()
    before = _status_bytes("VmRSS")
    for route in ("/jobs", "/jobs/dry-run"):
        response = _post(client, route, benchmark, job_id="big" if route == "/jobs" else None)
        assert response.status_code == 400, response.text
        assert expected in response.json()["error"]
        assert str(benchmark) in response.json()["error"]
    growth = _status_bytes("VmHWM") - before
    print(f"peak RSS growth while refusing {benchmark.name}: {growth / MB:.1f} MB")
    assert growth < RSS_GROWTH_LIMIT_BYTES, f"peak RSS grew by {growth / MB:.0f} MB"
    assert client.get("/jobs/big").status_code == 404  # nothing was accepted
    return growth


def test_a_2_gib_set_file_is_refused_at_submit_unread(client: TestClient, benchmarks: Path) -> None:
    big = benchmarks / "weights.jsonl"
    with big.open("wb") as fh:
        fh.truncate(2 << 30)  # sparse: 2 GiB of zeros, instantly
    _refused_without_growth(client, big, "is 2048 MiB, over the limit of 256 MiB for a set file")


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        # 1 MiB of gzip: refused once its text passes 100 times that.
        pytest.param(bytes(1 << 20), f"expands to more than {MAX_SET_EXPANSION}×", id="zeros"),
        # Valid lines, 3 MiB of gzip: refused at 256 MiB of text, before any line is parsed.
        pytest.param(
            (json.dumps({"prompt": BENCH_PROMPT}) + "\n").encode() * 10_000,
            "holds more than 256 MiB of text",
            id="jsonl",
        ),
    ],
)
def test_a_gzip_bomb_is_refused_at_submit(
    client: TestClient, benchmarks: Path, block: bytes, expected: str
) -> None:
    bomb = benchmarks / "bomb.jsonl.gz"
    copies = (1 << 30) // len(block) + 1  # over 1 GiB of text
    _gzip_bomb(bomb, block, copies)
    assert bomb.stat().st_size < 4 * MB
    builds = INDEX_CACHE.builds
    _refused_without_growth(client, bomb, expected)
    assert INDEX_CACHE.builds == builds  # refused by the streaming check: nothing parsed


def test_a_bad_set_is_a_400_at_submit_not_a_failed_job(client: TestClient, benchmarks: Path) -> None:
    bad = benchmarks / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": BENCH_PROMPT}) + "\n{not json\n")
    response = _post(client, "/jobs", bad, job_id="bad")
    assert response.status_code == 400
    assert "line 2 is not JSON" in response.json()["error"]
    assert client.get("/jobs/bad").status_code == 404


def test_the_set_is_pinned_in_the_manifest_and_a_changed_set_refused_on_append(
    settings: CoordinatorSettings, client: TestClient, benchmarks: Path
) -> None:
    bench = benchmarks / "bench.jsonl"
    bench.write_text(json.dumps({"id": "p1", "prompt": BENCH_PROMPT}) + "\n")
    assert _post(client, "/jobs", bench, job_id="pinned").status_code == 202
    wait_ingested(client, "pinned")
    manifest = Storage(settings.storage).read_manifest("pinned")
    assert manifest is not None
    digest = hashlib.sha256(bench.read_bytes()).hexdigest()
    assert manifest["decontaminate"]["sets"] == [
        {"source": str(bench), "sha256": digest, "bytes": bench.stat().st_size}
    ]
    # The same content appends; another content is refused, whatever the file's name says.
    assert _post(client, "/jobs", bench, job_id="pinned").status_code == 202
    wait_ingested(client, "pinned")
    with bench.open("a") as fh:
        fh.write(json.dumps({"id": "p2", "prompt": BENCH_PROMPT + " twice"}) + "\n")
    response = _post(client, "/jobs", bench, job_id="pinned")
    assert response.status_code == 400
    error = response.json()["error"]
    assert "generated with another decontamination set content" in error
    assert f"{manifest['decontaminate']['sha256'][:16]}… in its manifest" in error


def test_submit_parses_the_set_once_for_itself_its_ingestion_and_dry_runs(
    client: TestClient, benchmarks: Path
) -> None:
    bench = benchmarks / "once.jsonl"
    bench.write_text(json.dumps({"id": "p1", "prompt": BENCH_PROMPT}) + "\n")
    builds = INDEX_CACHE.builds
    assert _post(client, "/jobs", bench, job_id="once").status_code == 202
    wait_ingested(client, "once")
    for _ in range(3):
        assert _post(client, "/jobs/dry-run", bench).status_code == 200
    assert INDEX_CACHE.builds == builds + 1
