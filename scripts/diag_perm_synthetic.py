"""Diagnostic for permutation learning on a synthetic layer (work in progress for the learned-perm issue).

A weight whose input columns were shuffled (inside 64-blocks) out of a column-level 2:4 structure
(two strong, two weak columns per group of four). Wanda's 2:4 mask on the shuffled weight must drop
strong columns; the secret permutation makes 2:4 nearly lossless. Prints the cosine reconstruction
loss of Wanda, of the oracle permutation, of the current learner, and how well the straight-through
gradient at the identity predicts the loss change of single transpositions (a gradient that carries
information correlates with the true change).

    python scripts/diag_perm_synthetic.py [--steps 300] [--lr 3e-2] [--relax l1l2|sinkhorn]
"""
from __future__ import annotations

import argparse

import torch

from shuffleprune.perm.learning import cosine_loss, learn_permutations, masked_weight
from shuffleprune.perm.core import PermSchedule, SoftPermutation, block_sizes, perm_to_blocks, random_block_perm


def synthetic(rows: int = 64, cols: int = 128, block: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    strong = torch.zeros(cols)
    for g in range(cols // 4):
        strong[g * 4 + torch.randperm(4, generator=gen)[:2]] = 1
    hidden = torch.randn(rows, cols, generator=gen) * torch.where(strong > 0, 1.0, 0.1)
    secret = random_block_perm(cols, block, gen)
    weight = torch.empty_like(hidden)
    weight[:, secret] = hidden  # weight[:, secret] is 2:4-friendly
    x = torch.randn(512, cols, generator=gen)
    return weight, x, secret


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--relax", default="sinkhorn")
    ap.add_argument("--lambda-max", type=float, default=1e-4)
    args = ap.parse_args()
    weight, x, secret = synthetic()
    cols, block = weight.shape[1], 64
    sizes = block_sizes(cols, block)
    score = weight.abs() * x.norm(dim=0)
    target = x @ weight.T

    def loss_of(perm: torch.Tensor, grad: bool = False):
        m = [b.clone().requires_grad_(grad) for b in perm_to_blocks(perm, sizes)]
        loss = cosine_loss(target, x @ masked_weight(weight, score, m, 2, 4).T)
        if not grad:
            return float(loss)
        loss.backward()
        return float(loss.detach()), torch.block_diag(*[b.grad[k] for b in m for k in range(b.shape[0])])

    ident = torch.arange(cols)
    print(f"wanda (identity) loss {loss_of(ident):.5f}   oracle loss {loss_of(secret):.5f}")
    sp = SoftPermutation(cols, block, relax=args.relax, init_identity=0.1)
    res = learn_permutations({"w": sp}, lambda mb, _t: cosine_loss(target, x @ masked_weight(weight, score, mb["w"], 2, 4).T),
                             PermSchedule(steps=args.steps, lambda_max=args.lambda_max), lr=args.lr)
    best = min(range(len(res.loss)), key=res.loss.__getitem__)
    print(f"learned ({args.relax}): final hardened loss {loss_of(res.perms['w']):.5f}, "
          f"best step {best} loss {res.loss[best]:.5f}")
    l0, grad = loss_of(ident, grad=True)
    gen = torch.Generator().manual_seed(5)
    pred, actual = [], []
    for _ in range(300):
        blk = int(torch.randint(0, cols // block, (1,), generator=gen))
        a, b = (torch.randperm(block, generator=gen)[:2] + blk * block).tolist()
        p = ident.clone()
        p[a], p[b] = b, a
        hard = torch.zeros(cols, cols)
        hard[p, torch.arange(cols)] = 1
        pred.append(float((grad * (hard - torch.eye(cols))).sum()))
        actual.append(loss_of(p) - l0)
    pred_t, act_t = torch.tensor(pred), torch.tensor(actual)
    corr = float(torch.corrcoef(torch.stack([pred_t, act_t]))[0, 1])
    print(f"gradient vs true change over 300 random transpositions: corr {corr:.3f}; "
          f"{float((act_t < 0).float().mean()):.0%} of them lower the loss")


if __name__ == "__main__":
    main()
