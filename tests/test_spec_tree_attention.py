"""Tree attention masks (chapter 13): ``ForwardBatch.extend_masks`` through the attention backends.

A verify row holds a request's last known token (the root) and its draft tree's nodes, in topological order. With
the tree's ancestor mask, each node's attention output must equal a plain causal computation over the cached
prefix plus that node's ancestor path (the chapter-00 ``reference_attention`` with one query): the tree evaluates
every path at once. Checked for torch_native (the oracle) on the CPU, the Triton extend kernel (its interpreter
on the CPU, compiled on a GPU) against it, FlashInfer on a GPU, and the whole tiny model: a verify row's logits
at each node are those of the full sequence ending in that node's path, which also shows that nothing in the model
needs consecutive positions within a row (tree nodes sit at ``prefix + depth``).
"""

from __future__ import annotations

import random

import pytest
import torch

from minisgl_ref.attention.base import AttentionBackend
from minisgl_ref.attention.registry import HybridAttnBackend
from minisgl_ref.attention.torch_native import NoCacheAttentionBackend, TorchNativeBackend, reference_attention
from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.layers.attention import AttentionLayer
from minisgl_ref.speculative.tree import DraftTree
from minisgl_ref.speculative.tree_logits import path_logits, path_to, verify_row_logits
from tests.attention_cases import Case
from tests.attention_cases import make_case as make_attention_case
from tests.engine_fixtures import tiny_engine_path, tiny_llm  # noqa: F401 - fixtures

#: A bushy tree: two children of the root, node 0 with two children, node 3 with one; node 6 a third root child.
BUSHY = DraftTree((5, 6, 7, 8, 9, 10, 11), (-1, -1, 0, 0, 1, 3, -1))
CHAIN = DraftTree.chain([1, 2, 3, 4])
ROOT_ONLY = DraftTree((), ())

Row = tuple[int, "DraftTree | int"]  # (prefix length, a draft tree for a verify row or a causal row's length)


