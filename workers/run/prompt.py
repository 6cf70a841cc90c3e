"""The life of one claimed prompt, as an asyncio task: count it started, generate, commit the record,
then record how it ended (:mod:`workers.run.finish`) even through a Redis outage. Its conversation's
next turn (multi-turn ``all``) is built between the generation and the commit, and written into the
record, so storage holds it with the turn; a next turn that cannot be built ends the conversation,
never the prompt, and a prompt whose record is committed is never failed. A job with features has the
record's hidden states captured and stored before its commit (`workers.run.capture`).

A task cancelled because its job was cancelled with abort finishes as cancelled; one cancelled for
any other reason (a hard stop) hands its prompt back to the queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from datagen.control.jobs import JobStore
from datagen.control.payload import ParsedPayload
from datagen.errors import FatalError, JobNotFoundError
from datagen.states import PromptClass
from workers.claim.admission import Slots
from workers.claim.rqbridge import InFlight, QueueIdentity
from workers.run.capture import Capturer
from workers.run.finish import Finisher, is_final
from workers.run.generate import Generator
from workers.run.redisretry import while_redis_down
from workers.run.writer import RecordWriter

__all__ = ["PromptRunner"]

log = logging.getLogger(__name__)


class PromptRunner:
    def __init__(
        self,
        slots: Slots,
        jobs: JobStore,
        generator: Generator,
        writer: RecordWriter,
        finisher: Finisher,
        capturer: Capturer | None = None,
    ) -> None:
        self.capturer = capturer
        self.slots = slots
        self.jobs = jobs
        self.generator = generator
        self.writer = writer
        self.finisher = finisher

    async def run(
        self, identity: QueueIdentity, item: InFlight, parsed: ParsedPayload, cls: PromptClass
    ) -> None:
        """``parsed``: the payload of ``item``, read once at its claim (`workers.claim.admission`)."""
        # The claim put the prompt in its job's running set and RQ's started registry.
        job_id = parsed.job
        try:
            finish = await self._outcome(identity, item, parsed, cls)
            await finish()
        except asyncio.CancelledError:
            if self.slots.aborted(asyncio.current_task()) and job_id is not None:
                # Its job was cancelled with abort: closing the request made SGLang abort it.
                await while_redis_down(
                    functools.partial(self.finisher.cancelled, identity, item, parsed, job_id)
                )
                return
            self.finisher.hand_back(identity, item, parsed)
            raise
        finally:
            # Whatever happened, this worker no longer runs the job: stop heartbeating it, so that
            # if it was not finished the reaper hands it out again.
            identity.in_flight.discard(item)

    async def _outcome(
        self, identity: QueueIdentity, item: InFlight, parsed: ParsedPayload, cls: PromptClass
    ) -> Callable[[], Awaitable[None]]:
        """Run the prompt; return the RQ transition that records how it ended (a success is
        acknowledged with its shard; any other end rides out a Redis outage on its own)."""
        finisher, job_id = self.finisher, parsed.job
        try:
            try:
                payload = parsed.require()
                if payload.given_prompt_len is not None:  # a capture-only job: the row is the record
                    tokenizer = self.generator.job_infos.get(payload.job, payload.incarnation).tokenizer
                    record = self.generator.given(item.job, payload, tokenizer)
                else:
                    record = await self.generator.generate(item.job, payload, cls)
            finally:
                self.slots.release(cls, job_id or "")
            # Multi-turn ``all``: what follows the turn goes into its record, committed with it.
            record, following = await finisher.following_turn(payload, record)
            features = self.generator.job_infos.get(payload.job, payload.incarnation).spec.features
            if features is not None:
                # Before the commit: a committed record's features are stored (`workers.run.capture`).
                if self.capturer is None:
                    raise FatalError(f"job {payload.job} asks for features but this worker cannot capture")
                record = await self.capturer.capture(record, features, rq_id=item.job.id)
            await self.writer.commit(record, payload.incarnation)
        except JobNotFoundError:
            # Its job was deleted (or the id reused) while it ran: nothing of it is stored or counted.
            return _in_redis(item, functools.partial(finisher.drop_stale, identity, item))
        except FatalError as exc:
            return _in_redis(item, functools.partial(finisher.fail, identity, item, parsed, exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must fail one prompt, not the worker
            log.exception("prompt %s crashed the task", item.job.id)
            return _in_redis(item, functools.partial(finisher.fail, identity, item, parsed, exc))
        # Committed: the prompt is done from here on.
        return functools.partial(finisher.succeed, identity, item, record, following, payload)


def _in_redis(item: InFlight, step: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    """A blocking RQ transition, retried while Redis is down unless an earlier try went through."""
    return functools.partial(while_redis_down, step, already_done=lambda: is_final(item.job))
