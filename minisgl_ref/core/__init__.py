"""The engine's shared vocabulary: the plain data types that every chapter and every floor above uses.

``request`` (``Req``, ``FinishReason``, ``TokenLogprob``), ``forward_batch`` (``ForwardBatch``, ``ForwardMode``),
``batch`` (``ScheduledBatch``) and ``config`` (``EngineConfig``). They depend only on sampling and the tokenizer,
so that memory, attention, models and the scheduler can all speak about requests and batches without importing
one another.
"""
