"""Reading a Prometheus text exposition (a process's /metrics page)."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["metric", "metric_labels", "metric_value"]


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in Prometheus text whose labels include ``labels`` (0 if none)."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if match is None:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def metric(text: str, name: str) -> float:
    """The sum of all samples called ``name``, parsed by prometheus_client; KeyError if none."""
    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
                found = True
    if not found:
        raise KeyError(name)
    return total


def metric_labels(text: str, name: str) -> list[dict[str, str]]:
    return [
        dict(sample.labels)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]
