"""The ``datagen`` command line: one Typer app, one module per command group.

- ``_app``: the app, the shared console, exit codes, ``--debug`` and ``main()`` (the console
  script), which turns every failure a user can meet into one ``error:`` line
- ``_fleet_wait``: ``submit``'s wait for a coordinator and workers that are still starting
- ``serve``: the long-lived processes: ``coordinator``, ``worker``, ``sim``
- ``submit``: ``spec`` and ``submit``
- ``watch``: watch jobs: ``status``, ``wait``
- ``steer``: steer jobs: ``pause``, ``resume``, ``cancel``, ``retry``, ``recover``, ``delete``
- ``waiting``: the one-line progress of a job that ``submit --wait`` and the demo print
- ``data``: a job's stored records: ``export``, ``report``
- ``pull``: ``pull``, a job's records (and features) into a directory as they commit
- ``demo``: ``demo``
- ``local``: the processes a laptop runs for the demo and the tests (a private Redis, children
  with their logs)

This package stands above ``datagen`` (the core), ``service``, ``workers`` and ``simulator``, and
none of them imports it. Commands import the process they start inside the function, so
``datagen --help`` loads none of them.
"""

from datagen_cli._app import app, main

# Each module registers its commands on `app` when imported; this order is the order of `datagen --help`.
# isort: off
from datagen_cli import serve, submit, watch, steer, data, pull, demo  # noqa: F401
# isort: on

__all__ = ["app", "main"]
