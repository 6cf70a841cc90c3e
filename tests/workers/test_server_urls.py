"""No secret shown (issue 36, item 5): a server URL never carries credentials, a query string or a
fragment. The worker refuses one at startup with one line that names the fix and not the secret,
so no log line, error message, metric label or published view (``GET /servers``) can show it, and
a password in a URL can never stand in for the server's API key (httpx would send it as basic auth
in place of the bearer key). :func:`workers.engines.urls.shown_url` renders a server URL wherever one is
shown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from datagen.errors import ConfigError
from datagen_cli.local.processes import child_env
from datagen_cli.local.redis_server import free_port
from workers.engines.detect import EngineProbe
from workers.engines.http import ClientTimeouts
from workers.engines.sglang import SGLangClient
from workers.engines.urls import shown_url, url_secret
from workers.engines.vllm import VllmClient
from workers.fleet.servers import ServerSpec

SECRET = "PASSWORD"
CREDENTIALS_FIX = "put credentials in DATAGEN_SERVER_API_KEYS ({name}=KEY), not in the URL"
QUERY_FIX = "a server URL takes no query string or fragment; give {shown}, and put a token in "


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://gpu0:30000", "http://gpu0:30000"),
        ("http://admin:PASSWORD@gpu0:30000", "http://gpu0:30000"),
        ("https://:PASSWORD@gpu0/v1", "https://gpu0/v1"),
        ("vllm+http://admin:PASSWORD@gpu1:8000", "vllm+http://gpu1:8000"),
        ("http://admin:PASS/WORD@gpu0:30000", "http://gpu0:30000"),
        ("http://gpu0:30000/?token=PASSWORD", "http://gpu0:30000/"),
        ("http://gpu0:30000#PASSWORD", "http://gpu0:30000"),
        ("admin:PASSWORD@gpu0:30000", "gpu0:30000"),
        ("s2=http://admin:PASSWORD@gpu0:30000", "s2=http://gpu0:30000"),
        # An '@' after a '?': a query holding an '@', or a password holding a '?'; neither is shown.
        ("http://gpu0/?to=a@PASSWORD", "http://***"),
        ("http://admin:PASS?WORD@gpu0:30000", "http://***"),
    ],
)
def test_a_url_is_shown_without_credentials_query_or_fragment(url: str, shown: str) -> None:
    assert shown_url(url) == shown


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "s2=http://admin:PASSWORD@gpu0:30000",
            "server s2: " + CREDENTIALS_FIX.format(name="s2"),
        ),
        (
            "s2=vllm+http://admin:PASSWORD@gpu1:8000",
            "server s2: " + CREDENTIALS_FIX.format(name="s2"),
        ),
        (  # a bare URL: the name it would get is the one to give the key
            "http://admin:PASSWORD@gpu0:30000",
            "server gpu0-30000: " + CREDENTIALS_FIX.format(name="gpu0-30000"),
        ),
        (  # an '=' in the password does not make its first half a name
            "http://admin:PASS=WORD@gpu0:30000",
            "server gpu0-30000: " + CREDENTIALS_FIX.format(name="gpu0-30000"),
        ),
        ("s2=https://PASSWORD@gpu0", "server s2: " + CREDENTIALS_FIX.format(name="s2")),
        (
            "s2=http://gpu0:30000/?token=PASSWORD",
            "server s2: " + QUERY_FIX.format(shown="http://gpu0:30000/") + "DATAGEN_SERVER_API_KEYS (s2=KEY)",
        ),
        (
            "http://gpu0:30000?token=PASSWORD",
            "server gpu0-30000: "
            + QUERY_FIX.format(shown="http://gpu0:30000")
            + "DATAGEN_SERVER_API_KEYS (gpu0-30000=KEY)",
        ),
        (
            "s2=http://gpu0:30000#PASSWORD",
            "server s2: " + QUERY_FIX.format(shown="http://gpu0:30000") + "DATAGEN_SERVER_API_KEYS (s2=KEY)",
        ),
    ],
)
def test_a_url_with_a_secret_is_refused_without_showing_it(value: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        ServerSpec.parse(value)
    assert str(refused.value).startswith(message)
    assert SECRET not in str(refused.value)
    with pytest.raises(ValueError) as refused_in_a_list:
        ServerSpec.parse_many([f"s0=http://gpu9:30000,{value}"])
    assert str(refused_in_a_list.value) == str(refused.value)


@pytest.mark.parametrize(
    "values",
    [
        # A ',' in the password splits it over two entries of the comma list.
        ["s2=http://admin:PASS,WORD@gpu0:30000"],
        ["s2=http://gpu0:30000/?token=PASS,WORD"],
        ["s1=http://gpu1:30000", "s2=http://admin:PASS,WORD@gpu0:30000"],
    ],
)
def test_a_secret_split_by_the_comma_list_is_not_shown_in_part(values: list[str]) -> None:
    with pytest.raises(ValueError) as refused:
        ServerSpec.parse_many(values)
    message = str(refused.value)
    assert "DATAGEN_SERVER_API_KEYS" in message
    assert not any(part in message for part in ("PASS", "WORD")), message


def test_urls_without_secrets_parse_as_before() -> None:
    assert url_secret("http://gpu0:30000/v1", name="g0") is None
    assert ServerSpec.parse_many(["g0=http://gpu0:30000/,http://gpu1:8000"]) == [
        ServerSpec("g0", "http://gpu0:30000"),
        ServerSpec("gpu1-8000", "http://gpu1:8000"),
    ]
    with pytest.raises(ValueError) as refused:
        ServerSpec.parse("g0=http://gpu0:port")
    assert str(refused.value).startswith("server 'g0=http://gpu0:port': expected NAME=http://host:port")


@pytest.mark.parametrize("client_class", [SGLangClient, VllmClient, EngineProbe])
def test_a_client_refuses_a_url_with_a_secret(client_class: type[SGLangClient]) -> None:
    # Whoever builds a client without ServerSpec (a benchmark, a library user) meets the same rule:
    # httpx would send the URL's user and password as basic auth, in place of the API key.
    timeouts = ClientTimeouts()
    with pytest.raises(ConfigError) as refused:
        client_class("s2", "http://admin:PASSWORD@gpu0:30000", timeouts=timeouts, max_connections=1)
    assert str(refused.value).startswith("server s2: " + CREDENTIALS_FIX.format(name="s2"))
    with pytest.raises(ConfigError) as refused:
        client_class("s2", "http://gpu0:30000/?token=PASSWORD", timeouts=timeouts, max_connections=1)
    assert str(refused.value).startswith("server s2: " + QUERY_FIX.format(shown="http://gpu0:30000/"))
    assert SECRET not in str(refused.value)


# -- the worker process ---------------------------------------------------------------------


def _worker(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = child_env(
        {
            # Nothing listens there: a worker that got past its servers would fail on Redis instead.
            "DATAGEN_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "DATAGEN_STORAGE": str(tmp_path / "data"),
            "DATAGEN_STARTUP_TIMEOUT_S": "1",
            "DATAGEN_METRICS_PORT": "0",
            **env,
        }
    )
    command = [sys.executable, "-m", "datagen_cli", "worker", *args]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            ["--server", "s2=http://admin:PASSWORD@127.0.0.1:9"],
            # A key for s2 as well: the URL's password must never win over it, nor be blamed on it.
            {"DATAGEN_SERVER_API_KEYS": "s2=sk-s2-7f3a9c"},
            "error: server s2: " + CREDENTIALS_FIX.format(name="s2"),
        ),
        (
            [],
            {"DATAGEN_SERVERS": "s1=http://127.0.0.1:8,s2=http://127.0.0.1:9/?token=PASSWORD"},
            "error: server s2: " + QUERY_FIX.format(shown="http://127.0.0.1:9/"),
        ),
    ],
)
def test_the_worker_refuses_a_url_with_a_secret_in_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], line: str
) -> None:
    result = _worker(tmp_path, *args, **env)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "Traceback" not in output, output
    assert [x for x in result.stderr.splitlines() if x.strip()] == [result.stderr.strip()], output
    assert result.stderr.startswith(line), output
    assert SECRET not in output, output
    assert "sk-s2-7f3a9c" not in output, output


def test_two_names_for_one_url_are_refused() -> None:
    with pytest.raises(ValueError) as refused:
        ServerSpec.parse_many(["s0=http://127.0.0.1:30000", "http://127.0.0.1:30000/"])
    assert str(refused.value) == (
        "servers s0 and 127.0.0.1-30000 are one server (http://127.0.0.1:30000): give each URL once, as "
        "--server s0=http://127.0.0.1:30000"
    )
    # One URL per engine prefix is still one server.
    with pytest.raises(ValueError, match="servers a and b are one server"):
        ServerSpec.parse_many(["a=vllm+http://gpu0:8000,b=http://GPU0:8000"])


def test_the_worker_refuses_a_second_name_for_a_url_in_one_line(tmp_path: Path) -> None:
    result = _worker(tmp_path, "--server", "s0=http://127.0.0.1:30000", "--server", "http://127.0.0.1:30000")
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert result.stderr.strip() == (
        "error: servers s0 and 127.0.0.1-30000 are one server (http://127.0.0.1:30000): give each URL "
        "once, as --server s0=http://127.0.0.1:30000"
    ), output
