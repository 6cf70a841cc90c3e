"""The one exception tree of the project, and the HTTP status of each error.

    DatagenError
    ├── RetryableError              try again later, elsewhere, or after a backoff           503
    │   ├── ServerUnavailableError  connection refused/reset, 503, server starting or shutting down
    │   ├── RequestTimeoutError     connect or read timeout talking to a server
    │   ├── ServerError             500 and other 5xx, unparseable replies
    │   ├── GenerationAbortedError  finish_reason type "abort" (retraction OOM, waiting-queue abort, ...)
    │   ├── DuplicateRequestError   400 "Duplicate request ID": an earlier attempt is still running
    │   ├── StorageError            writing a shard or manifest failed; records were not committed
    │   ├── CaptureFileError        a capture server's hidden-states file is missing, late, truncated,
    │   │                           short, non-finite or not the sequence sent (datagen.features)
    │   ├── BackendUnavailableError the coordinator cannot reach Redis
    │   └── RedisOutOfMemoryError   Redis at maxmemory refuses writes (raise it, or queue less)
    └── FatalError                  retrying cannot help; the prompt or request must change   400
        ├── BadRequestError         400 from SGLang: prompt too long, bad sampling values, ...
        ├── InvalidSpecError        a job spec that cannot run (tokenizer, template, limits)
        │   └── PreflightError      the spec, its tokenizer and the servers do not fit together 409
        │       ├── NoServersYetError no live worker has reported a server yet (a wait may help)
        │       └── CaptureMismatchError a capture server's files do not fit the job (dtype,
        │                                layer count, hidden size): that server is set up otherwise
        ├── InvalidRowError         one dataset row that cannot become a prompt
        ├── UploadTooLargeError     an upload over DATAGEN_MAX_UPLOAD_BYTES                    413
        ├── NotFoundError           no such thing                                              404
        │   ├── JobNotFoundError    no job with that id
        │   ├── UnknownServerError  no worker has reported a server of that name
        │   └── UnknownQueueError   no queue of that name
        ├── JobStateError           the job's state forbids the operation (delete while running) 409
        │   └── ForeignFileError    a job's stored manifest or ending marker that is not the job's
        │                           (copied or planted from another job): refused, never acted on
        ├── CorruptShardError       a committed shard that differs from its commit object or cannot
        │                           be decoded (changed, truncated or missing after its commit)
        ├── AuthError               a missing or wrong bearer token                            401
        ├── InvalidRequestError     parameters or a body that do not match the HTTP API         422
        └── ConfigError             settings or environment that cannot start a process
            └── CoordinatorUnreachableError  the CLI cannot reach the coordinator (client side)

Lower-level errors (httpx, redis, OSError) are translated into these at one boundary with
``raise ... from exc``. :data:`HTTP_STATUS` is the one table both sides of the HTTP API use: the
coordinator answers ``{"error": message, "type": class name}`` with :func:`http_status`, and the
client rebuilds the same class with :func:`error_from_http`.
"""

from __future__ import annotations

__all__ = [
    "HTTP_STATUS",
    "AuthError",
    "BackendUnavailableError",
    "BadRequestError",
    "CaptureFileError",
    "CaptureMismatchError",
    "ConfigError",
    "CoordinatorUnreachableError",
    "CorruptShardError",
    "DatagenError",
    "DuplicateRequestError",
    "FatalError",
    "ForeignFileError",
    "GenerationAbortedError",
    "InvalidRequestError",
    "InvalidRowError",
    "InvalidSpecError",
    "JobNotFoundError",
    "JobStateError",
    "NoServersYetError",
    "NotFoundError",
    "PreflightError",
    "RedisOutOfMemoryError",
    "RequestTimeoutError",
    "RetryableError",
    "ServerError",
    "ServerUnavailableError",
    "StorageError",
    "UnknownQueueError",
    "UnknownServerError",
    "UploadTooLargeError",
    "error_from_http",
    "http_status",
    "status_error_class",
]


class DatagenError(Exception):
    """Root of every error this project raises on purpose."""


class RetryableError(DatagenError):
    """The same work may succeed later; it must not be reported as a final failure yet."""

    # When True the failure is the server's fault (down, restarting), so the attempt is not
    # charged to the prompt: a fleet restart must not fail prompts.
    server_fault: bool = False


class ServerUnavailableError(RetryableError):
    server_fault = True


class RequestTimeoutError(RetryableError):
    pass


class ServerError(RetryableError):
    pass


class GenerationAbortedError(RetryableError):
    pass


class DuplicateRequestError(RetryableError):
    pass


class StorageError(RetryableError):
    pass


