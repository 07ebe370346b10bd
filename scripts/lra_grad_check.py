"""Does the LRA model get the same loss and gradients from a fast backend as from the reference?

    PYTHONPATH=. python scripts/lra_grad_check.py                       # CUDA: triton vs reference
    PYTHONPATH=. python scripts/lra_grad_check.py --device cpu --backend blocked --dim 64 --depth 2 --seq 300

Builds the ListOps classifier of configs/model/lra.yaml (dense attention, block 128), one batch of
random ListOps tokens with ragged lengths (padding handled by key_lengths), and runs forward and
backward (dropout off) with ``--backend`` and with the fp32 ``reference`` attention, in fp32 and under
bf16 autocast. Prints the relative error of the logits and of every parameter's gradient (as a
whole-tensor norm ratio); the largest are listed. A training run that does not learn is first
checked here, to tell a kernel fault from an optimisation problem.
"""

import argparse
import copy

import torch
import torch.nn.functional as F

from sparseflash.data.listops import VOCAB_SIZE
from sparseflash.models.lra import build_model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def loss_and_grads(model, batch, labels, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast(batch["x"].device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(batch)
    loss = F.cross_entropy(logits.float(), labels)
    loss.backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1999)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    model_cfg = dict(dim=args.dim, depth=args.depth, heads=args.heads, mlp_dim=4 * args.dim, dropout=0.0,
                     embedding="token", positions="learned", pool="cls")
    fast = build_model(model_cfg, {"pattern": "dense", "block": 128, "backend": args.backend},
                       vocab_size=VOCAB_SIZE, max_len=args.seq, num_classes=10).to(device).eval()
    ref = copy.deepcopy(fast)
    for module in ref.modules():
        if hasattr(module, "backend"):
            module.backend = "reference"
    lengths = torch.randint(args.seq // 4, args.seq + 1, (args.batch,), device=device)
    x = torch.randint(1, VOCAB_SIZE, (args.batch, args.seq), device=device)
    x = x * (torch.arange(args.seq, device=device)[None] < lengths[:, None])
    batch = {"x": x, "lengths": lengths}
    labels = torch.randint(0, 10, (args.batch,), device=device)
    for autocast in (False, True):
        logits_f, grads_f = loss_and_grads(fast, batch, labels, autocast)
        logits_r, grads_r = loss_and_grads(ref, batch, labels, autocast)
        errs = sorted(((rel(grads_f[n], grads_r[n]), n) for n in grads_r), reverse=True)
        nan = any(not torch.isfinite(g).all() for g in grads_f.values())
        print(f"{args.backend} vs reference, {'bf16 autocast' if autocast else 'fp32'}: logits rel err "
              f"{rel(logits_f, logits_r):.2e}; gradient rel err max {errs[0][0]:.2e} ({errs[0][1]}), "
              f"median {errs[len(errs) // 2][0]:.2e}; non-finite gradients: {nan}")
        for err, name in errs[:4]:
            print(f"    {err:.2e}  {name}")


if __name__ == "__main__":
    main()
