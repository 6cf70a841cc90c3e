"""From a dataset row to prompt token ids: reading rows, resolving and loading tokenizers and chat
templates, rendering under a budget, special-token text, and the pre-flight checks."""
