"""The reference pages' facts, generated from the code when MkDocs builds the site.

A page holds a marker, ``<!-- generated: NAME -->``, where ``on_page_markdown`` puts what one of
these functions renders from its source, so the docs cannot drift from the code:

- ``cli``: the Typer app (`datagen_cli.app`): commands, arguments, options, help and defaults
- ``http``: the coordinator's OpenAPI schema (`service.app.create_app`), plus the routes it leaves out
- ``settings``: the settings models (`datagen.settings`): every ``DATAGEN_*`` variable with its
  ``Field`` description, but the tests' hooks (``TEST_HOOK``)
- ``spec``: the job spec models (`datagen.spec`): every field, ``sampling`` included
- ``metrics``: the metrics modules (`service/metrics.py`, `workers/metrics.py`, `simulator/*/metrics.py`),
  read as source, because the coordinator's job and queue series are declared where a scrape builds them
- ``alerts``: the alerting rules (`deploy/alerts.yml`)
- ``readme``: the README, its links rewritten for the site (the home page)

Nothing generated is committed; ``tests/test_docs_reference.py`` checks that each walk is whole.
"""

from __future__ import annotations

import ast
import enum
import json
import re
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- generated: ([a-z]+) -->")
METRICS_MODULES = {
    "coordinator": "service/metrics.py",
    "worker": "workers/metrics.py",
    "simulator": "simulator/sglang/metrics.py",
    "simulator --api vllm": "simulator/vllm/metrics.py",
}
# prometheus_client's classes, and the simulator's helpers that wrap them, by the type they declare.
_METRIC_CALLS = {
    "Counter": "counter",
    "CounterMetricFamily": "counter",
    "Gauge": "gauge",
    "GaugeMetricFamily": "gauge",
    "Histogram": "histogram",
    "HistogramMetricFamily": "histogram",
    "Summary": "summary",
    "counter": "counter",
    "gauge": "gauge",
    "histogram": "histogram",
}
_EXPOSED = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
_UNSET = "–"


