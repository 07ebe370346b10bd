import pytest
import torch

import sparseflash
from sparseflash.models import Encoder, build_model, sinusoidal_positions

ATTN = {"pattern": "dense", "block": 16, "backend": "blocked", "params": {}}


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("pattern", ["dense", "butterfly"])
def test_padding_is_never_attended(pool, pattern):
    enc = Encoder(vocab_size=20, max_len=70, dim=32, depth=2, heads=2, mlp_dim=64, pool=pool,
                  mask={"pattern": pattern, "block": 16}, backend="blocked", pad_multiple=16).eval()
    x = torch.randint(1, 20, (2, 40))
    lengths = torch.tensor([40, 25])
    out = enc(x, lengths)
    junk = torch.cat([x, torch.randint(1, 20, (2, 30))], dim=1)  # garbage past the lengths
    junk[1, 25:40] = torch.randint(1, 20, (15,))
    assert torch.allclose(enc(junk, lengths), out, atol=1e-5)
    alone = enc(x[1:, :25], lengths[1:])
    assert torch.allclose(alone, out[1:], atol=1e-5)


def test_classifier_dual_encoder_and_options():
    model = build_model({"dim": 32, "depth": 1, "heads": 2, "mlp_dim": 64, "embedding": "pixel",
                         "positions": "sinusoidal", "pool": "mean"}, ATTN, vocab_size=257, max_len=64,
                        num_classes=10)
    batch = {"x": torch.randint(1, 257, (3, 64)), "lengths": torch.full((3,), 64)}
    assert model(batch).shape == (3, 10)
    dual = build_model({"dim": 32, "depth": 1, "heads": 2, "mlp_dim": 64}, ATTN, vocab_size=257, max_len=30,
                       num_classes=2, pair=True)
    batch = {"x": torch.randint(1, 257, (2, 30)), "lengths": torch.tensor([30, 12]),
             "x2": torch.randint(1, 257, (2, 20)), "lengths2": torch.tensor([5, 20])}
    logits = dual(batch)
    assert logits.shape == (2, 2)
    logits.sum().backward()
    assert all(p.grad is not None for p in dual.parameters() if p.requires_grad)


def test_mask_from_attention_config():
    model = build_model({"dim": 32, "depth": 1, "heads": 2, "mlp_dim": 64},
                        {"pattern": "butterfly", "block": 16, "backend": "blocked", "params": {"factors": None}},
                        vocab_size=20, max_len=255, num_classes=10)
    assert model.encoder.pad_multiple == 16  # the mask block: sequences padded to whole blocks
    mask = model.encoder.blocks[0].attn.mask_for(256)
    assert mask == sparseflash.masks.make("butterfly", 256, block=16) and mask.density < 0.5
    assert sinusoidal_positions(10, 8).shape == (10, 8)
    with pytest.raises(ValueError, match="max_len"):
        model({"x": torch.ones(1, 300, dtype=torch.long), "lengths": torch.tensor([300])})


def test_token_table_init_std_follows_the_config():
    torch.manual_seed(0)
    default = Encoder(vocab_size=300, max_len=64, dim=64)
    torch.manual_seed(0)
    plain = torch.nn.Embedding(300, 64, padding_idx=0)
    assert torch.equal(default.embed.weight, plain.weight)  # 1.0: PyTorch's own init, no extra draws
    small = Encoder(vocab_size=300, max_len=64, dim=64, embed_std=0.02)
    assert torch.all(small.embed.weight[0] == 0)  # padding
    assert abs(small.embed.weight[1:].std().item() - 0.02) < 0.002
    assert abs(default.embed.weight[1:].std().item() - 1.0) < 0.05
    with pytest.raises(ValueError, match="embed_std"):
        Encoder(vocab_size=300, max_len=64, dim=64, embedding="pixel", embed_std=0.02)


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_a_masked_token_reaches_no_output(pool):
    """The masked token (Pathfinder's black pixel) is no key and is not pooled: its embedding cannot
    change the output, while any other token's does; padding past a length still counts for nothing."""
    encoder = Encoder(vocab_size=20, max_len=48, dim=32, heads=4, pool=pool, masked_token=1, pad_multiple=16)
    encoder.eval()
    x = torch.randint(1, 20, (3, 41))
    x[:, ::3] = 1
    lengths = torch.tensor([41, 30, 7])
    before = encoder(x, lengths)
    with torch.no_grad():
        encoder.embed.weight[1].normal_()
    assert torch.allclose(encoder(x, lengths), before, atol=1e-6)
    with torch.no_grad():
        encoder.embed.weight[2:].normal_()
    assert not torch.allclose(encoder(x, lengths), before, atol=1e-3)
    assert torch.isfinite(before).all()
