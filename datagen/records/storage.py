"""Job storage on a local directory or any fsspec URL (``s3://bucket/prefix``; a shared volume or an
object store on multi-node setups): `Storage`, and the job-id rule its paths and Redis keys share.

`Storage` is one object built of its concepts, each in its own module:

- `datagen.records.layout`: where each object is (the layout, drawn there), job ids and stored names
  validated, storage failures translated into `StorageError`;
- `datagen.records.manifests`: each incarnation's manifest, how it ended (``deleted.json``,
  ``cancelled.json``), which jobs exist, and the Redis namespace that owns the root;
- `datagen.records.commits`: committed records (a shard, then its commit object, which seals it), read
  back in commit order, each shard held to its seal first;
- `datagen.records.inputs`: the uploads, rejected and flagged rows, stopped conversations;
- `datagen.records.features`: a job's hidden-state feature files, one per record, each stored
  before the record that names it is committed;

on the bytes of `datagen.records.files` (objects written whole, so an object store serves as well
as a directory).
"""

from __future__ import annotations

from datagen.records.commits import CommittedShards
from datagen.records.features import FeatureFiles
from datagen.records.inputs import JobInputs

__all__ = ["Storage"]


class Storage(CommittedShards, JobInputs, FeatureFiles):
    """A storage root: every job's uploads, manifests, committed records, feature files and notes on
    its rows."""
