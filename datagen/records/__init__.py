"""What a job leaves in storage: the record schema, the storage root (manifests, shards, commit
objects) and the reader that exports and the report share."""
