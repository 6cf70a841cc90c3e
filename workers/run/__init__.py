"""Running one prompt: the request, its backups and retries, conversations, the commit and the
shard writer."""
