"""Compiling grammars against the model's vocabulary, off the scheduler's thread (chapter 12).

xgrammar works in two stages. A *grammar* (from a JSON schema, a regex or EBNF) knows nothing about tokens; a
*compiled grammar* has also worked out, for each state of the grammar's automaton, which of the vocabulary's
tokens can follow -- that precomputation is what makes filling a token mask cheap later, and it is the slow part:
milliseconds for a small schema, seconds for a large one. Two consequences shape :class:`GrammarBackend`:

* **Compile once per grammar.** Results are cached per :class:`~minisgl_ref.constrained.spec.GrammarSpec` (kind
  and source text), failures included, so a thousand requests with the same schema compile it once and a bad
  schema is rejected at once the second time. The cache holds *futures*: a request that arrives while the same
  grammar is still compiling waits for that compile instead of starting a second one.
* **Never compile on the scheduler's thread.** A slow compile must not stall every other request's decode steps,
  so compiles run on a small thread pool (xgrammar's C++ releases the GIL while it works) and the engine polls the
  future each step; the request waits in the queue until its grammar is ready (:meth:`compile_async`).
  :meth:`compile` is the synchronous path, through the same cache.

**JSON is compiled compact** (``any_whitespace=False``: ``{"a": 1, "b": [2, 3]}``, the separators of Python's
``json.dumps``). With free whitespace between tokens a small model happily emits newline after newline inside
its object until ``max_new_tokens`` runs out (SmolLM2-135M does, for about one schema in three): the grammar
cannot stop it, since whitespace is valid there. Compact JSON leaves the model no such loop, is shorter, and is
what the parser at the other end gets anyway. (SGLang allows any whitespace unless told otherwise; vLLM and SGLang
both grew a flag to turn it off for this reason.) ``json_object`` (:data:`~minisgl_ref.sampling.params.ANY_JSON`)
is compiled as a non-strict ``{"type": "object"}`` schema: any object, with any properties and values, compact --
OpenAI's JSON mode asks for an object, while xgrammar's built-in JSON grammar also admits a top-level array.

The vocabulary description (xgrammar's ``TokenizerInfo``) is built from the HF tokenizer with the *model's*
vocabulary size, which may exceed the tokenizer's (embedding matrices are padded to a multiple of 64 or 128):
xgrammar then treats the extra ids as tokens no grammar accepts, so the masks it fills ban them too. Building it
takes a fraction of a second, so it happens on the pool, with the first compile: an engine that never sees a
constrained request never pays for it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from minisgl_ref.constrained.matcher import GrammarState
from minisgl_ref.constrained.schema_support import check_schema_support
from minisgl_ref.constrained.spec import GrammarSpec, grammar_error
from minisgl_ref.constrained.structural_tag import check_structural_tag_support, to_xgrammar

#: Compiled grammars kept (least recently used dropped first). A compiled JSON schema holds a few hundred KB.
COMPILE_CACHE_SIZE = 256
#: JSON (schemas and json_object) without free whitespace between tokens: see the module docstring.
JSON_ANY_WHITESPACE = False
#: Threads that compile grammars (and xgrammar's own threads per compile): few, the scheduler needs the CPU too.
COMPILE_THREADS = 2


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary size (one per engine) and makes per-request matchers.

    ``tokenizer`` is a HF tokenizer (``minisgl_ref.tokenizer.Tokenizer.hf``); ``vocab_size`` is the model's (the
    width of its logits); ``stop_token_ids`` are the ids that end a request (default: the tokenizer's EOS).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: Iterable[int] | None = None,
                 threads: int = COMPILE_THREADS, cache_size: int = COMPILE_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids)) if stop_token_ids is not None else None
        self.threads = threads
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # the cache is touched by the scheduler and, through validate(), others
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.num_compiles = 0  # compiles started (cache misses), for tests and metrics

    # --------------------------------------------------------------------------------------------- compiling

    def _get_compiler(self) -> xgr.GrammarCompiler:
        """The xgrammar compiler, built on first use (on a pool thread: see the module docstring)."""
        with self._compiler_lock:
            if self._compiler is None:
                kwargs = {} if self.stop_token_ids is None else {"stop_token_ids": self.stop_token_ids}
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size, **kwargs)
                # Our own cache (of futures) is the one that counts; xgrammar's would keep a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
            return self._compiler

    def _compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":  # a request that skipped the admission check is refused here instead
            check_schema_support(spec.source)
        if spec.kind == "structural_tag":
            check_structural_tag_support(spec.source)
        compiler = self._get_compiler()
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.source, any_whitespace=JSON_ANY_WHITESPACE)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                    any_whitespace=JSON_ANY_WHITESPACE)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(to_xgrammar(spec.source))
            return compiler.compile_grammar(spec.source)
        except Exception as e:  # noqa: BLE001 - xgrammar reports every bad grammar as a RuntimeError from C++
            raise grammar_error(spec, e) from e

    def compile_async(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """A future of ``spec``'s compiled grammar: cached, or compiling on the pool now. Its exception, if the
        grammar is invalid, is a ``ValueError`` naming the field."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            self.num_compiles += 1
            future = self._pool.submit(self._compile_now, spec)
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # a request holding the dropped future still gets its result
            return future

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """``spec`` compiled, waiting for it (through the cache); raises ``ValueError`` naming the field."""
        return self.compile_async(spec).result()

    def validate(self, spec: GrammarSpec) -> None:
        """Raise the ``ValueError`` that compiling ``spec`` raises, if any (compiles synchronously, and caches)."""
        self.compile(spec)

    # ---------------------------------------------------------------------------------------------- matching

    def matcher(self, compiled: xgr.CompiledGrammar, stop_token_ids: Iterable[int] | None = None) -> GrammarState:
        """A fresh per-request matcher for ``compiled``; ``stop_token_ids`` (the request's EOS and stop token
        ids) are the tokens that may end the output once the grammar is complete."""
        return GrammarState(compiled, stop_token_ids)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
