"""Growing a trained drafter into a larger one that computes exactly the same function.

New layers are placed between the old ones with zero output projections (o_proj and down_proj), so
each adds nothing to the residual stream until training moves it; a wider MLP keeps the old neurons
and gives the new ones zero columns in down_proj. The rest of a new layer (q|k|v, gate|up, norms) is
initialized as a fresh drafter is, so its gradients are not symmetric. A warm start that keeps what
the smaller drafter learnt (many training runs' worth) while the added capacity trains.
"""
from __future__ import annotations

import torch

from ddtree.models.dflash import DFlashDrafter, DrafterConfig, drafter_state_dict
from ddtree.models.loader import load_weights


def layer_places(old_layers: int, new_layers: int) -> list[int]:
    """Where each old layer goes among the new ones, spread evenly: 2 of 4 -> [0, 2]."""
    return [i * new_layers // old_layers for i in range(old_layers)]


def grow_drafter(drafter: DFlashDrafter, num_layers: int, intermediate_size: int, seed: int = 0,
                 std: float = 0.02) -> DFlashDrafter:
    """A drafter of `num_layers` layers and MLP width `intermediate_size` (each at least the old one's)
    whose outputs equal `drafter`'s, on the same device and dtype."""
    old = drafter.dcfg.model
    if num_layers < old.num_layers or intermediate_size < old.intermediate_size:
        raise ValueError(f"a drafter grows only: {old.num_layers} layers x MLP {old.intermediate_size} -> "
                         f"{num_layers} x {intermediate_size} asked")
    raw = {**drafter.dcfg.raw, "num_hidden_layers": num_layers, "intermediate_size": intermediate_size}
    dcfg = DrafterConfig.from_raw(raw)
    target_hidden = drafter.fc.in_features // len(dcfg.target_layer_ids)
    grown = DFlashDrafter(dcfg, target_hidden)
    g = torch.Generator().manual_seed(seed)
    fresh = {k: (torch.randn(v.shape, generator=g) * std if v.dim() == 2 else torch.ones(v.shape))
             for k, v in drafter_state_dict(grown).items()}
    I0 = old.intermediate_size
    places = layer_places(old.num_layers, num_layers)
    for name, w in drafter_state_dict(drafter).items():
        w = w.float()
        if not name.startswith("layers."):
            fresh[name] = w
            continue
        _, i, rest = name.split(".", 2)
        new = f"layers.{places[int(i)]}.{rest}"
        if rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            fresh[new][:I0] = w  # the old neurons first; the new ones keep their fresh rows
        elif rest.startswith("mlp.down_proj."):
            fresh[new].zero_()
            fresh[new][:, :I0] = w  # ... and read nothing from the new ones
        else:
            fresh[new] = w
    for j in set(range(num_layers)) - set(places):  # new layers: zero output, so an identity to start
        fresh[f"layers.{j}.self_attn.o_proj.weight"].zero_()
        fresh[f"layers.{j}.mlp.down_proj.weight"].zero_()
    load_weights(grown, fresh.items(), DFlashDrafter.packed, "grown drafter")
    p = next(drafter.parameters())
    grown = grown.to(p.device, p.dtype)
    grown.rotary.build(p.device)
    return grown.train(drafter.training).requires_grad_(p.requires_grad)
