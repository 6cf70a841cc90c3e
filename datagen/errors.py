"""The one exception tree of the project.

    DatagenError
    ├── RetryableError              try again later, elsewhere, or after a backoff
    │   ├── ServerUnavailableError  connection refused/reset, 503, server starting or shutting down
    │   ├── RequestTimeoutError     connect or read timeout talking to a server
    │   ├── ServerError             500 and other 5xx, unparseable replies
    │   ├── GenerationAbortedError  finish_reason type "abort" (retraction OOM, waiting-queue abort, ...)
    │   ├── DuplicateRequestError   400 "Duplicate request ID": an earlier attempt is still running
    │   └── StorageError            writing a shard or manifest failed; records were not committed
    └── FatalError                  retrying cannot help; the prompt or request must change
        ├── BadRequestError         400 from SGLang: prompt too long, bad sampling values, ...
        ├── InvalidSpecError        a job spec that cannot run (tokenizer, template, limits)
        │   └── PreflightError      the spec, its tokenizer and the servers do not fit together
        ├── InvalidRowError         one dataset row that cannot become a prompt
        ├── JobNotFoundError        no job with that id
        ├── JobStateError           the job's state forbids the operation (delete while running)
        └── ConfigError             settings or environment that cannot start a process

Lower-level errors (httpx, redis, OSError) are translated into these at one boundary with
``raise ... from exc``; the HTTP layer maps them to status codes in one place.
"""

from __future__ import annotations

__all__ = [
    "BadRequestError",
    "ConfigError",
    "DatagenError",
    "DuplicateRequestError",
    "FatalError",
    "GenerationAbortedError",
    "InvalidRowError",
    "InvalidSpecError",
    "JobNotFoundError",
    "JobStateError",
    "PreflightError",
    "RequestTimeoutError",
    "RetryableError",
    "ServerError",
    "ServerUnavailableError",
    "StorageError",
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


class FatalError(DatagenError):
    """Retrying the same request cannot succeed."""


class BadRequestError(FatalError):
    pass


class InvalidSpecError(FatalError):
    pass


class PreflightError(InvalidSpecError):
    """A pre-flight check refused a job, or kept a worker off a server (:mod:`datagen.preflight`).

    The message names what disagrees and what to fix; the coordinator answers 409 Conflict.
    """


class InvalidRowError(FatalError):
    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class JobNotFoundError(FatalError):
    pass


class JobStateError(FatalError):
    """The operation does not fit the job's state (deleting a running job, resuming a finished one)."""


class ConfigError(FatalError):
    pass