def make_case(rows: list[Row], *, page_size: int, num_kv_heads: int = 2, gqa: int = 2, head_dim: int = 16,
              dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Case:
    """Rows laid out as the engine lays them out (:func:`tests.attention_cases.make_case`); a tree row's
    positions are ``prefix + depth`` and its mask the tree's ancestor mask."""
    specs = [(p, len(r) + 1 if isinstance(r, DraftTree) else r) for p, r in rows]
    positions: list[int] = []
    for (prefix, extend), (_, r) in zip(specs, rows):
        positions += r.positions(prefix) if isinstance(r, DraftTree) else [prefix + i for i in range(extend)]
    masks = [r.mask() if isinstance(r, DraftTree) else None for _, r in rows]
    case = make_attention_case(specs, num_kv_heads=num_kv_heads, gqa=gqa, head_dim=head_dim, page_size=page_size,
                               dtype=dtype, device=device, seed=seed, positions=positions, masks=masks)
    case.rows = rows
    return case


@pytest.mark.task("13.2", weight=3)
def test_tree_positions_are_prefix_plus_depth():
    assert BUSHY.positions(9) == [9, 10, 10, 11, 11, 11, 12, 10]
    assert CHAIN.positions(0) == [0, 1, 2, 3, 4] and ROOT_ONLY.positions(5) == [5]


def run(case: Case, backend: AttentionBackend) -> torch.Tensor:
    case.batch.attn_backend = backend
    backend.init_forward_metadata(case.batch)
    return backend.forward(case.q, case.k, case.v, case.layer, case.batch)


def ancestors(tree: DraftTree, offset: int) -> list[int]:
    """The verify-row offsets a tree offset may see: the root, its ancestors and itself, in row order."""
    path, node = [offset], offset - 1
    while node >= 0:
        node = tree.parents[node]
        path.append(node + 1)
    return sorted(set(path))


def path_by_path(case: Case) -> torch.Tensor:
    """The expected output, from the pool (the new K/V stored): each tree node as the last query of a plain causal
    sequence ``prefix + its ancestor path``; each causal row as itself. float32, [T, H * D]."""
    k_all, v_all = case.pool.k[0].float(), case.pool.v[0].float()
    outs, start = [], 0
    for b, (prefix, r) in enumerate(case.rows):
        extend = case.batch.extend_lens_cpu[b]
        slots = case.table.table[int(case.batch.req_pool_indices[b]), : prefix + extend].long()
        q = case.q[start : start + extend].float()
        if isinstance(r, DraftTree):
            for a in range(extend):
                keys = torch.cat([slots[:prefix], slots[prefix + torch.tensor(ancestors(r, a))]])
                outs.append(reference_attention(q[a : a + 1], k_all[keys], v_all[keys], case.layer.scale))
        else:
            outs.append(reference_attention(q, k_all[slots], v_all[slots], case.layer.scale))
        start += extend
    return torch.cat(outs).flatten(1)


MIXED = [(9, BUSHY), (5, 6), (0, CHAIN), (13, ROOT_ONLY), (3, BUSHY)]


# ------------------------------------------------------------------------------------------ torch_native (CPU)


@pytest.mark.task("13.2", weight=3)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("rows", [[(11, BUSHY)], MIXED], ids=["one-tree", "mixed"])
def test_torch_native_tree_row_equals_each_path(page_size, rows):
    case = make_case(rows, page_size=page_size)
    out = run(case, TorchNativeBackend(case.pool, case.table))
    torch.testing.assert_close(out, path_by_path(case), rtol=1e-5, atol=1e-6)


@pytest.mark.task("13.2")
def test_a_tree_mask_changes_the_result():
    """The same row without its mask (causal) differs at every node that has a non-ancestor before it."""
    case = make_case([(7, BUSHY)], page_size=1)
    masked = run(case, TorchNativeBackend(case.pool, case.table))
    case.batch.extend_masks = None
    causal = run(case, TorchNativeBackend(case.pool, case.table))
    differs = [not torch.allclose(masked[a], causal[a]) for a in range(len(BUSHY) + 1)]
    # The root and its first child (offsets 0 and 1) have only ancestors before them; from offset 2 on (node 1,
    # whose predecessor node 0 is its sibling) every offset has a non-ancestor before it.
    assert differs == [False, False, True, True, True, True, True, True]


@pytest.mark.task("13.2")
def test_a_chain_mask_is_the_causal_mask():
    case = make_case([(6, CHAIN)], page_size=4)
    masked = run(case, TorchNativeBackend(case.pool, case.table))
    case.batch.extend_masks = None
    torch.testing.assert_close(masked, run(case, TorchNativeBackend(case.pool, case.table)), rtol=1e-6, atol=1e-7)


class CausalOnly(TorchNativeBackend):
    name = "causal_only"
    supports_custom_mask = False


def test_a_backend_without_masks_refuses_a_masked_batch():
    case = make_case(MIXED, page_size=1)
    with pytest.raises(ValueError, match="causal_only attention backend takes no custom attention mask"):
        run(case, CausalOnly(case.pool, case.table))
    case.batch.extend_masks = [None] * len(MIXED)  # entries all None: no mask, nothing to refuse
    run(case, CausalOnly(case.pool, case.table))


def test_the_no_cache_oracle_refuses_a_mask():
    batch = ForwardBatch.for_full_sequences([[1, 2, 3]], NoCacheAttentionBackend())
    batch.extend_masks = [DraftTree.chain([2, 3]).mask()]
    q = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="no custom attention mask"):
        batch.attn_backend.forward(q, q, q, AttentionLayer(0, 2, 2, 4), batch)


def test_capability_flags():
    assert TorchNativeBackend.supports_custom_mask and not AttentionBackend.supports_custom_mask
    case = make_case([(2, 3)], page_size=1)
    native, causal = TorchNativeBackend(case.pool, case.table), CausalOnly(case.pool, case.table)
    assert HybridAttnBackend(native, causal).supports_custom_mask  # masks come with extend steps: prefill's
    assert not HybridAttnBackend(causal, native).supports_custom_mask


@pytest.mark.parametrize("bad,match", [
    (lambda m: m[:-1], "must be"),
    (lambda m: m.int(), "bool"),
    (lambda m: m | torch.ones_like(m).triu(1), "lower triangular"),
    (lambda m: m & ~torch.eye(m.shape[0], dtype=torch.bool), "true diagonal"),
], ids=["shape", "dtype", "upper", "diagonal"])
def test_a_broken_mask_is_refused(bad, match):
    case = make_case([(4, BUSHY)], page_size=1)
    case.batch.extend_masks = [bad(BUSHY.mask())]
    with pytest.raises(ValueError, match=match):
        run(case, TorchNativeBackend(case.pool, case.table))


