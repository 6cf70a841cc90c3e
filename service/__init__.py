"""The coordinator: accepts jobs over HTTP, renders prompts and enqueues them on RQ."""

__all__: list[str] = []
