"""Taking prompts from the queues: RQ's registries, the wake-up channel, admission and the reaper."""
