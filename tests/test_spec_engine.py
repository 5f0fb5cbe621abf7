"""Speculative decoding inside the engine (chapter 13): verify rows, greedy acceptance, KV rollback.

A scripted proposer (a test double) knows each request's true greedy continuation, computed by the chapter-00
oracle, and proposes by a script: the right continuation, a wrong one, a partly right one, or trees whose right
branch comes second. Whatever it proposes, a greedy request must produce exactly the oracle's tokens, text and
finish reason, and afterwards the engine must be idle: no KV slot or request slot leaked, nothing pinned, and the
radix cache holding only tokens some request really produced.
"""

from __future__ import annotations


import pytest
import torch

from minisgl_ref import SamplingParams
from minisgl_ref.core.batch import Guess
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.engine.engine import Engine
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.speculative.config import SpeculativeConfig
from minisgl_ref.core.request import LogprobRequest
from minisgl_ref.speculative.extension import SpeculativeExtension, first_nodes, longest_chain
from minisgl_ref.speculative.tree import DraftTree
from tests.engine_fixtures import (assert_matches_oracle, assert_pool_accounting,
                                   make_reqs, oracle, smol_llm, tree_nodes)
from tests.spec_fixtures import TruthScript, step_until_done

__all__ = ["smol_llm"]  # the fixture, imported for pytest

TEXTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,")
JUNK = 17  # what the script drafts past a request's true end: a stop inside a run must drop it


class ScriptedProposer(TruthScript):
    """Proposes from each request's known true sequence (``truth``: prompt + the oracle's output), by a script of
    modes cycled per request: ``right`` (the true continuation), ``wrong`` (every token off by one), ``partial``
    (the first half right), ``none``, ``tree_right_second`` (a wrong leaf first, the right chain as the second,
    deeper, branch) and ``tree_wrong_deeper`` (the right token as a leaf, a deeper wrong branch second). It checks
    that the engine tells it exactly the tokens the request appended."""

    def __init__(self, truth: dict[str, list[int]], script: tuple[str, ...]) -> None:
        super().__init__(truth, script)
        self.proposed = 0

    def extend(self, rid, tokens):
        super().extend(rid, tokens)
        seq = self.truth[rid]
        assert self.known[rid] == seq[: len(self.known[rid])], f"{rid}: the proposer was told a wrong token"

    def propose(self, rids, max_tokens):
        out = []
        for rid in rids:
            seq = self.truth[rid] + [JUNK] * max_tokens
            known = self.known[rid]
            assert known == seq[: len(known)], f"{rid}: drafting from a sequence that is not the request's"
            right = seq[len(known) : len(known) + max_tokens]
            wrong = [(t + 1) % 1000 for t in right]
            mode = self.next_mode(rid)
            self.proposed += mode != "none"
            if mode == "right":
                out.append(DraftTree.chain(right))
            elif mode == "wrong":
                out.append(DraftTree.chain(wrong))
            elif mode == "partial":
                half = max(1, len(right) // 2)
                out.append(DraftTree.chain(right[:half] + wrong[half:]))
            elif mode == "tree_right_second" and len(right) >= 2:
                n = len(right)
                out.append(DraftTree((wrong[0], *right[: n - 1]), (-1, -1, *range(1, n - 1))))
            elif mode == "tree_wrong_deeper" and len(right) >= 2:
                n = len(right)
                out.append(DraftTree((right[0], *wrong[: n - 1]), (-1, -1, *range(1, n - 1))))
            else:
                out.append(None)
        return out


def _prompts(llm):
    return [llm.tokenizer.encode(t) for t in TEXTS]


def _run(llm, prompts, params, expected, script=("right",), *, spec=None, tree_mask=None, logprobs=(), on_engine=None,
         **config):
    """Run ``prompts`` on a fresh engine with a scripted proposer; check outputs and the idle state after.
    ``logprobs``: the requests (by index) that ask for log probabilities."""
    reqs = make_reqs(llm, prompts, params)  # the oracle's requests, seeds included
    for i in logprobs:
        reqs[i].logprobs = LogprobRequest(top=1)
    truth = {r.rid: r.input_ids + e.ids for r, e in zip(reqs, expected)}
    proposer = ScriptedProposer(truth, script)
    ext = SpeculativeExtension(proposer, spec or SpeculativeConfig("NGRAM"), tree_mask=tree_mask)
    config = {"max_total_tokens": 1024, **config}
    engine = Engine(llm.model, llm.config, EngineConfig(**config), device="cpu", context_length=llm.context_length,
                    extensions=[ext])
    if on_engine is not None:
        on_engine(engine, engine.scheduler)
    for r in reqs:
        engine.add_request(r)
    step_until_done(engine, 500)
    assert_matches_oracle(reqs, expected)
    assert_pool_accounting(engine)
    assert not engine.scheduler.extending
    if engine.cache.shares_prefixes:  # every cached path is a prefix of some request's real tokens
        for node in tree_nodes(engine):
            path = _path_tokens(node)
            assert any(r.all_ids[: len(path)] == path for r in reqs), f"the radix cache holds {path}"
    assert sorted(proposer.finished) == sorted({r.rid for r in reqs if r.rid in proposer.known})
    return engine, ext, reqs


def _path_tokens(node) -> list[int]:
    keys = []
    while node.parent is not None:
        keys.append(list(node.key))
        node = node.parent
    return [t for key in reversed(keys) for t in key]


def _greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, **kw)


