"""A worker's run facts per job (`workers.run.jobinfo`): what a claim told is used without a read
of its own; a job no claim told of is read once; the claim is told the jobs used last, a bounded
list."""

from __future__ import annotations

import redis

from datagen.control.jobs import JobStore, RunFacts
from datagen.control.keys import Keys
from datagen.spec import JobSpec
from workers.run.jobinfo import KNOWN_TOLD, JobInfos

KEYS = Keys("ji")


def _hmgets(redis_client: redis.Redis) -> int:
    return int(redis_client.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0))


def test_what_a_claim_told_is_used_and_a_job_no_claim_told_of_is_read_once(redis_client: redis.Redis) -> None:
    jobs = JobStore(redis_client, KEYS)
    jobs.create("read", JobSpec(tokenizer="tok-read"))
    infos = JobInfos(jobs)
    infos.learn("told", RunFacts(JobSpec(tokenizer="tok-told"), "tok-told@sha256:1", (5,), "i1"))
    redis_client.config_resetstat()
    info = infos.get("told", "i1")
    assert (info.spec.tokenizer, info.tokenizer, info.stop_ids) == ("tok-told", "tok-told@sha256:1", (5,))
    assert _hmgets(redis_client) == 0
    incarnation = jobs.incarnation("read")
    assert incarnation
    redis_client.config_resetstat()
    assert infos.get("read", incarnation).spec.tokenizer == "tok-read"
    assert infos.get("read", incarnation).spec.tokenizer == "tok-read"
    assert _hmgets(redis_client) == 1
    # Used last first: a claim is told both.
    assert infos.known() == ["read", "told"]


def test_a_claim_is_told_the_jobs_used_last_and_no_more(redis_client: redis.Redis) -> None:
    infos = JobInfos(JobStore(redis_client, KEYS))
    for i in range(KNOWN_TOLD + 10):
        infos.learn(f"j{i}", RunFacts(JobSpec(tokenizer="tok"), "tok", (), "i"))
    infos.get("j0", "i")  # used again: among the last
    known = infos.known()
    assert len(known) == KNOWN_TOLD and known[0] == "j0"
    assert known[1:4] == [f"j{KNOWN_TOLD + 9}", f"j{KNOWN_TOLD + 8}", f"j{KNOWN_TOLD + 7}"]
