"""Scheduling requests over the KV cache (chapters 03-06): ``scheduler`` decides each step's batch,
``cache_manager`` maps a request's tokens onto pages and the radix tree."""
