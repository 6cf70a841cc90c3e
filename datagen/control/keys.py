"""Every Redis key and RQ name this project uses, built from the namespace in settings.

RQ's own keys (``rq:job:*``, ``rq:queue:*``, registries) are RQ's business; we only choose queue
names and job ids here.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

from datagen.states import Priority, PromptClass, sample_digest

__all__ = [
    "ARM_SEPARATOR",
    "FINISH_PREFIX",
    "OTHER_LABEL",
    "SEEN_SEGMENTS",
    "UNKNOWN_LABEL",
    "BreakdownField",
    "Keys",
    "partition_label",
    "prompt_key",
]

# Keys the seen rows of one job are spread over (`Keys.job_seen`): 16 x 512 MB of records.
SEEN_SEGMENTS = 16


@dataclass(frozen=True)
class Keys:
    namespace: str

    # RQ names ---------------------------------------------------------------------------------
    def queue_name(self, cls: PromptClass) -> str:
        return f"{self.namespace}-{cls.value}"

    def rq_job_id(self, job_id: str, sample_id: str, turn: int, gen: int) -> str:
        return f"{self.rq_job_prefix(job_id)}{sample_digest(sample_id)}-t{turn}-g{gen}"

    def rq_id_prefix(self) -> str:
        """What every RQ id of this namespace starts with; the job id follows, up to a ``-``."""
        return f"{self.namespace}-"

    def rq_job_prefix(self, job_id: str) -> str:
        """What every RQ id of the job starts with (job ids have no ``-``, so it is unambiguous)."""
        return f"{self.rq_id_prefix()}{job_id}-"

    def job_of_rq_id(self, rq_id: str) -> str | None:
        """The datagen job id inside an RQ job id built by :meth:`rq_job_id` (None if not ours)."""
        prefix = self.rq_id_prefix()
        if not rq_id.startswith(prefix):
            return None
        job, _, rest = rq_id[len(prefix) :].partition("-")
        return job if job and rest else None

    def rq_worker_name(self, worker_tag: str, cls: PromptClass) -> str:
        return f"{self.namespace}-{worker_tag}-{cls.value}"

    # Jobs ---------------------------------------------------------------------------------------
    def jobs_index(self) -> str:
        """Sorted set of job ids scored by creation time (ms)."""
        return f"{self.namespace}:jobs"

    def job(self, job_id: str) -> str:
        """Hash: state, spec, counters, timestamps."""
        return f"{self.job_key_prefix()}{job_id}"

    def job_enqueued(self, job_id: str) -> str:
        """Set of prompt keys already enqueued: the guard against enqueueing a prompt twice."""
        return f"{self.namespace}:job:{job_id}:enqueued"

    def job_rows(self, job_id: str) -> str:
        """Hash sample key -> ``<content digest>:<line>`` of the row that first used the sample id:
        a later row with the same id and other content is rejected, not silently dropped."""
        return f"{self.namespace}:job:{job_id}:rows"

    def job_seen(self, job_id: str, segment: int) -> str:
        """String of packed records of the rows ingestion kept (`datagen.hygiene.dedup.pack_records`),
        split over ``SEEN_SEGMENTS`` keys by chunk so none nears Redis's 512 MB string limit."""
        return f"{self.namespace}:job:{job_id}:seen:{segment}"

    def job_ingest_fence(self, job_id: str) -> str:
        """The ingest fence of a job an older version made, a key of its own. The fence is now a
        field of the job's hash (`datagen.control.jobs.INGEST_FENCE`), read and written with the
        job by the scripts that land chunks: one that a resume takes over (``ingest_take.lua``)
        moves there, a rebuild or a cancel drops it, and a delete removes it."""
        return f"{self.namespace}:job:{job_id}:ingest"

    def job_ingest_checkpoint(self, job_id: str) -> str:
        """The ingest checkpoint of a job an older version made, a key of its own; now the job's
        ``ingest_at`` field (``ingest_land.lua``). Only a run of that version read it, so nothing
        moves it: a delete removes it."""
        return f"{self.namespace}:job:{job_id}:ingest-at"

    def job_retry_lock(self, job_id: str) -> str:
        """Held while one retry of the job runs: concurrent retries are refused."""
        return f"{self.namespace}:job:{job_id}:retry-lock"

    def job_running(self, job_id: str) -> str:
        """Set of RQ ids of the job's prompts that a worker has started and not finished."""
        return f"{self.job_key_prefix()}{job_id}{self.running_suffix()}"

    def job_breakdown(self, job_id: str) -> str:
        """Hash ``{counter}|{partition label}|{class}`` -> count: progress by partition and class."""
        return f"{self.job_key_prefix()}{job_id}{self.breakdown_suffix()}"

    def job_partitions(self, job_id: str) -> str:
        """Set of the job's partitions that get their own metric label (the rest are ``other``)."""
        return f"{self.job_key_prefix()}{job_id}{self.partitions_suffix()}"

    # The claim and ack scripts build these per job from the prefix and suffix.
    def running_suffix(self) -> str:
        return ":running"

    def breakdown_suffix(self) -> str:
        return ":breakdown"

    def partitions_suffix(self) -> str:
        return ":partitions"

    def job_failed(self, job_id: str) -> str:
        """List of JSON failure reports (sample id, turn, reason), capped."""
        return f"{self.namespace}:job:{job_id}:failed"

    def job_backlog(self, job_id: str, cls: PromptClass) -> str:
        """List of the RQ ids of the job's undispatched prompts of one class (datagen/control/dispatch.py)."""
        return f"{self.job_key_prefix()}{job_id}{self.backlog_suffix(cls)}"

    def job_key_prefix(self) -> str:
        """:meth:`job` without the id: the dispatch script builds job and backlog keys from it."""
        return f"{self.namespace}:job:"

    def backlog_suffix(self, cls: PromptClass) -> str:
        return f":backlog:{cls.value}"

    def job_keys(self, job_id: str) -> list[str]:
        """Every key of one job (for deleting it); RQ's own keys are found separately."""
        fixed = [
            self.job(job_id),
            self.job_enqueued(job_id),
            self.job_running(job_id),
            self.job_breakdown(job_id),
            self.job_partitions(job_id),
            self.job_failed(job_id),
            self.job_rows(job_id),
            self.job_ingest_fence(job_id),
            self.job_ingest_checkpoint(job_id),
            self.job_retry_lock(job_id),
        ]
        seen = [self.job_seen(job_id, segment) for segment in range(SEEN_SEGMENTS)]
        return fixed + seen + [self.job_backlog(job_id, cls) for cls in PromptClass]

    # Dispatch across jobs -----------------------------------------------------------------------
    def dispatch_jobs(self, cls: PromptClass, priority: Priority) -> str:
        """Sorted set of the jobs with prompts of ``cls`` to dispatch at ``priority``, scored by
        virtual time (dispatches divided by weight): the lowest goes next."""
        return f"{self.namespace}:dispatch:{cls.value}:{priority.value}"

    def dispatch_weight(self, cls: PromptClass, priority: Priority) -> str:
        """Integer: the sum of the weights of the jobs in ``dispatch_jobs(cls, priority)``, in
        thousandths (each job at least 1), kept by the scripts that add and remove jobs
        (``weight_units`` in ``datagen/control/lua/lib.lua``, which spells it ``<set>:weight``)."""
        return f"{self.dispatch_jobs(cls, priority)}:weight"

    def dispatch_weights_mark(self) -> str:
        """Set once the dispatch sets' weight sums are kept (``dispatch_weights.lua`` computed them
        from the sets of a Redis filled before they were)."""
        return f"{self.namespace}:dispatch:weights-kept"

    def dispatch_window(self, bucket: int) -> str:
        """Hash job id -> prompts dispatched during one time bucket (the recent share), and
        ``*`` -> all of them."""
        return f"{self.namespace}:dispatch:window:{bucket}"

    def wake_channel(self) -> str:
        """Pub/sub channel: a class name is published whenever prompts of that class become
        claimable (enqueued, resumed, retried, handed back, reaped), waking idle workers."""
        return f"{self.namespace}:wake"

    def paused_jobs(self) -> str:
        """Set of paused job ids: their prompts are not dispatched."""
        return f"{self.namespace}:paused:jobs"

    def aborting_jobs(self) -> str:
        """Set of cancelled job ids whose in-flight prompts workers abort."""
        return f"{self.namespace}:aborting:jobs"

    # Recovery from a Redis that lost or rolled back its data -----------------------------------
    def epoch(self) -> str:
        """Hash ``{id, seq, rebuilt}``: ``id`` names this Redis dataset (gone: Redis lost its data),
        ``seq`` a counter that only grows while it lives (lower than a process saw: Redis went back
        to an older snapshot), ``rebuilt`` set by the coordinator that rebuilt what it lost
        (`datagen.control.epoch`)."""
        return f"{self.namespace}:epoch"

    def reconcile_lease(self) -> str:
        """Lease (`datagen.control.leases`) held by the one coordinator that holds the stored jobs
        to a Redis that lost or rolled back its data, until it settles the epoch."""
        return f"{self.namespace}:reconcile"

    def job_rebuild_lease(self, job_id: str) -> str:
        """Lease held while the job is rebuilt from storage (`service.rebuild`); its token fences
        the rebuild's writes. Not one of :meth:`job_keys`: dropping the job's state keeps it."""
        return f"{self.namespace}:job:{job_id}:rebuild"

    # Fleet --------------------------------------------------------------------------------------
    def servers_index(self) -> str:
        """Hash server name -> JSON of what a worker last saw of it (context length, model)."""
        return f"{self.namespace}:servers"

    def paused_queues(self) -> str:
        """Set of paused classes (``short``/``long``); survives coordinator restarts."""
        return f"{self.namespace}:paused:queues"

    def paused_servers(self) -> str:
        """Set of paused server names."""
        return f"{self.namespace}:paused:servers"

    def server_workers(self, server: str) -> str:
        """Hash worker name -> JSON of that worker's view of the server (state, in flight, limits)."""
        return f"{self.namespace}:server:{server}:workers"

    def server_control(self, server: str) -> str:
        """Hash with the server's shared in-flight factor, the reason of its last change, KV signals."""
        return f"{self.namespace}:server:{server}:control"

    def server_controller_lease(self, server: str) -> str:
        """Which worker runs the KV controller of the server (SET NX PX)."""
        return f"{self.namespace}:server:{server}:controller"

    # Recovery -----------------------------------------------------------------------------------
    def reaper_lock(self, queue_name: str) -> str:
        return f"{self.namespace}:reaper-lock:{queue_name}"

    def reaper_seen(self, queue_name: str) -> str:
        """Ids seen in the queue's intermediate list on the previous reaper pass."""
        return f"{self.namespace}:reaper-seen:{queue_name}"


