"""Chapter 11's speed-ups, as extensions of the core engine.

Everything here plugs into a seam that a core floor declares (an attention planner, a model transform, a kernel
table) and is composed by :func:`minisgl_ref.runtime.build_runtime`; no core module imports this package, so the
rooms of chapters 00-10 read the same with or without it.
"""
