from __future__ import annotations

import re

import pytest

from datagen.control.keys import Keys, prompt_key
from datagen.control.payload import Conversation, PromptPayload, pack_ids, parse_payload, unpack_ids
from datagen.errors import FatalError
from datagen.states import PromptClass


def test_rq_job_id_is_deterministic_and_rq_safe() -> None:
    keys = Keys("ns")
    rq_id = keys.rq_job_id("job1", "sample/with spaces ü", 2, 0)
    # sha1("sample/with spaces ü")[:16], written out so a change of the scheme is noticed
    assert rq_id == "ns-job1-247afa311fa17cda-t2-g0"
    assert re.fullmatch(r"[A-Za-z0-9_-]+", rq_id)
    assert rq_id == keys.rq_job_id("job1", "sample/with spaces ü", 2, 0)
    assert rq_id != keys.rq_job_id("job1", "sample/with spaces ü", 2, 1)


def test_queue_names_use_the_namespace() -> None:
    keys = Keys("datagen")
    assert keys.queue_name(PromptClass.SHORT) == "datagen-short"
    assert keys.queue_name(PromptClass.LONG) == "datagen-long"
    assert keys.job("abc") == "datagen:job:abc"


def test_prompt_key_distinguishes_turn_and_gen() -> None:
    keys = [prompt_key(sample, turn, gen) for sample in ("a", "b") for turn in (0, 1) for gen in (0, 1)]
    assert len(set(keys)) == len(keys) == 8  # every pair differs, gen 0 from gen 1 too
    assert prompt_key("a", 0, 1) == prompt_key("a", 0, 1)


def test_pack_ids_is_base64_of_little_endian_uint32() -> None:
    # 1 → 01 00 00 00, 128821 (<think>) → 35 F7 01 00
    assert pack_ids([1, 128821]) == "AQAAADX3AQA="
    assert unpack_ids("AQAAADX3AQA=") == [1, 128821]
    assert unpack_ids(pack_ids([])) == []
    assert unpack_ids(pack_ids([2**32 - 1])) == [2**32 - 1]


def test_payload_round_trip_and_malformed() -> None:
    payload = PromptPayload("j", "s", 1, 0, PromptClass.LONG, [0, 5, 9], 77, "math")
    assert PromptPayload.from_json(payload.to_json()) == payload
    with pytest.raises(FatalError, match="malformed"):
        PromptPayload.from_json({"job": "j"})


def test_a_conversation_keeps_its_stored_layout() -> None:
    # Written by hand: the ``conversation`` field of a payload as the coordinator stores it in RQ.
    stored = {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": None,
        "cuts": [1],
        "generated": ["Hello"],
        "class": "long",
    }
    conversation = Conversation.from_json(stored)
    assert conversation.row_class is PromptClass.LONG and conversation.cuts == [1]
    assert conversation.to_json() == stored
    payload = PromptPayload("j", "s", 0, 0, PromptClass.LONG, [0], 7, "math", conversation, "inc1")
    assert PromptPayload.from_json(payload.to_json()) == payload


def test_a_claimed_payload_is_read_once_even_when_malformed() -> None:
    payload = PromptPayload("j", "s", 1, 0, PromptClass.LONG, [0, 5, 9], 77, "math")
    parsed = parse_payload(payload.to_json())
    assert (parsed.require(), parsed.job, parsed.error) == (payload, "j", None)
    broken = parse_payload({"job": "j", "sample_id": "s"})
    assert broken.prompt is None and broken.job == "j" and broken.raw["sample_id"] == "s"
    with pytest.raises(FatalError, match="malformed"):
        broken.require()
    assert parse_payload(None).job is None