class CaptureFileError(RetryableError):
    """A capture server's hidden-states file that cannot be stored as it is: missing, not finished
    in time, truncated, shorter than the sequence sent (an abort mid-prefill), holding other token
    ids, or non-finite values (`datagen.features`). Sending the sequence again writes a new file,
    so the attempt may be repeated; the message names the file and what is wrong with it."""


class BackendUnavailableError(RetryableError):
    """The coordinator's Redis did not answer; the request may be repeated as it was."""


class RedisOutOfMemoryError(RetryableError):
    """Redis is over its ``maxmemory`` and refuses writes (``noeviction``); the request may be
    repeated as it was once memory is freed or the limit raised (`datagen.control.redismemory`)."""


class FatalError(DatagenError):
    """Retrying the same request cannot succeed."""


class BadRequestError(FatalError):
    pass


class InvalidSpecError(FatalError):
    pass


class PreflightError(InvalidSpecError):
    """A pre-flight check refused a job, or kept a worker off a server (:mod:`datagen.prompts.preflight`).

    The message names what disagrees and what to fix; the coordinator answers 409 Conflict.
    """


class CaptureMismatchError(PreflightError):
    """A capture server's file whose layout does not fit the job: an FP8 file for a bf16 job, a
    model dtype the job cannot store, another layer count or hidden size. These follow from how
    the server was started (its connector, ``--dtype``, layer ids, model), so sending the same
    sequence to it again writes the same kind of file: the worker refuses that server until its
    next probe learns what it writes now, and tries the capture elsewhere (`workers.run.capture`)."""


class NoServersYetError(PreflightError):
    """Refused only because no live worker has reported a server yet (so the context length is
    unknown): the same submit passes once a worker has probed its server. ``datagen submit`` waits
    on this one (``--wait-for-servers-s``) and not on any other refusal."""


class InvalidRowError(FatalError):
    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class UploadTooLargeError(FatalError):
    pass


class NotFoundError(FatalError):
    """The thing a request names does not exist."""


class JobNotFoundError(NotFoundError):
    pass


class UnknownServerError(NotFoundError):
    pass


class UnknownQueueError(NotFoundError):
    pass


class JobStateError(FatalError):
    """The operation does not fit the job's state (deleting a running job, resuming a finished one)."""


class ForeignFileError(JobStateError):
    """A file in a job's storage folder that names another job (or another incarnation or ending
    than it should): a rebuild neither starts from it nor drops a job for it
    (`datagen.records.belonging`). The message names the file."""


class CorruptShardError(FatalError):
    """A committed shard whose bytes or row count are not what its commit object says, or that
    cannot be decoded: reading it again cannot help. ``path`` is where the shard is, ``problem``
    what differs, ``records`` the rows its commit object counts (what skipping it loses)."""

    def __init__(self, message: str, *, path: str = "", problem: str = "", records: int = 0) -> None:
        super().__init__(message)
        self.path = path
        self.problem = problem or message
        self.records = records


class AuthError(FatalError):
    pass


class InvalidRequestError(FatalError):
    pass


class ConfigError(FatalError):
    pass


class CoordinatorUnreachableError(ConfigError):
    """The CLI got no answer from the coordinator (not started yet, or a wrong URL); never sent
    over HTTP."""


# Looked up along the class's MRO, so a subclass without an entry answers as its nearest ancestor.
HTTP_STATUS: dict[type[DatagenError], int] = {
    DatagenError: 500,
    RetryableError: 503,
    FatalError: 400,
    PreflightError: 409,
    JobStateError: 409,
    NotFoundError: 404,
    UploadTooLargeError: 413,
    AuthError: 401,
    InvalidRequestError: 422,
}

_STATUS_FALLBACK: dict[int, type[DatagenError]] = {
    400: FatalError,
    401: AuthError,
    404: NotFoundError,
    409: JobStateError,
    413: UploadTooLargeError,
    422: InvalidRequestError,
    503: RetryableError,
}


def _tree(root: type[DatagenError]) -> dict[str, type[DatagenError]]:
    # Only this module's classes: a name in an answer must never build an arbitrary class.
    found = {root.__name__: root} if root.__module__ == __name__ else {}
    for sub in root.__subclasses__():
        found.update(_tree(sub))
    return found


def http_status(exc: DatagenError) -> int:
    for cls in type(exc).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return HTTP_STATUS[DatagenError]


def status_error_class(status: int) -> type[DatagenError]:
    """The class that stands for a status when nothing more specific is known."""
    return _STATUS_FALLBACK.get(status, InvalidRequestError if 400 <= status < 500 else DatagenError)


def error_from_http(status: int, type_name: object, message: str) -> DatagenError:
    """The error a coordinator's answer stands for: its class by name, else by status."""
    cls = _tree(DatagenError).get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        cls = status_error_class(status)
    return cls(message)
