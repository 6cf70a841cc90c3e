"""Evaluation hygiene at ingestion: benchmark decontamination, then content deduplication."""
