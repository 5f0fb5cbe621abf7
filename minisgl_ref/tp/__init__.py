"""Tensor parallelism above the engine (chapter 09): ``engine`` keeps the engines of all ranks in lock-step
(``TPEngine``) and spawns an offline ``LLM``'s local ranks; ``launch`` runs a function on every rank of a fresh
process group. The collectives the layers call live below, in ``minisgl_ref.distributed``.
"""
