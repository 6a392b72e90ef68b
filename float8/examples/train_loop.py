"""float8/ on its own: your model, your optimizer, your loop; no trainer.

    python -m float8.examples.train_loop          # CPU or one GPU, a few seconds

A small MLP learns a fixed random teacher twice: with a built-in recipe given by name, and
with a recipe of its own given as an object (no table to edit). Where torch._scaled_mm cannot
run a recipe on this device (CPU rowwise on torch 2.11), the GEMMs are emulated in high
precision with the same float8 rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from float8 import (
    E4M3,
    E5M2,
    HIGH_PRECISION,
    Cast,
    Float8Config,
    Float8Recipe,
    Gemm,
    convert_to_float8_training,
    scaled_mm_supported,
)

# tensorwise, but the weight gradient GEMM in high precision.
TENSORWISE_GW_HP = Float8Recipe(
    output=Gemm(Cast(E4M3), Cast(E4M3), fast_accum=True),
    grad_input=Gemm(Cast(E5M2), Cast(E4M3)),
    grad_weight=Gemm(HIGH_PRECISION, HIGH_PRECISION),
    name="tensorwise_gw_hp",
)
DIM = 32


def mlp() -> nn.Sequential:
    # cuBLAS float8 GEMMs need both weight dims divisible by 16.
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM), nn.GELU(), nn.Linear(DIM, 16))


def train(scaling: str | Float8Recipe, steps: int = 20, device: str = "cpu") -> list[float]:
    """The losses of `steps` AdamW steps of the MLP with its linears in float8 (the last one, the
    output, kept in high precision by name: "4" is its name in the Sequential)."""
    torch.manual_seed(0)
    teacher, model = mlp().to(device), mlp().to(device)
    config = Float8Config(scaling=scaling, filter_fqns=["4"])
    if not scaled_mm_supported(config.recipe.rowwise_gemms, device):
        config = Float8Config(scaling=scaling, filter_fqns=["4"], emulate=True)
    report = convert_to_float8_training(model, config=config)
    print(f"{config.recipe.name}: {report}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, DIM, device=device)
        with torch.no_grad():
            target = teacher(x)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f} in {steps} steps")
    return losses


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train("rowwise", device=device)  # a built-in recipe by name (torchao's name for it too)
    train(TENSORWISE_GW_HP, device=device)


if __name__ == "__main__":
    main()
