"""The servers this worker calls: their state and speed, health probes, the shared fleet view and
KV-cache control."""
