"""Recipes at submit, in the dry run and in the manifest: the app over a real Redis, the real tokenizer
and the project template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from fastapi.testclient import TestClient

from datagen.control.keys import Keys
from datagen.errors import InvalidSpecError
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.spec import validate_spec
from datagen_cli.specfile import EXAMPLE_SPEC
from service.manifests import check_provenance
from service.submit_check import SubmitCheck
from tests.support.ingest import wait_ingested
from tests.support.specs import CLASS_LIMITS, make_spec, spec_json

NS = "t"
HI_ROW = json.dumps({"id": "hi", "messages": [{"role": "user", "content": "Hi"}]})
# Decoded by hand from the ids the DeepSeek tokenizer gives (see tests/datagen/test_arms_check.py).
THINKING = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"  # 6 ids
NOT_THINKING = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n\n</think>\n\n"  # 8 ids
IGNORED = (
    'recipe: arms "plain" and "eager" render the same prompt ids: the chat template ignores the '
    'difference in effort_level (unset vs "x"); use the variable the template reads, or drop one arm'
)
IGNORING_RECIPE = {
    "arms": [{"name": "plain"}, {"name": "eager", "chat_template_kwargs": {"effort_level": "x"}}]
}
ON_OFF_RECIPE = {
    "assign": "cycle",
    "arms": [
        {"name": "on", "sampling": {"temperature": 0.6}},
        {"name": "off", "chat_template_kwargs": {"thinking": False}, "sampling": {"temperature": 0.9}},
    ],
}


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path / "store"), namespace=NS)


def _upload(rows: list[str]) -> dict[str, Any]:
    return {"dataset": ("d.jsonl", ("\n".join(rows) + "\n").encode(), "application/jsonl")}


def _submit(client: TestClient, spec: str, job_id: str | None = None, rows: list[str] | None = None) -> Any:
    data = {"spec": spec, **({"job_id": job_id} if job_id else {})}
    return client.post("/jobs", data=data, files=_upload(rows or [HI_ROW]))


def _dry_run(client: TestClient, spec: str, rows: list[str] | None = None) -> dict[str, Any]:
    response = client.post("/jobs/dry-run", data={"spec": spec}, files=_upload(rows or [HI_ROW]))
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _example_recipe() -> dict[str, Any]:
    """The commented recipe of `datagen spec --example`, uncommented."""
    lines = EXAMPLE_SPEC.splitlines()
    start = lines.index("#   recipe:")
    block = [line.removeprefix("#   ") for line in lines[start:] if line.startswith("#   ")]
    recipe: dict[str, Any] = yaml.safe_load("\n".join(block))["recipe"]
    return recipe


# -- submit ---------------------------------------------------------------------------------------


def test_arms_the_template_cannot_tell_apart_are_refused_with_one_line(client: TestClient) -> None:
    response = _submit(client, spec_json(CLASS_LIMITS, recipe=IGNORING_RECIPE))
    assert response.status_code == 409
    assert response.json()["error"] == IGNORED
    assert client.get("/jobs").json()["jobs"] == []


def test_arms_that_differ_only_in_sampling_are_accepted(client: TestClient) -> None:
    recipe = {"arms": [{"name": "cool", "sampling": {"temperature": 0.2}}, {"name": "hot"}]}
    response = _submit(client, spec_json(CLASS_LIMITS, samples=2, recipe=recipe))
    assert response.status_code == 202, response.text
    job = wait_ingested(client, response.json()["id"])
    assert (job["state"], job["total"], job["rejected"]) == ("running", 2, 0)


# -- dry run --------------------------------------------------------------------------------------


def test_the_dry_run_shows_every_arms_rendering_of_the_first_admitted_row(client: TestClient) -> None:
    rows = ["{broken", HI_ROW, json.dumps({"id": "two", "messages": [{"role": "user", "content": "Yo"}]})]
    preview = _dry_run(client, spec_json(CLASS_LIMITS, recipe=ON_OFF_RECIPE), rows)
    shown = [
        {k: arm[k] for k in ("name", "share", "line", "prompt_tokens", "prompt")} for arm in preview["arms"]
    ]
    assert shown == [
        {"name": "on", "share": 0.5, "line": 2, "prompt_tokens": 6, "prompt": THINKING},
        {"name": "off", "share": 0.5, "line": 2, "prompt_tokens": 8, "prompt": NOT_THINKING},
    ]
    on, off = preview["arms"]
    assert (on["chat_template_kwargs"], off["chat_template_kwargs"]) == ({}, {"thinking": False})
    assert (on["sampling"]["temperature"], off["sampling"]["temperature"]) == (0.6, 0.9)
    assert off["sampling"]["top_p"] == 0.95  # the job's, under the arm's
    assert preview["preflight"]["refused"] is None


def test_the_dry_run_counts_each_sample_under_its_arm(client: TestClient) -> None:
    # cycle, two samples: gen 0 of every row runs "on" (6 tokens), gen 1 "off" (8 tokens).
    preview = _dry_run(client, spec_json(CLASS_LIMITS, samples=2, recipe=ON_OFF_RECIPE))
    assert (preview["prompts"], preview["prompt_tokens_sampled"], preview["estimated_prompt_tokens"]) == (
        2,
        14,
        14,
    )
    assert preview["classes"] == {"short": 2, "long": 0}
    assert (preview["examples"][0]["arm"], preview["examples"][0]["prompt"]) == ("on", THINKING)


def test_the_dry_run_reports_arms_that_render_alike_and_still_renders(client: TestClient) -> None:
    preview = _dry_run(client, spec_json(CLASS_LIMITS, recipe=IGNORING_RECIPE))
    assert preview["preflight"] == {"refused": IGNORED}
    assert [(arm["name"], arm["prompt"]) for arm in preview["arms"]] == [
        ("plain", THINKING),
        ("eager", THINKING),
    ]


def test_the_dry_run_without_a_recipe_shows_no_arms(client: TestClient) -> None:
    preview = _dry_run(client, spec_json(CLASS_LIMITS, samples=2))
    assert (preview["arms"], preview["prompts"], preview["examples"][0]["arm"]) == ([], 2, None)


def test_the_example_recipe_loads_and_its_arms_render_apart(client: TestClient) -> None:
    recipe = _example_recipe()
    assert validate_spec(make_spec(recipe=recipe)).recipe is not None
    preview = _dry_run(client, spec_json(CLASS_LIMITS, recipe=recipe))
    assert preview["preflight"]["refused"] is None
    assert [(a["name"], a["share"], a["sampling"]["temperature"]) for a in preview["arms"]] == [
        ("low", 0.25, 0.6),
        ("medium", 0.25, 0.8),
        ("high", 0.5, 1.0),
    ]
    low = preview["arms"][0]
    assert (low["prompt"], low["prompt_tokens"]) == (
        "<｜begin▁of▁sentence｜>Reasoning: low<｜User｜>Hi<｜Assistant｜><think>\n",
        10,
    )


# -- the manifest pins the recipe -----------------------------------------------------------------


def test_a_resubmit_with_another_recipe_is_refused(client: TestClient) -> None:
    assert _submit(client, spec_json(CLASS_LIMITS, recipe=ON_OFF_RECIPE), job_id="j").status_code == 202
    wait_ingested(client, "j")
    other = {**ON_OFF_RECIPE, "assign": "weighted"}
    response = _submit(client, spec_json(CLASS_LIMITS, recipe=other), job_id="j")
    assert response.status_code == 400
    assert response.json()["error"] == (
        'job j exists with a different spec (its recipe differs: assign "cycle" then, "weighted" now); '
        "submit with the same spec to append, or use a new job id"
    )
    # The same recipe appends.
    assert _submit(client, spec_json(CLASS_LIMITS, recipe=ON_OFF_RECIPE), job_id="j").status_code == 202


def test_the_manifests_recipe_is_held_against_a_later_submit(
    client: TestClient, settings: CoordinatorSettings, redis_client: redis.Redis
) -> None:
    assert _submit(client, spec_json(CLASS_LIMITS, recipe=ON_OFF_RECIPE), job_id="j").status_code == 202
    assert _submit(client, spec_json(CLASS_LIMITS), job_id="plain").status_code == 202
    check = SubmitCheck(settings, redis_client, Keys(NS))
    storage = Storage(settings.storage)

    def refusal(job_id: str, recipe: dict[str, Any] | None) -> str:
        checked = check(validate_spec(make_spec(CLASS_LIMITS, recipe=recipe)), job_id)
        with pytest.raises(InvalidSpecError) as refused:
            check_provenance(storage, checked, checked.renderer.identity())
        return str(refused.value)

    hotter = json.loads(json.dumps(ON_OFF_RECIPE))
    hotter["arms"][1]["sampling"]["temperature"] = 1.2
    assert refusal("j", hotter) == (
        'job j: recipe differs from the job\'s: arm "off" sampling {"temperature":0.9} then, '
        '{"temperature":1.2} now; submit to a new job id'
    )
    assert refusal("j", None) == (
        "job j: recipe differs from the job's: the job has a recipe, this submit has none; submit to a "
        "new job id"
    )
    assert refusal("plain", ON_OFF_RECIPE) == (
        "job plain: recipe differs from the job's: the job has no recipe, this submit has one; submit to "
        "a new job id"
    )
    same = check(validate_spec(make_spec(CLASS_LIMITS, recipe=ON_OFF_RECIPE)), "j")
    check_provenance(storage, same, same.renderer.identity())
