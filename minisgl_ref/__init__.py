"""minisgl_ref: an annotated reference implementation of a Mini-SGLang-style LLM serving engine.

Start with ``from minisgl_ref import LLM, SamplingParams``; the book's chapters explain every module.

The subpackages are floors, and a module imports only from its own floor or one below. ``LAYERS`` in
``tests/test_layering.py`` is the one list of them (bottom first: env, sampling and tokenizer, core, distributed,
layers, kvcache, models, attention, scheduler, engine, tp, runtime, llm, this package's API, server and bench, cli), and
that test fails on any upward import or import cycle.
"""

from minisgl_ref.sampling.params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "GenerateOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    # LLM pulls in torch and transformers; importing it lazily keeps `import minisgl_ref` (and --help) fast.
    if name in ("LLM", "GenerateOutput"):
        from minisgl_ref import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'minisgl_ref' has no attribute {name!r}")
