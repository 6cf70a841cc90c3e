"""Issue 40 (data recipes): a job with a recipe counts its records per arm. Over a real Redis, through
the real ack scripts: a committed prompt of an arm adds ``done@<arm>`` and ``output_tokens@<arm>``
to its job's breakdown beside the plain counters (which still sum to the job's), a repeated ack
counts once, a prompt without an arm adds no arm field; ``GET /jobs/{id}`` and the job list show
``arms`` (null without a recipe), and the coordinator's metrics export per-arm series without
counting them as plain ``done``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from rq import Queue
from rq.serializers import JSONSerializer

from datagen.control.enqueue import EnqueueOptions, queued_job_fields
from datagen.control.job_outcomes import QueuedTurn
from datagen.control.jobs import AckItem, AckTarget, JobStore
from datagen.control.keys import BreakdownField, Keys, prompt_key
from datagen.control.payload import Conversation, PromptPayload
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.spec import Arm, JobSpec, RecipeSpec
from datagen.states import Priority, PromptClass
from service.app import create_app
from service.fleetview import FleetView
from service.metrics import CoordinatorMetrics
from tests.support.ingest import wait_ingested
from tests.support.jobfields import add_ingest_counts, add_partition_labels
from tests.support.sim import running_simulator
from tests.support.specs import make_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "arms"
KEYS = Keys(NS)
TARGET = AckTarget(started_key="started", finished_key="finished", execution_id="x")
RECIPE = RecipeSpec(
    arms=[
        Arm(name="low", chat_template_kwargs={"reasoning_effort": "low"}),
        Arm(name="high", chat_template_kwargs={"reasoning_effort": "high"}),
        Arm(name="mid", chat_template_kwargs={"reasoning_effort": "medium"}),
    ]
)


@pytest.fixture
def store(redis_client: redis.Redis) -> JobStore:
    return JobStore(redis_client, KEYS)


def _running(
    store: JobStore, redis_client: redis.Redis, job_id: str, spec: JobSpec, rq_ids: list[str]
) -> str:
    """A running job with ``rq_ids`` in flight (and one more prompt accepted, so it stays running);
    partition ``math`` has its own label. Returns its incarnation."""
    store.create(job_id, spec)
    with redis_client.pipeline() as pipe:
        add_ingest_counts(
            pipe, store.keys, job_id, {"rows": len(rq_ids) + 1, "accepted": len(rq_ids) + 1}, line=1
        )
        add_partition_labels(pipe, store.keys, job_id, ["math"])
        pipe.execute()
    store.finish_ingest(job_id)
    for rq_id in rq_ids:
        store.outcomes.started(job_id, rq_id)
    incarnation = store.incarnation(job_id)
    assert incarnation
    return incarnation


def _acks(store: JobStore, redis_client: redis.Redis) -> list[AckItem]:
    """j1 (a recipe) with three prompts of two arms, j2 (none) with one prompt, acked together."""
    one = _running(store, redis_client, "j1", JobSpec(tokenizer="tok", recipe=RECIPE), ["q1", "q2", "q3"])
    two = _running(store, redis_client, "j2", JobSpec(tokenizer="tok"), ["q4"])
    return [
        AckItem("q1", "j1", one, 10, "math", "short", "stop", 100, arm="low"),
        AckItem("q2", "j1", one, 20, "chat", "short", "length", 100, arm="low"),
        AckItem("q3", "j1", one, 5, "math", "long", "stop", 100, arm="high"),
        AckItem("q4", "j2", two, 7, "math", "short", "stop", 100),
    ]


def _fields(store: JobStore, job_id: str) -> dict[str, int]:
    return {name.encode(): n for name, n in store.breakdown(job_id).items()}


def test_a_shards_prompts_count_per_arm_once_beside_the_plain_counters(
    store: JobStore, redis_client: redis.Redis
) -> None:
    items = _acks(store, redis_client)
    assert store.outcomes.ack_done(TARGET, items) == 4
    assert _fields(store, "j1") == {
        "done|math|short": 1,
        "output_tokens|math|short": 10,
        "finish:stop|math|short": 1,
        "done@low|math|short": 1,
        "output_tokens@low|math|short": 10,
        # chat has no label of its own
        "done|other|short": 1,
        "output_tokens|other|short": 20,
        "finish:length|other|short": 1,
        "done@low|other|short": 1,
        "output_tokens@low|other|short": 20,
        "done|math|long": 1,
        "output_tokens|math|long": 5,
        "finish:stop|math|long": 1,
        "done@high|math|long": 1,
        "output_tokens@high|math|long": 5,
    }
    # The prompt without an arm (a job without a recipe) adds no arm field.
    assert _fields(store, "j2") == {
        "done|math|short": 1,
        "output_tokens|math|short": 7,
        "finish:stop|math|short": 1,
    }
    # The job's own counters are the plain ones: 3 done, 35 tokens, not doubled by the arms.
    assert (store.progress("j1").done, store.progress("j1").output_tokens) == (3, 35)

    # The same shard acked again (its reply was lost): nothing counts twice.
    assert store.outcomes.ack_done(TARGET, items) == 0
    assert _fields(store, "j1")["done@low|math|short"] == 1
    assert store.progress("j1").done == 3


def test_the_breakdown_field_codec_reads_the_arm_the_script_wrote(
    store: JobStore, redis_client: redis.Redis
) -> None:
    store.outcomes.ack_done(TARGET, _acks(store, redis_client))
    field = BreakdownField.of_arm("done", "low", "math", "short")
    assert field.encode() == "done@low|math|short"
    assert store.breakdown("j1")[field] == 1
    assert (field.arm, field.base) == ("low", "done")
    plain = BreakdownField("finish:stop", "math", "short")
    assert (plain.arm, plain.base) == (None, "finish:stop")


def test_a_job_read_with_arms_shows_each_arm_of_its_recipe(
    store: JobStore, redis_client: redis.Redis
) -> None:
    store.outcomes.ack_done(TARGET, _acks(store, redis_client))
    one, two, gone = store.progress_many(["j1", "j2", "nope"], with_arms=True)
    assert gone is None
    assert one is not None and two is not None
    assert one.to_json()["arms"] == {
        "low": {"done": 2, "generated_tokens": 30},
        "high": {"done": 1, "generated_tokens": 5},
        "mid": {"done": 0, "generated_tokens": 0},  # in the recipe, no record yet
    }
    assert two.to_json()["arms"] is None
    # Read without them (a 404 check, a state read): no breakdown is read, and none is shown.
    assert store.progress("j1").arms is None


def test_a_next_turns_ack_counts_its_turn_per_arm(store: JobStore, redis_client: redis.Redis) -> None:
    incarnation = _running(store, redis_client, "j1", JobSpec(tokenizer="tok", recipe=RECIPE), ["q1"])
    payload = PromptPayload(
        job="j1",
        sample_id="s1",
        turn=1,
        gen=0,
        cls=PromptClass.SHORT,
        prompt_ids=[5, 6, 7],
        max_new_tokens=16,
        partition="math",
        conversation=Conversation(
            messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            tools=None,
            cuts=[1, 3],
            generated=["first answer"],
        ),
        incarnation=incarnation,
        arm="high",
    )
    queue = Queue(KEYS.queue_name(PromptClass.SHORT), connection=redis_client, serializer=JSONSerializer)
    options = EnqueueOptions(result_ttl_s=100, failure_ttl_s=100, max_worker_losses=2)
    rq_id, fields = queued_job_fields(queue, KEYS, payload, options)
    following = QueuedTurn(
        rq_id=rq_id,
        fields=fields,
        member=prompt_key("s1", 1, 0),
        cls=PromptClass.SHORT,
        priority=Priority.NORMAL,
        prompt_tokens=3,
        queue_key=queue.key,
        queues_key=queue.redis_queues_keys,
    )
    ack = AckItem("q1", "j1", incarnation, 9, "math", "short", "stop", 100, arm="high")
    assert store.outcomes.ack_next_turn(TARGET, ack, following) is True
    assert store.outcomes.ack_next_turn(TARGET, ack, following) is False  # counted once
    counts = _fields(store, "j1")
    assert (counts["done@high|math|short"], counts["output_tokens@high|math|short"]) == (1, 9)
    assert counts["accepted|math|short"] == 1  # the next turn, which has no arm counter
    assert not any("@low" in name or "@mid" in name for name in counts)


def test_the_metrics_show_done_per_arm_and_plain_done_without_it(
    store: JobStore, redis_client: redis.Redis
) -> None:
    store.outcomes.ack_done(TARGET, _acks(store, redis_client))
    metrics = CoordinatorMetrics(fleet=FleetView(redis_client, KEYS), jobs=store)
    text = generate_latest(metrics.registry).decode()
    assert 'datagen_job_arm_done_total{arm="low",job="j1"} 2.0' in text
    assert 'datagen_job_arm_done_total{arm="high",job="j1"} 1.0' in text
    assert 'datagen_job_arm_done_total{arm="mid",job="j1"} 0.0' in text
    assert 'datagen_job_arm_generated_tokens_total{arm="low",job="j1"} 30.0' in text
    assert 'job="j2"' not in "".join(line for line in text.splitlines() if "_arm_" in line)
    sample = metrics.registry.get_sample_value
    done = {"job": "j1", "partition": "math", "class": "short", "status": "done"}
    assert sample("datagen_job_prompts_total", done) == 1.0
    assert (
        sample("datagen_job_generated_tokens_total", {"job": "j1", "partition": "math", "class": "short"})
        == 10
    )
    assert "done@" not in text and "output_tokens@" not in text


def test_get_job_and_the_job_list_show_arms(
    store: JobStore, redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path / "data"), namespace=NS)
    with TestClient(create_app(settings)) as client:
        store.outcomes.ack_done(TARGET, _acks(store, redis_client))
        job = client.get("/jobs/j1").json()
        listed = {j["id"]: j for j in client.get("/jobs").json()["jobs"]}
        plain = client.get("/jobs/j2").json()
    assert job["arms"] == {
        "low": {"done": 2, "generated_tokens": 30},
        "high": {"done": 1, "generated_tokens": 5},
        "mid": {"done": 0, "generated_tokens": 0},
    }
    assert listed["j1"]["arms"] == job["arms"]
    assert plain["arms"] is None and listed["j2"]["arms"] is None


async def test_a_recipe_job_run_by_a_worker_counts_its_records_per_arm(
    redis_url: str, tmp_path: Path, tokenizer_path: str
) -> None:
    # Ten rows, two arms in turn (cycle): five records each, whatever the simulator generates.
    storage = Storage(str(tmp_path / "data"))
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(storage.root), namespace=NS)
    rows = "".join(json.dumps({"id": f"r{i}", "prompt": f"question {i}"}) + "\n" for i in range(10))
    recipe = {
        "assign": "cycle",
        "arms": [
            {"name": "low", "chat_template_kwargs": {"reasoning_effort": "low"}},
            {"name": "off", "chat_template_kwargs": {"thinking": False}},
        ],
    }
    with TestClient(create_app(settings)) as client:
        response = client.post(
            "/jobs",
            data={"spec": json.dumps(make_spec(short_max_new_tokens=16, recipe=recipe))},
            files={"dataset": ("d.jsonl", rows.encode(), "application/jsonl")},
        )
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        assert wait_ingested(client, job_id)["arms"] == {
            "low": {"done": 0, "generated_tokens": 0},
            "off": {"done": 0, "generated_tokens": 0},
        }
        with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, context_len=4096) as url:
            worker = Worker(
                fast_worker_settings(redis_url, storage, NS),
                [ServerSpec("s0", url)],
                burst=True,
                install_signal_handlers=False,
            )
            await worker.main()
        job = client.get(f"/jobs/{job_id}").json()
    assert (job["state"], job["done"]) == ("completed", 10)
    assert {arm: counts["done"] for arm, counts in job["arms"].items()} == {"low": 5, "off": 5}
    assert sum(counts["generated_tokens"] for counts in job["arms"].values()) == job["generated_tokens"] > 0