@pytest.fixture(scope="module")
def workload(smol_llm):
    prompts = _prompts(smol_llm)
    params = [_greedy(16), _greedy(12), _greedy(16)]
    return prompts, params, oracle(smol_llm, prompts, params)


@pytest.mark.parametrize(("script", "config"), [
    (("right",), {}),
    (("right",), {"disable_overlap_schedule": True}),
    (("wrong", "partial"), {"page_size": 4}),
    (("partial", "right", "none"), {"disable_radix_cache": True, "disable_overlap_schedule": True}),
    (("tree_right_second", "tree_wrong_deeper"), {"page_size": 4, "disable_overlap_schedule": True}),
    (("tree_right_second",), {"tree_mask": False}),
    (("right", "wrong"), {"chunked_prefill_size": 4, "max_prefill_tokens": 8}),
])
def test_greedy_output_is_the_oracle_s_whatever_the_drafts(smol_llm, workload, script, config):
    prompts, params, expected = workload
    engine, ext, reqs = _run(smol_llm, prompts, params, expected, script, **config)
    assert ext.verify_ct > 0, "no draft was verified"
    if script == ("right",):  # every draft right: about num_steps + 1 tokens per verify row
        assert ext.accept_length > 2.5
        assert engine.stats.steps < sum(len(e.ids) for e in expected)
    if script[0] == "tree_right_second":  # under the tree mask the second branch is verified, and accepted
        assert ext.tree_mask is False or ext.accept_length > 1.5


def test_log_probability_requests_draft_beside_others(smol_llm, workload):
    """A request that wants log probabilities drafts beside requests that want none, and gets one log
    probability per output token, also for the tokens its verify rows appended (tests/test_spec_grammar.py
    compares their values with a run without speculation)."""
    prompts, params, expected = workload
    _, ext, reqs = _run(smol_llm, prompts, params, expected, ("right",), logprobs=(1,))
    assert ext.stats[reqs[1].rid].accepted_tokens > 0 and reqs[0].rid in ext.stats
    assert len(reqs[1].logprobs.output) == len(reqs[1].output_ids)
    assert [e.top[0][0] for e in reqs[1].logprobs.output] == reqs[1].output_ids  # greedy: the likeliest token