def test_masks_belong_to_extend_batches():
    case = make_case([(4, BUSHY)], page_size=1)
    case.batch.mode = ForwardMode.DECODE
    with pytest.raises(ValueError, match="EXTEND"):
        case.batch.check_extend_masks()
    case = make_case([(4, BUSHY), (2, 2)], page_size=1)
    case.batch.extend_masks = [BUSHY.mask()]
    with pytest.raises(ValueError, match="1 entries for 2 rows"):
        case.batch.check_extend_masks()


# ------------------------------------------------------------------------------------ the model, end to end


@pytest.mark.task("13.2", weight=3)
def test_model_verify_row_gives_each_paths_logits(tiny_llm):  # noqa: F811 - fixture
    """The tiny model over prefix + a tree row (positions prefix + depth, the tree mask, torch_native) gives at
    every offset the logits the chapter-00 oracle gives for the whole sequence ending in that offset's path."""
    model, cfg = tiny_llm.model, tiny_llm.config
    prefix = [3, 17, 42, 8, 99, 23, 5]
    root, tree = 61, BUSHY
    row = verify_row_logits(model, cfg, prefix, root, tree)
    for a in range(len(tree) + 1):
        seq = prefix + [root] + [tree.tokens[o - 1] for o in ancestors(tree, a) if o > 0]
        assert seq == prefix + [root] + path_to(tree, a - 1)
        torch.testing.assert_close(row[a], path_logits(model, seq), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- Triton (interpreter on CPU, or a GPU)


def triton_backend(case: Case):  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    from minisgl_ref.attention.triton_backend import TritonAttnBackend, triton_interpret_mode

    if case.pool.k[0].device.type == "cpu" and not triton_interpret_mode():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/test_attention_backends.py covers it)")
    return TritonAttnBackend(case.pool, case.table)


@pytest.mark.parametrize("page_size", [1, 4])
def test_triton_extend_kernel_takes_tree_masks(page_size):
    case = make_case(MIXED, page_size=page_size, device="cuda" if torch.cuda.is_available() else "cpu")
    out = run(case, triton_backend(case))
    torch.testing.assert_close(out.cpu(), path_by_path(case).cpu(), rtol=1e-4, atol=1e-5)


def test_triton_masked_query_that_sees_no_key_of_a_block():
    """No prefix, tiles of 16, and a mask under which tokens 16.. see none of tokens 0..15: their first key block
    is all masked, which the kernel's online softmax must survive (no NaN)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case([(0, 40)], page_size=1, device=device)
    mask = torch.ones(40, 40, dtype=torch.bool).tril()
    mask[16:, :16] = False
    case.batch.extend_masks = [mask]
    backend = triton_backend(case)
    backend.init_forward_metadata(case.batch)
    assert backend.forward_metadata is not None
    backend.forward_metadata.extend_config = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
    out = backend.forward(case.q, case.k, case.v, case.layer, case.batch)
    ref = run(case, TorchNativeBackend(case.pool, case.table))
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------- GPU


def gpu_cases() -> list[list[Row]]:
    rng = random.Random(3)
    wide = DraftTree(tuple(range(40)), tuple(rng.randint(-1, i - 1) for i in range(40)))
    return [[(1000, wide), (300, 200), (0, BUSHY), (77, CHAIN)], [(5, wide)] * 8]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "flashinfer"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_backends_take_tree_masks(name, page_size):
    for rows in gpu_cases():
        case = make_case(rows, page_size=page_size, num_kv_heads=4, gqa=4, head_dim=128, dtype=torch.bfloat16,
                         device="cuda")
        if name == "triton":
            backend = triton_backend(case)
        else:
            pytest.importorskip("flashinfer")
            from minisgl_ref.attention.flashinfer_backend import FlashInferBackend

            backend = FlashInferBackend(case.pool, case.table, num_q_heads=case.layer.num_heads)
        out = run(case, backend).float()
        ref = path_by_path(case)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"