def prompt_key(sample_id: str, turn: int, gen: int) -> str:
    """Member of :meth:`Keys.job_enqueued`; short because there is one per prompt."""
    return f"{sample_digest(sample_id)}:{turn}:{gen}"


# A job's breakdown hash (`Keys.job_breakdown`) has one field per (counter, partition label, class).
# `tally` and `count_cancelled_queued` in datagen/control/lua/lib.lua write the same form with the
# same literals (tests/datagen/test_lua_files.py holds them together).
BREAKDOWN_SEPARATOR = "|"
# The label of a partition beyond the job's labelled ones (a bounded label set).
OTHER_LABEL = "other"
# The label and class of a row rejected before its partition or class was known.
UNKNOWN_LABEL = "unknown"
# A finish reason counts as the counter ``finish:<reason>``.
FINISH_PREFIX = "finish:"
# A job with a recipe also counts its prompts per arm: the counter ``<counter>@<arm>`` (``done@low``)
# beside the plain one, so a plain counter's sum stays the job's. Arm names cannot hold it
# (`datagen.spec.ARM_NAME_PATTERN`); `tally` in datagen/control/lua/lib.lua writes the same literal.
ARM_SEPARATOR = "@"


class BreakdownField(NamedTuple):
    """One field of a job's breakdown: ``counter|label|class``."""

    counter: str
    label: str
    cls: str

    def encode(self) -> str:
        return BREAKDOWN_SEPARATOR.join(self)

    @classmethod
    def decode(cls, field: str) -> BreakdownField:
        counter, label, klass = field.split(BREAKDOWN_SEPARATOR, 2)
        return cls(counter, label, klass)

    @property
    def finish(self) -> str | None:
        """The finish reason this field counts, or None for another counter."""
        return self.counter.removeprefix(FINISH_PREFIX) if self.counter.startswith(FINISH_PREFIX) else None

    @classmethod
    def of_arm(cls, counter: str, arm: str, label: str, klass: str) -> BreakdownField:
        """The field that counts ``counter`` of one recipe arm (``done@low|label|class``)."""
        return cls(f"{counter}{ARM_SEPARATOR}{arm}", label, klass)

    @property
    def arm(self) -> str | None:
        """The recipe arm a per-arm field counts (``low`` of ``done@low``), or None for a plain one."""
        _, sep, arm = self.counter.partition(ARM_SEPARATOR)
        return arm if sep else None

    @property
    def base(self) -> str:
        """The counter without its arm (``done`` of ``done@low``; a plain counter as it is)."""
        return self.counter.partition(ARM_SEPARATOR)[0]


def partition_label(partition: str, labelled: Collection[str]) -> str:
    """A prompt's partition as its job's metrics label it."""
    return partition if partition in labelled else OTHER_LABEL
