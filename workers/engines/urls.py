"""A server's URL as every message shows it and every client checks it.

A URL may carry a secret (``user:password@``, or a token in a query string or fragment): clients
refuse such a URL (the key is a setting, sent as a bearer token), and whatever shows a server shows
:func:`shown_url`. The fleet's ``--server`` parsing (:class:`workers.fleet.servers.ServerSpec`) and
the engines' clients read a URL by these same rules.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from datagen.states import EngineChoice

__all__ = ["default_name", "engine_prefix", "shown_url", "url_secret"]

# What a server URL may not hold (its credentials, or a query string or fragment that may hold a
# token), and what to do instead; {name} is the server's name.
_CREDENTIALS_FIX = (
    "put credentials in DATAGEN_SERVER_API_KEYS ({name}=KEY), not in the URL; the worker sends a "
    "server's key as a bearer token, the one the server was started with --api-key"
)
_QUERY_FIX = (
    "a server URL takes no query string or fragment; give {shown}, and put a token in "
    "DATAGEN_SERVER_API_KEYS ({name}=KEY)"
)
# Shown for a URL whose secret cannot be told apart from the rest (an '@' after a '?' or '#').
_HIDDEN = "***"


def shown_url(url: str) -> str:
    """``url`` as every log line, message and published view shows a server: without its
    ``user:password@`` part, query string and fragment, any of which may hold a secret.

    Works on any text, parsed or not: everything up to the last ``@`` and from the first ``?`` or
    ``#`` is dropped; where an ``@`` follows a ``?`` or ``#`` (a query holding an ``@``, or a password
    holding a ``?``) nothing after the scheme is shown.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    start = rest.rfind("@") + 1
    end = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    return f"{scheme}{sep}{rest[start:end] if end >= start else _HIDDEN}"


def url_secret(url: str, *, name: str = "") -> str | None:
    """Why ``url`` cannot be a server's URL, and what to do instead, when it may carry a secret
    (an ``@``, ``?`` or ``#`` anywhere); None when it carries none. The message names the server
    ``name``, else the name a bare URL gets (``host-port``), and never shows the secret."""
    if "@" in url:
        fix = _CREDENTIALS_FIX
    elif "?" in url or "#" in url:
        fix = _QUERY_FIX
    else:
        return None
    shown = shown_url(url.strip())
    name = name or default_name(engine_prefix(shown)[1]) or ""
    return f"server {name or shown}: " + fix.format(name=name or "NAME", shown=shown)


def engine_prefix(url: str) -> tuple[EngineChoice, str]:
    """The engine a ``vllm+`` or ``sglang+`` scheme names (else ``auto``) and the URL without it."""
    prefix, plus, rest = url.partition("+")
    if plus and prefix in (EngineChoice.SGLANG, EngineChoice.VLLM):
        return EngineChoice(prefix), rest
    return EngineChoice.AUTO, url


def default_name(url: str) -> str | None:
    """``host-port``, the name of a server given by its bare URL; None when ``url`` is not an
    ``http(s)://host[:port]`` URL whose port is a number."""
    try:
        parsed = urlsplit(url)
        port = parsed.port
    except ValueError:  # a port that is no number, or a broken [IPv6] host
        return None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return None
    return f"{parsed.hostname}-{port or (443 if parsed.scheme == 'https' else 80)}"