def test_sampled_requests_draft_and_replay_their_seed(smol_llm):
    """A seeded sampled request drafts too (the acceptance rule keeps its distribution) and, seeded, gives the
    same tokens in every run, overlapped or not."""
    pytest.importorskip("minisgl_ref.speculative.ngram")
    from minisgl_ref.speculative.ngram import NgramProposer

    prompt = smol_llm.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2,")
    outputs = []
    for overlap in (True, False):
        ext = SpeculativeExtension(NgramProposer(), SpeculativeConfig("NGRAM"))
        engine = Engine(smol_llm.model, smol_llm.config,
                        EngineConfig(max_total_tokens=1024, disable_overlap_schedule=not overlap), device="cpu",
                        context_length=smol_llm.context_length, extensions=[ext])
        req = smol_llm.make_request(prompt, SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_new_tokens=16,
                                                           repetition_penalty=1.1))
        engine.add_request(req)
        engine.run_until_done()
        assert_pool_accounting(engine)
        assert ext.verify_ct > 0 and ext.accept_length > 1.0
        outputs.append(req.output_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 16


def test_stops_inside_an_accepted_run(smol_llm):
    """EOS, a stop token and a stop string inside a run of accepted drafts end the request there; the drafted
    junk after them is dropped (the script drafts past each request's true end)."""
    prompts = _prompts(smol_llm)
    base = oracle(smol_llm, prompts, [_greedy(16)] * 3)
    word = smol_llm.tokenizer.decode(base[0].ids[3:5]).strip()
    params = [_greedy(16, stop=[word]), _greedy(16, stop_token_ids=[base[1].ids[4]]), _greedy(3)]
    expected = oracle(smol_llm, prompts, params)
    assert expected[0].kind == "stop" and expected[1].kind == "stop" and expected[2].kind == "length"
    _run(smol_llm, prompts, params, expected, ("right",), spec=SpeculativeConfig("NGRAM", speculative_num_steps=6))


def test_min_new_tokens_is_honoured_at_every_drafted_position(smol_llm):
    prompts = _prompts(smol_llm)[:1]
    base = oracle(smol_llm, prompts, [_greedy(16)])
    params = [_greedy(16, stop_token_ids=[base[0].ids[1]], min_new_tokens=3)]
    expected = oracle(smol_llm, prompts, params)
    _run(smol_llm, prompts, params, expected, ("right",))


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_under_a_tiny_kv_pool(smol_llm, workload, overlap):
    prompts, params, expected = workload
    engine, _, _ = _run(smol_llm, prompts, params, expected, ("right", "partial"), max_total_tokens=48,
                        init_new_token_ratio=0.1, page_size=4, disable_overlap_schedule=not overlap)
    assert engine.scheduler.num_retractions > 0


def test_under_overlap_a_verify_step_is_processed_before_the_next_is_planned(smol_llm, workload):
    """The cost of speculation under overlap: with a step in flight the scheduler answers NEED_SYNC while it may
    draft, and never plans a request whose verify row is still in flight."""
    from minisgl_ref.scheduler.scheduler import NeedSync

    prompts, params, expected = workload
    answers = []

    def watch(engine, scheduler):
        schedule = scheduler.schedule

        def recording():
            in_flight = [row.req for row in engine.inflight.batch.rows if row.guess] if engine.inflight else []
            out = schedule()
            answers.append(out)
            if out is not None and not isinstance(out, NeedSync):
                assert not set(map(id, in_flight)) & set(map(id, out.reqs)), "planned before its verify row"
            return out

        scheduler.schedule = recording

    _run(smol_llm, prompts, params, expected, ("right",), on_engine=watch)
    assert any(isinstance(a, NeedSync) for a in answers)


def test_speculation_pauses_for_a_large_batch(smol_llm, workload):
    prompts, params, expected = workload
    spec = SpeculativeConfig("NGRAM", speculative_max_batch=2)
    _, ext, _ = _run(smol_llm, prompts, params, expected, ("right",), spec=spec)
    assert ext.verify_ct > 0  # once a request finishes, the batch is small enough again


def test_low_accept_rate_drafts_less_then_pauses(smol_llm, workload):
    prompts, params, expected = workload
    spec = SpeculativeConfig("NGRAM", speculative_cooldown_steps=100)
    _, ext, reqs = _run(smol_llm, prompts, params, expected, ("wrong",), spec=spec)
    for r in reqs:
        # The accept rate falls 1 -> 0.75 -> 0.56 -> 0.42 -> 0.32 -> 0.24 -> 0.18 (decay 0.25): 4 tokens while it
        # is >= 0.5, then 3, 2, 1; below 0.2 the request pauses for longer than it has left to decode.
        stats = ext.stats[r.rid]
        assert (stats.verify_ct, stats.draft_tokens, stats.accepted_tokens) == (6, 4 + 4 + 4 + 3 + 2 + 1, 0)


def test_the_core_runs_unchanged_without_the_extension(smol_llm, workload):
    prompts, params, expected = workload
    engine = Engine(smol_llm.model, smol_llm.config, EngineConfig(max_total_tokens=1024), device="cpu",
                    context_length=smol_llm.context_length)
    assert engine.scheduler.guesser is None
    reqs = make_reqs(smol_llm, prompts, params)
    for r in reqs:
        engine.add_request(r)
    launched = []
    run = engine.runner.run
    engine.runner.run = lambda batch, *a: launched.append(batch) or run(batch, *a)  # type: ignore[method-assign]
    engine.run_until_done()
    assert_matches_oracle(reqs, expected)
    assert all(row.guess is None for b in launched for row in b.rows)
    assert_pool_accounting(engine)


# ------------------------------------------------------------------------------------------- the small parts


def test_trees_are_cut_to_their_longest_chain_and_trimmed():
    tree = DraftTree((5, 6, 7, 8), (-1, -1, 1, 2))
    assert longest_chain(tree) == DraftTree.chain([6, 7, 8])
    assert first_nodes(tree, 2) == DraftTree((5, 6), (-1, -1))
    assert Guess((6, 7, 8), (1, 2, 3)).is_chain
    assert not Guess((5, 6), (1, 1), DraftTree((5, 6), (-1, -1)).mask()).is_chain
    with pytest.raises(ValueError, match="needs a mask"):  # siblings under a causal mask would see each other
        Guess((5, 6), (1, 1))


def test_a_tree_s_accepted_path_moves_into_place_and_the_rest_is_freed():
    """Rollback after a tree was verified: the accepted nodes' KV moves to the slots of their positions, the
    request's lengths end after them, and the whole pages past them go back to the allocator."""
    from types import SimpleNamespace

    from minisgl_ref.core.batch import Row
    from minisgl_ref.core.request import Req
    from minisgl_ref.kvcache.allocator import PageAllocator
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
    from minisgl_ref.scheduler.cache_manager import NaiveCacheManager
    from minisgl_ref.speculative.extension import DraftGuess

    allocator, table = PageAllocator(9, 2), ReqToTokenPool(2, 32)
    cache, pool = NaiveCacheManager(allocator, table), KVPool(1, 18, 1, 1, torch.float32)
    req = Req([1, 2, 3], _greedy())
    cache.match(req)
    cache.alloc(req, 3)  # the prompt; its last token (position 2) is the verify row's root
    guess = DraftGuess.of(DraftTree((5, 6, 7, 8), (-1, -1, 1, 2)))  # root -> 5 | root -> 6 -> 7 -> 8
    row = Row(req, 2, 5, False, True, 0, guess)
    cache.alloc(req, 4)  # the nodes, at table positions 3 .. 6
    req.kv_scheduled_len = 7
    slots = table.read(req.req_pool_idx, 7)
    pool.k[0][slots, 0, 0] = torch.arange(7.0) + 100  # each slot's key says which table position it was
    free_before = allocator.num_free_pages
    ext = SpeculativeExtension(ScriptedProposer({}, ()), SpeculativeConfig("NGRAM"))
    ext._engine = SimpleNamespace(scheduler=SimpleNamespace(cache=cache), kv_pool=pool)  # type: ignore[assignment]
    ext._keep_accepted_kv(row, guess, [1, 2])  # the path 6 -> 7: nodes at positions 4, 5 belong at 3, 4
    assert req.kv_scheduled_len == req.kv_allocated_len == 5
    kept = table.read(req.req_pool_idx, 5)
    assert pool.k[0][kept, 0, 0].tolist() == [100, 101, 102, 104, 105]
    assert allocator.num_free_pages == free_before + 1  # the page of position 6; positions 4-5 share a kept one


def test_kv_pool_move_copies_every_layer():
    pool = KVPool(2, 8, 1, 2, torch.float32)
    for layer in range(2):
        pool.k[layer][:, 0, 0] = torch.arange(8.0) + 10 * layer
        pool.v[layer][:, 0, 0] = -torch.arange(8.0)
    pool.move(torch.tensor([5, 6]), torch.tensor([3, 5]))  # overlapping: sources are read first
    assert pool.k[1][:, 0, 0].tolist() == [10, 11, 12, 15, 14, 16, 16, 17]
    assert pool.v[0][:, 0, 0].tolist() == [0, -1, -2, -5, -4, -6, -6, -7]


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
    ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 9}, "speculative_num_steps \\+ 1"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 0}, "speculative_num_steps"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "self:x"}, "self:K"),
])
def test_bad_settings_are_refused_by_name(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SpeculativeConfig(**kwargs).self_draft_layers  # noqa: B018 - parsing self:K is part of the check


# ------------------------------------------------------------------------------------------- the front doors


def test_flags_and_keyword_arguments_carry_sglang_names():
    from minisgl_ref.cli import build_parser, speculative_kwargs
    from minisgl_ref.server.args import ServerArgs

    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "self:4",
             "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "3"]
    args = ServerArgs.from_cli(build_parser().parse_args(["serve", "--device", "cpu", *flags]))
    assert args.speculative == SpeculativeConfig("STANDALONE", "self:4", speculative_num_steps=3,
                                                 speculative_num_draft_tokens=3)
    assert args.speculative.self_draft_layers == 4 and args.speculative.draft_tokens == 3
    assert args.public_dict()["speculative_algorithm"] == "STANDALONE"
    kwargs = speculative_kwargs(build_parser().parse_args(["generate", "hi", *flags]))
    assert kwargs == {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "self:4",
                      "speculative_num_steps": 3, "speculative_num_draft_tokens": 3}
    spec, rest = SpeculativeConfig.split({**kwargs, "page_size": 4})
    assert spec == args.speculative and rest == {"page_size": 4}
    assert speculative_kwargs(build_parser().parse_args(["generate", "hi"])) == {}
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        ServerArgs.from_cli(build_parser().parse_args(
            ["serve", "--device", "cpu", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"]))


@pytest.mark.parametrize(("kind", "tp", "topk", "fragment"), [
    ("naive", False, 1, "engine='paged'"),
    ("paged", True, 1, "tp_size"),
    ("paged", False, 2, "speculative_eagle_topk=2"),
])
def test_combinations_it_cannot_run_are_refused_by_name(kind, tp, topk, fragment):
    from minisgl_ref.speculative.build import check_combination

    engine = EngineConfig(attention_backend="fa3")  # takes no tree mask
    with pytest.raises(ValueError, match=fragment):
        check_combination(SpeculativeConfig("NGRAM", speculative_eagle_topk=topk), kind=kind, tp_enabled=tp,
                          engine=engine)
    check_combination(SpeculativeConfig(), kind=kind, tp_enabled=tp, engine=engine)  # off: anything goes


def test_trees_without_a_tree_mask_are_refused_when_asked_for(smol_llm):
    spec = SpeculativeConfig("NGRAM", speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="speculative_eagle_topk=2 drafts trees"):
        Engine(smol_llm.model, smol_llm.config, EngineConfig(max_total_tokens=64), device="cpu",
               context_length=smol_llm.context_length,
               extensions=[SpeculativeExtension(ScriptedProposer({}, ()), spec, tree_mask=False)])


def test_the_offline_llm_refuses_before_loading():
    from minisgl_ref import LLM

    with pytest.raises(ValueError, match="engine='paged'"):
        LLM(engine="naive", speculative_algorithm="NGRAM")


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_the_real_proposers_in_the_engine(smol_llm, algorithm):
    """The n-gram proposer on a repetitive prompt, and the target's first 24 of 30 layers as its own draft (on
    this prompt 16 layers draft nothing the target accepts, 20 about one token per verify, 24 all four)."""
    pytest.importorskip("minisgl_ref.speculative.ngram" if algorithm == "NGRAM" else
                        "minisgl_ref.speculative.draft_model")
    from minisgl_ref.speculative.build import speculative_extension

    prompts = [smol_llm.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2,"),
               smol_llm.tokenizer.encode(TEXTS[0])]
    params = [_greedy(16), _greedy(8)]
    expected = oracle(smol_llm, prompts, params)
    spec = SpeculativeConfig(algorithm, "self:24" if algorithm == "STANDALONE" else None)
    config = EngineConfig(max_total_tokens=1024)
    ext = speculative_extension(spec, smol_llm.model, smol_llm.config, device=torch.device("cpu"), engine=config,
                                context_length=smol_llm.context_length)
    engine = Engine(smol_llm.model, smol_llm.config, config, device="cpu", context_length=smol_llm.context_length,
                    extensions=[ext])
    reqs = make_reqs(smol_llm, prompts, params)
    for r in reqs:
        engine.add_request(r)
    engine.run_until_done()
    assert_matches_oracle(reqs, expected)
    assert_pool_accounting(engine)
    assert ext.verify_ct > 0 and ext.accept_length > 1.0, "nothing was accepted"


def test_server_reports_accept_lengths(embedded_path):
    """``/generate``'s meta_info carries SGLang's speculation figures and ``/metrics`` the accept length."""
    pytest.importorskip("minisgl_ref.speculative.ngram")
    import re

    from tests.server_utils import running_server

    with running_server("--device", "cpu", "--speculative-algorithm", "NGRAM", "--enable-metrics",
                        "--max-total-tokens", "2048", "--log-level", "warning") as srv:
        body = {"text": "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2,",
                "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
        meta = srv.post("/generate", json=body).json()["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] > 1.0, meta
        assert meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
        metrics = srv.get("/metrics").text
        found = re.search(r'^sglang:spec_accept_length\{[^}]*\} ([0-9.]+)$', metrics, re.M)
        assert found and float(found.group(1)) > 1.0, metrics


@pytest.mark.parametrize("script", [("right", "partial"), ("wrong",)])
def test_verify_steps_replay_the_extend_graphs(smol_llm, workload, script):
    """On a GPU a verify step is an extend step of a few tokens per row, which the extend graphs of chapter 11
    capture: it replays one (run eagerly, a 30-layer model's ~400 launches cost more than the drafts save) and the
    LM head then runs on the drafted positions' hidden states, which the graph leaves in its buffer. Here with
    stand-in graphs and the ``torch_static`` backend: the greedy tokens are still the oracle's, and verify steps
    did replay (a replay that reused stale hidden states would accept the wrong drafts)."""
    from minisgl_ref.attention.torch_native import TorchStaticBackend
    from minisgl_ref.engine.cuda_graph import RerunGraphFactory
    from minisgl_ref.engine.extend_graph import ExtendGraphRunner

    prompts, params, expected = workload
    replays = {"verify": 0, "other": 0}

    def with_graphs(engine, scheduler):
        runner = engine.runner
        runner.attn_backend = static = TorchStaticBackend(engine.kv_pool, engine.req_to_token)
        graphs = ExtendGraphRunner(runner.model, static, static, torch.device("cpu"), max_tokens=128, multiple=8,
                                   row_buckets=(2, 4, 8), graph_factory=RerunGraphFactory())
        replay = graphs.replay

        def counting_replay(fb):
            replays["verify" if fb.extra_logit_indices is not None else "other"] += 1
            return replay(fb)

        graphs.replay = counting_replay  # type: ignore[method-assign]
        runner.graph_runners = [graphs]

    _run(smol_llm, prompts, params, expected, script, on_engine=with_graphs, extend_token_multiple=8,
         disable_overlap_schedule=True)
    assert replays["verify"] > 0, "no verify step replayed a graph"


@pytest.mark.task("13.1", weight=2)
def test_the_batched_greedy_walk_is_the_acceptance_rule_s():
    """A plain greedy request is verified from one argmax of the whole step (no per-row processing): on random
    trees and logits, with ties, its path and tokens are exactly what :func:`accept` gives a greedy request."""
    from minisgl_ref.speculative.accept import accept

    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        parents = tuple(int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n))
        tokens = tuple(int(t) for t in torch.randint(0, 4, (n,), generator=gen))
        logits = torch.randint(0, 3, (n + 1, 6), generator=gen).float()  # small integers: many ties
        tree = DraftTree(tokens, parents)
        verdict = accept(tree, logits, _greedy(8))
        assert SpeculativeExtension._greedy_walk(tree, logits.argmax(-1).tolist()) == (verdict.nodes, verdict.tokens)
