"""The generation worker: claims prompts, calls SGLang servers, records exact-token results."""

__all__: list[str] = []
