"""The docs site's generated reference walks everything it documents, and its nav is whole.

The generators (docs/_hooks/reference.py) run when MkDocs builds the site; here each one's output
is held against its source, listed another way: every field of the settings models, every metric
name in the metrics modules' source and in the registries they fill, every route of the
coordinator's app and every command and option of the CLI. `mkdocs build --strict` (scripts/check)
checks links and anchors; this checks the nav and the markers it does not see.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import typer
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# A whole string literal that names a metric: SGLang's colon form on the simulator, ours elsewhere.
METRIC_LITERAL = re.compile(r"""["']((?:datagen_|sglang:|vllm:)[a-z0-9_:]+)["']""")


def _load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "_hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    return _load_hook()


def test_every_setting_of_every_process_is_in_the_configuration_reference(hook: ModuleType) -> None:
    from datagen.settings import ClientSettings, CoordinatorSettings, WorkerSettings, known_variables

    text = hook.settings_reference()
    hooks = set()
    for model in (CoordinatorSettings, WorkerSettings, ClientSettings):
        for name, info in model.model_fields.items():
            if hook.is_test_hook(info):
                hooks.add(f"DATAGEN_{name.upper()}")
                continue
            assert f"`DATAGEN_{name.upper()}`" in text, f"{model.__name__}.{name} is not in the reference"
    # The variables a process accepts are exactly those the reference lists, and the test hooks.
    listed = {row.split("`")[1] for row in text.splitlines()[2:]}
    assert listed == known_variables() - hooks
    assert hooks, "the settings mark no test hook: DATAGEN_TEST_ACK_DELAY_S is one"


def test_every_variable_in_the_configuration_reference_has_a_description(hook: ModuleType) -> None:
    rows = hook.settings_reference().splitlines()[2:]
    assert len(rows) == len(hook.settings_variables())
    # A row is `| variable | type | default | bounds | read by | description |`.
    empty = [row.split("`")[1] for row in rows if not row.rstrip()[:-1].rsplit("|", 1)[1].strip()]
    assert not empty, (
        f"variables without a description (add one to their Field in datagen/settings.py): {empty}"
    )
    assert "TEST_" not in hook.settings_reference(), "a test hook is in the configuration reference"


def test_every_job_spec_field_is_in_the_spec_reference(hook: ModuleType) -> None:
    from datagen.spec import JobSpec, SamplingParams

    text = hook.spec_reference()
    for name in JobSpec.model_fields:
        assert f"| `{name}` |" in text
    for name in SamplingParams.model_fields:
        assert f"| `sampling.{name}` |" in text


def test_every_metric_named_in_the_metrics_modules_is_in_the_reference(hook: ModuleType) -> None:
    text = hook.metrics_reference()
    declared = {metric.name for metric in hook.declared_metrics()}
    for relative in hook.METRICS_MODULES.values():
        source = (ROOT / relative).read_text("utf-8")
        named = set(METRIC_LITERAL.findall(source))
        assert named, f"no metric names found in {relative}"
        assert named <= declared, f"{relative} names metrics the generator missed: {named - declared}"
    for name in declared:
        assert f"`{name}" in text


def test_the_metrics_registries_hold_nothing_the_reference_leaves_out(hook: ModuleType) -> None:
    from simulator.sglang.metrics import SimMetrics
    from simulator.vllm.metrics import VllmMetrics
    from workers.metrics import WorkerMetrics

    found = {(m.name, m.kind) for m in hook.declared_metrics()}
    registries = (WorkerMetrics().registry, SimMetrics("model").registry, VllmMetrics("model").registry)
    for registry in registries:
        for family in registry.collect():
            assert (family.name, family.type) in found, f"{family.name} ({family.type}) is not documented"


def test_metric_labels_are_read_through_the_simulators_helpers(hook: ModuleType) -> None:
    metrics = {m.name: m for m in hook.declared_metrics()}
    assert metrics["sglang:token_usage"].labels == (
        "model_name",
        "engine_type",
        "tp_rank",
        "pp_rank",
        "moe_ep_rank",
    )
    assert metrics["sglang:prompt_tokens"].labels == ("model_name", "engine_type")
    assert metrics["datagen_job_prompts"].labels == ("job", "partition", "class", "status")
    assert metrics["datagen_worker_requests"].labels == ("server", "class", "outcome")


def test_every_route_of_the_coordinator_is_in_the_http_reference(hook: ModuleType) -> None:
    app = hook.coordinator_app()
    text = hook.http_reference()
    routes = [(method, route.path) for route in app.routes for method in getattr(route, "methods", ())]
    assert len(routes) > 15
    for method, path in routes:
        assert f"`{method} {path}`" in text, f"{method} {path} is not in the HTTP reference"


def test_every_command_and_option_is_in_the_cli_reference(hook: ModuleType) -> None:
    import datagen_cli

    text = hook.cli_reference()
    root: Any = typer.main.get_command(datagen_cli.app)
    for name, command in root.commands.items():
        assert f"### `datagen {name}`" in text
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                assert f"`{param.opts[0]}" in text, f"datagen {name} {param.opts[0]} is not in the reference"
    # Each command's examples (its help epilog) come along, the first of them verbatim.
    for name in root.commands:
        section = text.split(f"### `datagen {name}`", 1)[1].split("\n### ", 1)[0]
        assert "Examples:" in section, f"datagen {name}'s examples are not in the reference"
    assert "datagen submit prompts.jsonl --tokenizer /models/DeepSeek-R1 --wait" in text


def _nav_files(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    return [f for item in nav for f in _nav_files(item)]


def test_the_nav_names_every_page_and_only_pages_that_exist() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text("utf-8"))
    listed = _nav_files(config["nav"])
    missing = [f for f in listed if not (DOCS / f).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_hooks" not in p.parts}
    assert pages == set(listed), f"pages not in the nav: {sorted(pages - set(listed))}"


def test_every_generated_section_a_page_asks_for_exists(hook: ModuleType) -> None:
    used = {name for page in DOCS.rglob("*.md") for name in hook.MARKER.findall(page.read_text("utf-8"))}
    assert used == set(hook.GENERATORS), "a generator no page uses, or a page naming an unknown one"
    with pytest.raises(ValueError, match="unknown generated section"):
        hook.render("<!-- generated: nothing -->")


def test_the_home_page_links_to_the_sites_pages(hook: ModuleType) -> None:
    home = hook.readme_for_site()
    assert "](docs/" not in home and "](bench/README.md" not in home
    for target in re.findall(r"\]\(([^)#]+)", home):
        if "://" not in target:
            assert (DOCS / target).is_file(), f"the README links to {target}, which the site lacks"
