"""``datagen pull``: a job's committed records (and features) written into a directory as they commit,
for a trainer that runs beside the job (`datagen.export.pull` has the layout and the guarantees).

Records are read from storage directly, as ``export`` reads them; the coordinator is asked only with
``--follow`` (whether the job has ended) and ``--consume`` (acknowledging features files).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from datagen.errors import ConfigError, CoordinatorUnreachableError, RetryableError
from datagen.settings import ClientSettings, load
from datagen.states import JobState
from datagen_cli._app import EXIT_CHECK_FAILED, app, console, examples
from datagen_cli._options import CoordinatorOption
from datagen_cli.data import JOB_ID_HELP, STORAGE_HELP

if TYPE_CHECKING:
    from datagen.export.pull import Puller, ShardPulled
    from datagen_cli.client import CoordinatorClient

DEFAULT_PULL_POLL_S = 2.0
MIN_PULL_POLL_S = 0.05
# A pull that ended with features files its --consume could not acknowledge (the coordinator out of
# reach): everything is pulled, but storage still holds them; run the same pull again to send them.
EXIT_UNACKNOWLEDGED = EXIT_CHECK_FAILED


def _warn(message: str) -> None:
    console.print(Text.assemble(("warning:", "yellow"), " ", message), soft_wrap=True, highlight=False)


def _show(shard: ShardPulled) -> None:
    where = shard.part or "no part (no new rows)"
    left_out = f"{shard.duplicates} duplicates, {shard.no_features} without features"
    size = shard.records_bytes + shard.features_bytes
    console.print(
        f"pulled shard {shard.shard}: {shard.rows} rows ({left_out}), {size} bytes → {where}",
        soft_wrap=True,
        highlight=False,
        markup=False,
    )


def _job_state(client: CoordinatorClient, job_id: str, wait_s: float = 0.0) -> JobState | None:
    """The job's state; None when the coordinator is out of reach for now (a restart: the pull goes on)."""
    try:
        return JobState(client.job(job_id, wait_s=wait_s)["state"])
    except (RetryableError, CoordinatorUnreachableError) as exc:
        _warn(f"cannot read job {job_id}'s state yet (trying again): {exc}")
        return None


def _follow(
    client: CoordinatorClient, puller: Puller, job_id: str, first: JobState, poll_s: float
) -> JobState:
    """Pull until the job has ended and every commit is pulled; returns how it ended. Each state is
    read before the commits are listed, so the pull that follows an ended state sees the job's last
    commit."""
    state: JobState | None = first
    while True:
        puller.pull_available()
        if state is not None and state.is_final:
            return state
        asked_s = time.monotonic()
        # A long poll: it answers as soon as the job ends, so the last pull comes then.
        state = _job_state(client, job_id, wait_s=poll_s)
        if state is None or not state.is_final:
            time.sleep(max(0.0, poll_s - (time.monotonic() - asked_s)))


@app.command(
    epilog=examples(
        "datagen pull JOB_ID train/",
        "datagen pull JOB_ID train/ --follow",
        "datagen pull JOB_ID train/ --follow --consume --poll-s 5",
    )
)
def pull(
    job_id: Annotated[str, typer.Argument(help=JOB_ID_HELP)],
    out: Annotated[
        Path,
        typer.Argument(metavar="DIR", help="the directory to pull into (new, empty, or an earlier pull's)"),
    ],
    follow: Annotated[
        bool, typer.Option("--follow", help="keep pulling new commits until the job has ended")
    ] = False,
    consume: Annotated[
        bool,
        typer.Option(
            "--consume",
            help="once a shard is pulled, let storage free its features files (needs a coordinator)",
        ),
    ] = False,
    poll_s: Annotated[
        float,
        typer.Option(
            min=MIN_PULL_POLL_S,
            help="with --follow: seconds between looks at the job and its commits",
        ),
    ] = DEFAULT_PULL_POLL_S,
    storage: Annotated[str | None, typer.Option(help=STORAGE_HELP)] = None,
    coordinator: CoordinatorOption = None,
) -> None:
    """Pull a job's records (and features) into DIR as they commit.

    Writes DIR/records/part-NNNNNN.jsonl (a line a row: index, id, input_ids, loss_mask, seq_len,
    hidden_states) and, for a job with features, DIR/hidden_states/hs_INDEX.safetensors. Run it
    again (or after a crash) on the same DIR: it goes on where it stopped, writing nothing twice.
    Prints a line per shard on stderr and a one-line JSON summary on stdout. Exit 0; 1 when
    --consume could not acknowledge every features file (run it again); 3 on an error.
    """
    from datagen.export.pull import Puller
    from datagen.records.storage import Storage
    from datagen_cli.client import CoordinatorClient

    settings = load(ClientSettings, storage=storage, coordinator_url=coordinator)
    started_s = time.monotonic()
    needs_coordinator = follow or consume
    with CoordinatorClient(settings.coordinator_url, api_token=settings.api_token) as client:
        # An unknown job fails here, in one line (404), before anything is written.
        job_state = JobState(client.job(job_id)["state"]) if needs_coordinator else None
        store = Storage(settings.storage)
        if not store.job_exists(job_id):
            raise ConfigError(f"no job {job_id} under {store.root}; check --storage / DATAGEN_STORAGE")

        def acknowledge(names: list[str]) -> dict[str, Any]:
            return client.consume_features(job_id, names)

        pulled: list[ShardPulled] = []

        def on_shard(shard: ShardPulled) -> None:
            pulled.append(shard)
            _show(shard)

        with Puller(
            store, job_id, out, consume=acknowledge if consume else None, on_shard=on_shard, on_warning=_warn
        ) as puller:
            if job_state is not None and follow:
                job_state = _follow(client, puller, job_id, job_state, poll_s)
            else:
                puller.pull_available()
            state = puller.state
    summary = {
        "job": job_id,
        "dir": str(out),
        "job_state": None if job_state is None else job_state.value,
        "pulled_shards": len(pulled),
        "pulled_rows": sum(s.rows for s in pulled),
        **vars(state.counts),
        "next_index": state.next_index,
        "unacknowledged": len(state.unconsumed),
        "elapsed_s": round(time.monotonic() - started_s, 3),
    }
    typer.echo(json.dumps(summary))
    if state.unconsumed:
        _warn(
            f"{len(state.unconsumed)} features files are pulled but not yet acknowledged; run the same "
            "`datagen pull … --consume` again once the coordinator answers"
        )
        raise typer.Exit(EXIT_UNACKNOWLEDGED)
