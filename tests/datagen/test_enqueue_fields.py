"""The RQ job hashes that ingestion saves (`datagen.control.enqueue.queued_jobs`, written by
``ingest_land.lua``, as ``backlog_add.lua`` writes them) are the hashes RQ's own
``Queue.create_job`` and ``Job.save`` write, field for field, and RQ reads them back as the prompt
they were made from."""

from __future__ import annotations

import zlib

import redis
from rq.job import Job, JobStatus

from datagen.control.enqueue import RAW_DATA_BYTES, EnqueueOptions, queued_job_fields
from datagen.control.ingest_chunks import ChunkWrite, IngestChunks, Landing
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.payload import Conversation, PromptPayload, parse_payload
from datagen.control.rq_format import SERIALIZER, payload_of, queues
from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen.spec import JobSpec
from datagen.states import Priority, PromptClass

NS = "enqf"
OPTIONS = EnqueueOptions(result_ttl_s=3600, failure_ttl_s=7200, max_worker_losses=4)
# Times of the enqueue; data stored uncompressed when short, compressed faster than RQ does when
# long (compared as RQ reads it).
OWN = {"created_at", "enqueued_at", "data"}


def _as_rq_reads(data: bytes) -> bytes:
    """``data`` as RQ's ``Job.restore`` reads it: decompressed, or as it is when it is no zlib stream."""
    try:
        return zlib.decompress(data)
    except zlib.error:
        return data


def _payloads(job_id: str) -> list[PromptPayload]:
    return [
        # Over SMALL_DATA_BYTES of payload: the other compression.
        PromptPayload(job_id, "long", 0, 0, PromptClass.LONG, list(range(5000)), 64, "default"),
        # Between RAW_DATA_BYTES and SMALL_DATA_BYTES: compressed in the small window.
        PromptPayload(job_id, "mid", 0, 0, PromptClass.LONG, list(range(300)), 64, "default"),
        PromptPayload(
            job_id, "a", 0, 0, PromptClass.SHORT, [0, 128803, 23166], 16, "default", incarnation="i1"
        ),
        PromptPayload(job_id, "b", 0, 1, PromptClass.SHORT, [7], 16, "math", incarnation="i1", arm="hot"),
        PromptPayload(
            job_id,
            "c",
            0,
            0,
            PromptClass.LONG,
            [1, 2, 3, 4],
            512,
            "default",
            conversation=Conversation([{"role": "user", "content": "é"}], None, [1], []),
            incarnation="i1",
        ),
    ]


def test_saved_hashes_are_rq_s_own(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    jobs = JobStore(redis_client, keys)
    jobs.create("j1", JobSpec(tokenizer=bundled_tokenizer_path()))
    by_class = queues(redis_client, keys)
    payloads = _payloads("j1")
    write = ChunkWrite(
        input_name="up.jsonl",
        last_line=len(payloads),
        enqueue=payloads,
        continued=(),
        counts={"accepted": len(payloads)},
        partitions=set(),
        partitioned={},
        breakdown={},
        rows={},
        seen=b"",
    )
    landing = IngestChunks(redis_client, keys, OPTIONS).land(
        "j1",
        write,
        priority=Priority.NORMAL,
        incarnation=jobs.incarnation("j1") or "",
        fence_value="",
        window=len(payloads),
        wait_for_room=lambda *_: None,
    )
    assert landing is Landing.LANDED
    for payload in payloads:
        rq_id, expected = queued_job_fields(by_class[payload.cls], keys, payload, OPTIONS)
        saved = redis_client.hgetall(f"rq:job:{rq_id}")
        wanted = {
            name.encode(): redis_client.connection_pool.get_encoder().encode(value)
            for name, value in expected.items()
        }
        assert saved.keys() == wanted.keys()
        assert {k: v for k, v in saved.items() if k.decode() not in OWN} == {
            k: v for k, v in wanted.items() if k.decode() not in OWN
        }
        assert _as_rq_reads(saved[b"data"]) == zlib.decompress(wanted[b"data"])
        # Short payloads are stored as they are, longer ones compressed.
        assert saved[b"data"].startswith(b"[") is (len(_as_rq_reads(saved[b"data"])) < RAW_DATA_BYTES)
        assert saved[b"created_at"] == saved[b"enqueued_at"]
        assert saved[b"status"] == b"queued"
        # RQ reads the hash back as the prompt it was made from.
        job = Job.fetch(rq_id, connection=redis_client, serializer=SERIALIZER)
        assert job.get_status() is JobStatus.QUEUED
        assert job.origin == by_class[payload.cls].name
        assert job.retries_left == 4 and job.result_ttl == 3600 and job.failure_ttl == 7200
        assert parse_payload(payload_of(job)).require() == payload
        assert _as_rq_reads(saved[b"data"]).startswith(
            b'["workers.claim.rqbridge.refuse_stock_rq_worker", null, [{'
        )
    assert redis_client.lrange(keys.job_backlog("j1", PromptClass.SHORT), 0, -1) == [
        keys.rq_job_id("j1", s, 0, g).encode() for s, g in (("a", 0), ("b", 1))
    ]
    # Written by hand: [0, 128803, 23166] as little-endian uint32s in base64, and the description.
    first = redis_client.hgetall(f"rq:job:{keys.rq_job_id('j1', 'a', 0, 0)}")
    assert b'"prompt_ids": "AAAAACP3AQB+WgAA"' in first[b"data"]
    assert first[b"description"] == b"j1 a t0 g0"