def cell(text: str) -> str:
    """Text for a Markdown table cell: one line; outside code spans, pipes escaped and angle
    brackets shown as text rather than read as HTML (Python-Markdown's tables leave a pipe inside
    a code span alone)."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return "`".join(parts)


def code(text: str) -> str:
    return f"`{text}`"


def site_tables(markdown: str) -> str:
    """A pipe escaped inside a code span of a table row, as GitHub needs it, unescaped for
    Python-Markdown, which would show the backslash."""
    lines = markdown.split("\n")
    for n, line in enumerate(lines):
        if line.startswith("|") and "\\|" in line:
            parts = line.split("`")
            lines[n] = "`".join(p.replace("\\|", "|") if i % 2 else p for i, p in enumerate(parts))
    return "\n".join(lines)


def table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- the command line -------------------------------------------------------------------------


def cli_reference() -> str:
    import typer

    import datagen_cli  # registers every command on the app

    root = typer.main.get_command(datagen_cli.app)
    root_ctx = root.context_class(root, info_name="datagen")
    out = [_command_text(root, root_ctx, "datagen")]
    commands: dict[str, Any] = getattr(root, "commands", {})
    for name, command in commands.items():
        if not command.hidden:
            ctx = command.context_class(command, info_name=name, parent=root_ctx)
            out.append(_command_text(command, ctx, f"datagen {name}"))
    return "\n\n".join(out)


def _command_text(command: Any, ctx: Any, path: str) -> str:
    params = [p for p in command.params if not getattr(p, "hidden", False)]
    arguments = [p for p in params if p.param_type_name == "argument"]
    usage = [path, "[OPTIONS]"] + [p.name.upper() if p.required else f"[{p.name.upper()}]" for p in arguments]
    if getattr(command, "commands", None):
        usage = [path, "[OPTIONS]", "COMMAND", "[ARGS]..."]
    rows = []
    for param in params:
        record = param.get_help_record(ctx)
        if record is not None:
            rows.append((code(record[0]), cell(record[1])))
    title = "Global options" if path == "datagen" else f"`{path}`"
    parts = [f"### {title}", f"```text\n{' '.join(usage)}\n```", _help_paragraphs(command.help or "")]
    if rows:
        parts.append(table(("argument or option", "what it does"), rows))
    lines = [line.strip() for line in (command.epilog or "").splitlines()]
    # The epilog's examples (`datagen_cli._app.examples`): its lines after the `\b` marker.
    examples = [line for line in lines[lines.index("\b") + 1 :] if line] if "\b" in lines else []
    if examples:
        parts.append("Examples:\n\n```bash\n" + "\n".join(examples) + "\n```")
    return "\n\n".join(part for part in parts if part)


def _help_paragraphs(text: str) -> str:
    paragraphs = [" ".join(block.split()) for block in text.split("\n\n")]
    return "\n\n".join(cell(p).replace("\\|", "|") for p in paragraphs if p)


# --- the HTTP API -----------------------------------------------------------------------------


def coordinator_app() -> Any:
    """The coordinator's app as it serves, built without Redis: nothing connects until its
    lifespan starts, which only a server (or a test client) does."""
    from datagen.settings import CoordinatorSettings
    from service.app import create_app

    return create_app(CoordinatorSettings.model_construct())


def http_reference() -> str:
    app = coordinator_app()
    schema = app.openapi()
    components = schema.get("components", {}).get("schemas", {})
    out = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            out.append(_operation_text(method.upper(), path, operation, components))
    hidden = [
        (code(f"{method} {route.path}"), cell(_first_line(route.endpoint.__doc__)))
        for route in app.routes
        if not getattr(route, "include_in_schema", True)
        for method in sorted(getattr(route, "methods", ()))
    ]
    if hidden:
        out.append("### Routes outside the schema\n\n" + table(("route", "what it serves"), hidden))
    return "\n\n".join(out)


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n\n")[0]


def _operation_text(method: str, path: str, operation: dict[str, Any], components: dict[str, Any]) -> str:
    parts = [f"### `{method} {path}`"]
    if operation.get("description"):
        parts.append(_help_paragraphs(operation["description"]))
    rows = [
        (
            code(p["name"]),
            p["in"],
            _schema_type(p.get("schema", {}), components),
            "yes" if p.get("required") else "no",
            cell(_describe({**p.get("schema", {}), **p})),
        )
        for p in operation.get("parameters", [])
    ]
    body = operation.get("requestBody", {})
    for content_type, content in body.get("content", {}).items():
        body_schema = _resolve(content.get("schema", {}), components)
        required = set(body_schema.get("required", []))
        for name, prop in body_schema.get("properties", {}).items():
            where = f"body ({content_type})"
            kind = _schema_type(prop, components)
            rows.append((code(name), where, kind, "yes" if name in required else "no", cell(_describe(prop))))
    if rows:
        parts.append(table(("parameter", "in", "type", "required", "description"), rows))
    answers = ", ".join(
        f"`{status}` {cell(answer.get('description', ''))}"
        for status, answer in operation.get("responses", {}).items()
    )
    parts.append(f"Answers: {answers}.")
    return "\n\n".join(parts)


def _resolve(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return components[ref.rsplit("/", 1)[-1]] if ref else schema


def _describe(schema: dict[str, Any]) -> str:
    text = schema.get("description", "")
    if schema.get("default") is not None:
        text = f"{text} (default `{json.dumps(schema['default'])}`)".strip()
    return text


def _schema_type(schema: dict[str, Any], components: dict[str, Any]) -> str:
    schema = _resolve(schema, components)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            kinds = [_schema_type(s, components) for s in schema[key]]
            return " or ".join(k for k in kinds if k != "null") or "null"
    if "enum" in schema:
        return " \\| ".join(code(str(value)) for value in schema["enum"])
    kind = str(schema.get("type", "any"))
    if kind == "array":
        kind = f"list of {_schema_type(schema.get('items', {}), components)}"
    if schema.get("format") == "binary" or "contentMediaType" in schema:
        kind = "file"
    bounds = [f"{word} {schema[key]}" for key, word in _JSON_BOUNDS if key in schema]
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


_JSON_BOUNDS = (
    ("minimum", "≥"),
    ("exclusiveMinimum", ">"),
    ("maximum", "≤"),
    ("exclusiveMaximum", "<"),
    ("minLength", "length ≥"),
    ("maxLength", "length ≤"),
)


# --- settings and the job spec ----------------------------------------------------------------


def settings_models() -> dict[str, type[Any]]:
    """The settings model of each kind of process, by who reads it."""
    from datagen.settings import ClientSettings, CoordinatorSettings, WorkerSettings

    return {"coordinator": CoordinatorSettings, "worker": WorkerSettings, "CLI": ClientSettings}


def is_test_hook(info: Any) -> bool:
    """A field the tests set (``TEST_HOOK`` in its ``json_schema_extra``): not for operators."""
    from datagen.settings import TEST_HOOK

    extra = info.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get(TEST_HOOK))


def settings_variables() -> dict[str, tuple[str, Any, list[str]]]:
    """``DATAGEN_*`` name -> (field name, the field's info, the processes that read it), test hooks
    left out."""
    from datagen.settings import ENV_PREFIX

    found: dict[str, tuple[str, Any, list[str]]] = {}
    for process, model in settings_models().items():
        for name, info in model.model_fields.items():
            if is_test_hook(info):
                continue
            variable = ENV_PREFIX + name.upper()
            found.setdefault(variable, (name, info, []))[2].append(process)
    return found


def settings_reference() -> str:
    from datagen.settings import CommonSettings

    everyone = len(settings_models())
    rows = []
    for variable, (name, info, readers) in sorted(settings_variables().items()):
        common = name in CommonSettings.model_fields and len(readers) == everyone
        rows.append(
            (
                code(variable),
                cell(_type_name(info.annotation)),
                _default_text(info, name),
                cell(_bounds_text(info.metadata)),
                "all" if common else ", ".join(readers),
                cell(info.description or ""),
            )
        )
    return table(("variable", "type", "default", "bounds", "read by", "description"), rows)


def spec_reference() -> str:
    from datagen.spec import JobSpec, SamplingParams

    def rows(model: type[Any], prefix: str) -> list[tuple[str, ...]]:
        return [
            (
                code(prefix + name),
                cell(_type_name(info.annotation)),
                _default_text(info, name),
                cell(_bounds_text(info.metadata)),
                cell(info.description or ""),
            )
            for name, info in model.model_fields.items()
        ]

    header = ("field", "type", "default", "bounds", "description")
    return table(header, rows(JobSpec, "") + rows(SamplingParams, "sampling."))


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " | ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(code(str(member.value)) for member in annotation)
    origin = typing.get_origin(annotation)
    if origin is not None:
        args = ", ".join(_type_name(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    name = getattr(annotation, "__name__", str(annotation))
    return {"StrictInt": "int", "StrictFloat": "float", "StrictBool": "bool", "StrictStr": "str"}.get(
        name, name
    )


def _default_text(info: Any, name: str) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None or value == "":
        return _UNSET
    if hasattr(value, "model_dump"):
        return "see `sampling.*`"
    if isinstance(value, bool):
        return code(str(value).lower())
    if hasattr(value, "value"):  # an enum member: its stored value
        value = value.value
    text = code(repr(value) if isinstance(value, (list, dict)) else str(value))
    if isinstance(value, int) and name.endswith("_bytes") and value >= 1024**2:
        text += f" ({value / 1024**3:g} GiB)" if value >= 1024**3 else f" ({value / 1024**2:g} MiB)"
    return text


_BOUND_WORDS = {
    "ge": "≥",
    "gt": ">",
    "le": "≤",
    "lt": "<",
    "min_length": "length ≥",
    "max_length": "length ≤",
}


def _bounds_text(metadata: list[Any]) -> str:
    bounds = []
    for item in metadata:
        for attribute, word in _BOUND_WORDS.items():
            value = getattr(item, attribute, None)
            if value is not None:
                bounds.append(f"{word} {value}")
        pattern = getattr(item, "pattern", None)
        if pattern is not None:
            bounds.append(f"matches `{pattern}`")
    return ", ".join(bounds)


# --- metrics ----------------------------------------------------------------------------------


class Metric(typing.NamedTuple):
    name: str
    kind: str
    labels: tuple[str, ...]
    help: str
    process: str

    def exposed(self) -> str:
        """The name a scrape shows: a counter's with ``_total``; a histogram's series by suffix."""
        suffixes = _EXPOSED.get(self.kind, ())
        if len(suffixes) == 1:
            return code(self.name + suffixes[0])
        return code(self.name) + (f" ({', '.join(code(s) for s in suffixes)})" if suffixes else "")


def declared_metrics() -> list[Metric]:
    """Every metric the metrics modules declare, read from their source: a call of a
    prometheus_client class (or the simulator's helper around one) with a literal name."""
    found = []
    for process, relative in METRICS_MODULES.items():
        tree = ast.parse((ROOT / relative).read_text("utf-8"))
        for scope, call in _calls(tree):
            metric = _metric(call, scope, process)
            if metric is not None:
                found.append(metric)
    return found


def _calls(tree: ast.AST) -> Iterator[tuple[ast.AST, ast.Call]]:
    """Each call with the innermost function around it (where its label names are assigned)."""
    scopes: list[ast.AST] = [tree]

    def walk(node: ast.AST) -> Iterator[tuple[ast.AST, ast.Call]]:
        is_scope = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if is_scope:
            scopes.append(node)
        if isinstance(node, ast.Call):
            yield scopes[-1], node
        for child in ast.iter_child_nodes(node):
            yield from walk(child)
        if is_scope:
            scopes.pop()

    yield from walk(tree)


def _metric(call: ast.Call, scope: ast.AST, process: str) -> Metric | None:
    func = call.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if called not in _METRIC_CALLS or len(call.args) < 2:
        return None
    name, doc = (arg.value if isinstance(arg, ast.Constant) else None for arg in call.args[:2])
    if not isinstance(name, str) or not isinstance(doc, str):
        return None  # a helper's own body, passing its parameters on
    labels_node: ast.expr | None = next((k.value for k in call.keywords if k.arg == "labels"), None)
    if labels_node is None and len(call.args) > 2:
        labels_node = call.args[2]
    if labels_node is None and called.islower():
        labels_node = _helper_labels(scope, called)
    labels = _label_names(labels_node, scope) if labels_node is not None else ()
    return Metric(name, _METRIC_CALLS[called], labels, " ".join(doc.split()), process)


def _helper_labels(scope: ast.AST, helper: str) -> ast.expr | None:
    """The labels a helper such as the simulator's ``gauge(name, doc)`` passes by itself."""
    for node in ast.walk(scope):
        if isinstance(node, ast.FunctionDef) and node.name == helper:
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and len(call.args) > 2:
                    return call.args[2]
    return None


def _label_names(node: ast.AST, scope: ast.AST) -> tuple[str, ...]:
    if isinstance(node, (ast.List, ast.Tuple)):
        return tuple(str(e.value) for e in node.elts if isinstance(e, ast.Constant))
    if isinstance(node, ast.Dict):
        names: list[str] = []
        for key, value in zip(node.keys, node.values, strict=True):
            names.extend(_label_names(value, scope) if key is None else [str(getattr(key, "value", key))])
        return tuple(names)
    if isinstance(node, ast.Call) and node.args:  # list(labels)
        return _label_names(node.args[0], scope)
    if isinstance(node, ast.Name):
        for assign in ast.walk(scope):
            if isinstance(assign, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == node.id for t in assign.targets
            ):
                return _label_names(assign.value, scope)
    return ()


def metrics_reference() -> str:
    out = []
    metrics = declared_metrics()
    for process, relative in METRICS_MODULES.items():
        rows = [
            (m.exposed(), m.kind, ", ".join(code(label) for label in m.labels) or _UNSET, cell(m.help))
            for m in sorted(metrics, key=lambda m: m.name)
            if m.process == process
        ]
        out.append(
            f"### {process.capitalize()} (`{relative}`)\n\n" + table(("name", "type", "labels", "help"), rows)
        )
    return "\n\n".join(out)


# --- alerts and the README --------------------------------------------------------------------


def alerts_reference() -> str:
    import yaml

    rules = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text("utf-8"))
    rows = [
        (
            code(rule["alert"]),
            rule.get("labels", {}).get("severity", ""),
            code(" ".join(str(rule["expr"]).split())),
            str(rule.get("for", "")),
            cell(rule.get("annotations", {}).get("description", "")),
        )
        for group in rules.get("groups", [])
        for rule in group.get("rules", [])
        if "alert" in rule
    ]
    return table(("alert", "severity", "expression", "for", "what to do"), rows)


def readme_for_site() -> str:
    """The README as the site's home page: links into ``docs/`` and to the benchmarks point at the
    site's pages; its first heading is the page's title."""
    text = (ROOT / "README.md").read_text("utf-8")
    text = text.replace("](docs/", "](").replace("](bench/README.md", "](benchmarks.md")
    return text


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "http": http_reference,
    "settings": settings_reference,
    "spec": spec_reference,
    "metrics": metrics_reference,
    "alerts": alerts_reference,
    "readme": readme_for_site,
}


def render(markdown: str) -> str:
    """A page's Markdown with each marker replaced by what it names; an unknown name is an error."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated section {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs hook: fill the page's generated sections; tables as Python-Markdown reads them."""
    return site_tables(render(markdown))
