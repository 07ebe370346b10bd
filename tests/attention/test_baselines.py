"""The peers' adapters (``sparseflash.attention.baselines``) on CPU: the Flex BlockMask that
``to_flex_block_mask`` builds keeps exactly the scores ``reference.allowed_scores`` keeps (its full blocks whole,
its partial blocks through its mask_mod; mask blocks that divide 128 merged into Flex's 128-blocks), and with
padding it leaves out the blocks past each batch's last key, as ``create_block_mask`` would, so that the
benchmark's Flex rows skip them as sparseflash does."""

from __future__ import annotations

import pytest
import torch

from sparseflash.attention.baselines import flex_attention, sdpa_attention, to_flex_block_mask
from sparseflash.attention.reference import allowed_scores, reference_attention
from sparseflash.masks import make


def _blocks(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Bool [B, H, n_q, n_kv] of the blocks a Flex table pair lists."""
    listed = torch.arange(idx.shape[-1]) < num[..., None]
    out = torch.zeros(*idx.shape[:-1], n_kv, dtype=torch.bool)
    return out.scatter_(-1, idx.long(), listed)


def _kept(flex_mask, batch: int, heads: int, q_len: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores kept [B, H, S_q, S_kv], blocks listed [B, H, n_q, n_kv]) of a Flex BlockMask: its full blocks
    whole, its partial blocks where its mask_mod keeps a score."""
    block_m, block_n = flex_mask.BLOCK_SIZE
    n_kv = -(-kv_len // block_n)
    full = _blocks(flex_mask.full_kv_num_blocks, flex_mask.full_kv_indices, n_kv)
    partial = _blocks(flex_mask.kv_num_blocks, flex_mask.kv_indices, n_kv)
    assert not (full & partial).any()
    full, partial = (x.expand(batch, heads, -1, -1) for x in (full, partial))

    def elements(x):
        return x.repeat_interleave(block_m, -2).repeat_interleave(block_n, -1)[..., :q_len, :kv_len]

    b, h = torch.arange(batch)[:, None, None, None], torch.arange(heads)[None, :, None, None]
    q_idx, kv_idx = torch.arange(q_len)[None, None, :, None], torch.arange(kv_len)[None, None, None, :]
    mod = flex_mask.mask_mod(b, h, q_idx, kv_idx).expand(batch, heads, q_len, kv_len)
    return elements(full) | (elements(partial) & mod), full | partial


MASKS = {
    "dense": lambda q_len, kv_len, block: make("dense", q_len, kv_len, block=block),
    "causal": lambda q_len, kv_len, block: make("causal", q_len, kv_len, block=block),
    "butterfly": lambda q_len, kv_len, block: make("butterfly", q_len, kv_len, block=block),
    "random-per-head": lambda q_len, kv_len, block: make("random", q_len, kv_len, block=block, heads=3, density=0.4),
    "document": lambda q_len, kv_len, block: make("document", q_len, block=block, documents=3, seed=2),
}


@pytest.mark.parametrize("padding", ["unpadded", "padded"])
@pytest.mark.parametrize("block", [32, 128], ids=["block32-merged", "block128"])
@pytest.mark.parametrize("pattern, q_len, kv_len", [
    *((pattern, 128, 128) for pattern in MASKS), *((pattern, 96, 200) for pattern in MASKS if pattern != "document"),
    ("random-per-head", 300, 500)], ids=str)  # the document pattern is square
def test_flex_block_mask_keeps_the_reference_scores(pattern, q_len, kv_len, block, padding):
    mask = MASKS[pattern](q_len, kv_len, block)
    lengths = torch.tensor([kv_len, kv_len - 5, 96, 1, 0]) if padding == "padded" else None
    flex_mask = to_flex_block_mask(mask, "cpu", lengths)
    assert flex_mask.BLOCK_SIZE == (128, 128)
    kept, listed = _kept(flex_mask, 5, 3, q_len, kv_len)
    want = allowed_scores(mask, lengths, "cpu").expand(5, 3, q_len, kv_len)
    assert torch.equal(kept, want)
    if lengths is not None:  # the unpadded mask's blocks less those wholly past a batch's last key; full ones
        # before it stay full (a listed block the mask_mod drops whole would pass the element check above)
        n_kv, flex_block = listed.shape[-1], flex_mask.BLOCK_SIZE[1]
        past = ((torch.arange(n_kv) * flex_block)[None, :] >= lengths[:, None])[:, None, None, :]
        whole = (((torch.arange(n_kv) + 1) * flex_block)[None, :] <= lengths[:, None])[:, None, None, :]
        unpadded = to_flex_block_mask(mask, "cpu")
        blocks = _kept(unpadded, 5, 3, q_len, kv_len)[1]
        unpadded_full = _blocks(unpadded.full_kv_num_blocks, unpadded.full_kv_indices, n_kv).expand(5, 3, -1, -1)
        full = _blocks(flex_mask.full_kv_num_blocks, flex_mask.full_kv_indices, n_kv).expand(5, 3, -1, -1)
        assert torch.equal(listed, blocks & ~past)
        assert torch.equal(full, unpadded_full & whole)


def test_merged_blocks_are_full_where_all_their_blocks_are():
    """A 64-block layout merged into 128-blocks: full where its four blocks are full (a last group the sequence
    ends inside: where its blocks are), listed where any is computed, left out where none is."""
    mask = make("random", 448, block=64, density=0.5, seed=3)  # 7 x 7 blocks: a last row and column of one
    flex_mask = to_flex_block_mask(mask, "cpu")
    full = _blocks(flex_mask.full_kv_num_blocks, flex_mask.full_kv_indices, 4)[0, 0]
    listed = full | _blocks(flex_mask.kv_num_blocks, flex_mask.kv_indices, 4)[0, 0]
    layout = torch.nn.functional.pad(mask.layout.reshape(7, 7).int(), (0, 1, 0, 1), value=-1)
    groups = layout.unflatten(1, (4, 2)).unflatten(0, (4, 2)).transpose(1, 2).reshape(4, 4, 4)
    assert torch.equal(full, ((groups == 1) | (groups == -1)).all(-1))
    assert torch.equal(listed, (groups == 1).any(-1))
    assert full.any() and (listed & ~full).any() and (~listed).any()


def test_sdpa_with_padding_matches_the_reference():
    """SDPA with key_lengths (an explicit bool mask), causal and GQA, against the reference; a batch of no key
    is left out (SDPA gives NaN rows there, the reference zeros)."""
    q = torch.randn(3, 4, 70, 16)
    k, v = torch.randn(3, 2, 90, 16), torch.randn(3, 2, 90, 16)
    lengths = torch.tensor([90, 41, 3])
    mask = make("causal", 70, 90, block=32)
    got = sdpa_attention(q, k, v, mask, lengths)
    want = reference_attention(q, k, v, mask, lengths, 16 ** -0.5)[0]
    assert not torch.isnan(got).any()
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("pattern, block", [("dense", 128), ("butterfly", 128), ("butterfly", 64)], ids=str)
def test_compiled_flex_with_padding_matches_the_reference(pattern, block):
    """The per-batch tables run through Flex's compiled kernel (Inductor's CPU template): o of a padded batch, a
    batch whose keys end inside a block and one a block and more before the end, against the reference; 64-blocks
    merged into Flex's 128-blocks."""
    mask = make(pattern, 384, block=block)
    q, k, v = (torch.randn(3, 2, 384, 16) for _ in range(3))
    lengths = torch.tensor([384, 300, 130])
    # static shapes: the third compile would be a dynamic one, whose C++ Inductor's CPU template fails to compile
    got = flex_attention(q, k, v, mask, lengths, dynamic=False)
    want = reference_attention(q, k, v, mask, lengths, 16 ** -0.5)[0]
    assert not torch.isnan(got).any()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
