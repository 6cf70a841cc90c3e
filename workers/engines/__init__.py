"""The engine seam: what the worker needs of an inference server, and its SGLang and vLLM
clients."""
