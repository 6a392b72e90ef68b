"""Weighted mixtures of data sources (``[[data.sources]]``): which source each window comes from.

The global window stream of ``trainer.data.windows`` is numbered 0, 1, 2, ... whatever the
data-parallel degree. Window k comes from source ``Schedule.source(k)``, a pure function of the
seed and k: every rank computes it alone, nothing is exchanged to agree on it, and a resume at
window k (at any dp degree) continues the same sequence. Each source is a loader of its own
(``PretrainDataset`` or ``SFTDataset``) that produces its windows in its own order, epoch after
epoch, its position kept in the mixture's state.

The schedule is smooth weighted round-robin (nginx's) over integer weights: the weights
apportioned to ``PERIOD`` slots (largest remainders), one period of picks tabulated, window k
taking slot ``(k + offset) % PERIOD`` with a seeded offset. Smooth round-robin keeps each
source's count after every pick within about one window of its share, so any run of N
consecutive windows holds ``N * share +- tolerance`` of a source's windows, ``tolerance``
(``Schedule.tolerance``, under 2 for two sources) counted over the whole period; apportioning
moves a share by under 1 / PERIOD. Pretraining windows all hold ``seq_len + 1`` tokens, so
window shares are token shares; SFT windows are samples (or packed rows), so there the schedule
sets the share of samples.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from typing import Any

import torch

from trainer.data.windows import WindowDataset
from trainer.errors import UserError

PERIOD = 1 << 12


class Schedule:
    """Which source window k comes from: smooth weighted round-robin, seeded, a pure function of (seed, k)."""

    def __init__(self, weights: list[float], seed: int, names: list[str]) -> None:
        total = sum(weights)
        exact = [w / total * PERIOD for w in weights]
        slots = [int(x) for x in exact]
        for s in sorted(range(len(weights)), key=lambda s: slots[s] - exact[s])[: PERIOD - sum(slots)]:
            slots[s] += 1
        for s, n in enumerate(slots):
            if n == 0:
                raise UserError(f"source {names[s]}: weight {weights[s]} is below 1/{PERIOD} of the total "
                                f"{total}; raise it or leave the source out")
        self.shares = [n / PERIOD for n in slots]
        self.table = array("H" if len(slots) <= 1 << 16 else "I")
        current = [0] * len(slots)
        for _ in range(PERIOD):
            for s, n in enumerate(slots):
                current[s] += n
            pick = max(range(len(slots)), key=current.__getitem__)
            current[pick] -= PERIOD
            self.table.append(pick)
        self.offset = random.Random(f"mixture:{seed}").randrange(PERIOD)
        self.tolerance = self._tolerance(slots)

    def _tolerance(self, slots: list[int]) -> float:
        """The most any run of consecutive windows strays from `length * share` windows of a source:
        the spread of (count - k * share) over a period's prefixes, which repeat every period."""
        picks = torch.tensor(self.table.tolist())
        k = torch.arange(PERIOD + 1, dtype=torch.float64)
        worst = 0.0
        for s, n in enumerate(slots):
            count = torch.cat([torch.zeros(1, dtype=torch.float64), (picks == s).cumsum(0).double()])
            error = count - k * n / PERIOD
            worst = max(worst, float(error.max() - error.min()))
        return worst

    def source(self, k: int) -> int:
        return self.table[(k + self.offset) % PERIOD]


class MixtureDataset(WindowDataset):
    """Windows of several sources, window k from ``schedule.source(k)``.

    The state holds every source's own state under ``<name>/<key>``, the tokens of the windows
    each source gave so far (``<name>/tokens``) and the global ``windows`` count, which is also
    the schedule's position. Sources are read lazily: one starts reading when it first gives a
    window, on every rank at the same window, so the exchange rounds of all sources stay in
    step across the ranks.
    """

    kind = "mixture"

    def __init__(self, parts: list[WindowDataset], names: list[str], weights: list[float], seed: int,
                 batch_size: int, dp_rank: int, dp_degree: int) -> None:
        self.parts = parts
        self.names = names
        self.weights = weights
        self.schedule = Schedule(weights, seed, names)
        self.part_keys = [tuple(k for k in part.state_keys if k != "windows") for part in parts]
        self.state_keys = (
            *(f"{n}/{k}" for n, keys in zip(names, self.part_keys) for k in (*keys, "tokens")), "windows")
        super().__init__(batch_size, dp_rank, dp_degree)

    def windows(self, state: dict[str, int]) -> Iterator[tuple[Any, dict[str, int]]]:
        flat = {k: state[k] for k in self.state_keys if k != "windows"}
        streams: list[Iterator[tuple[Any, dict[str, int]]] | None] = [None] * len(self.parts)
        k = state["windows"]
        while True:
            s = self.schedule.source(k)
            name, part = self.names[s], self.parts[s]
            stream = streams[s]
            if stream is None:
                stream = streams[s] = part.windows({key: flat[f"{name}/{key}"] for key in self.part_keys[s]})
            window, after = next(stream)
            flat.update({f"{name}/{key}": value for key, value in after.items()})
            flat[f"{name}/tokens"] += part.window_tokens(window)
            k += 1
            yield window, dict(flat)

    def collate(self, windows: list[Any]) -> dict[str, torch.Tensor]:
        # the sources share the kind, tokenizer, seq_len and SFT options, so any of them batches all
        return self.parts[0].collate(windows)

    def window_tokens(self, window: Any) -> int:
        return self.parts[0].window_tokens(window)

    def metrics(self, state: dict[str, Any]) -> dict[str, int]:
        """Summed counts of the sources (bad rows, SFT samples cut or dropped), and per source
        data/tokens/<name> and data/epoch/<name>."""
        out: dict[str, int] = {}
        for name, part in zip(self.names, self.parts):
            own = {key[len(name) + 1:]: value for key, value in state.items() if key.startswith(f"{name}/")}
            for key, value in part.metrics(own).items():
                if key != "data/epoch":
                    out[key] = out.get(key, 0) + value
        for name in self.names:
            out[f"data/tokens/{name}"] = int(state[f"{name}/tokens"])
            out[f"data/epoch/{name}"] = int(state[f"{name}/epoch"])
        return out

    def describe(self, option: str, micro_batches: int, what: str) -> list[str]:
        total_windows = micro_batches * self.batch_size * self.dp_degree
        tolerance = self.schedule.tolerance
        lines = [f"{option}: {len(self.parts)} source{'s' * (len(self.parts) != 1)}, window k from schedule(seed, k) "
                 f"(smooth weighted round-robin: any N consecutive sequences hold N x share +- {tolerance:.1f} "
                 f"of each source's)"]
        for name, weight, share, part in zip(self.names, self.weights, self.schedule.shares, self.parts):
            per_epoch = part.epoch_windows()
            epochs = (f"~{share * total_windows / per_epoch:.3g} epochs in {what}"
                      if per_epoch else "epochs unknown (not read ahead)")
            size = f"{part.source.size / 1e6:,.1f} MB {part.source.format}" if part.source.files else "hub dataset"
            lines.append(f"  {name}: weight {weight:g} ({100 * share:.1f} %)  {part.source.name}  {size}  "
                         f"~{per_epoch or 0:,.0f} sequences per epoch  {epochs}")
        return lines
