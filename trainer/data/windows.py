"""The data-parallel scheme shared by pretraining and SFT: a global stream of windows, split by rank.

Data order does not depend on the data-parallel degree. The stream of windows
(``seq_len + 1`` tokens each for pretraining; samples or packed rows for SFT) is
numbered globally 0, 1, 2, ... For each micro-batch (a global counter over all
micro-batches, gradient accumulation included) the next ``batch_size * dp_degree``
windows are split in rank order: rank r gets windows ``[r*B, (r+1)*B)`` of that
group. So dp=1,B=8 and dp=2,B=4 put the same 8 windows into every step.
"""

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from trainer.errors import UserError

# The label of a token that carries no loss (cross_entropy's ignore_index).
IGNORE_INDEX = -100
# Documents tokenized to estimate the windows of an epoch (epoch_windows) for the startup summary.
ESTIMATE_DOCS = 64
# The counts of a state that the metrics show as data/<key>.
METRIC_KEYS = ("epoch", "samples", "truncated", "dropped", "bad_rows")


class WindowDataset(IterableDataset):
    """Hands this rank its windows of each micro-batch; the state is global.

    Subclasses produce the window stream from a state and say how to batch
    windows. The state is a flat dict of ints (plus ``kind``), identical on all
    ranks, so a state saved at one dp degree resumes exactly at another.
    ``stats()`` gives the same numbers for logging (``epoch`` included).

    Iterating again continues where the last iterator stopped: the stream is
    endless, and only one iterator should be live at a time.
    """

    kind = ""
    state_keys: tuple[str, ...] = ()

    def __init__(self, batch_size: int, dp_rank: int, dp_degree: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self._state: dict[str, int] = dict.fromkeys(self.state_keys, 0)

    def windows(self, state: dict[str, int]) -> Iterator[tuple[Any, dict[str, int]]]:
        """Yield (window, state just after that window) from ``state`` on, forever."""
        raise NotImplementedError

    def collate(self, windows: list[Any]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def window_tokens(self, window: Any) -> int:
        """The tokens of a window that carry loss (a mixture's data/tokens/<source>)."""
        return int((self.collate([window])["labels"] != IGNORE_INDEX).sum())

    def epoch_windows(self) -> float | None:
        """About how many windows one epoch makes, for the startup summary; None when unknown."""
        return None

    def metrics(self, state: dict[str, Any]) -> dict[str, int]:
        """The data/* metrics of a state (``state_dict()``'s): epoch, bad rows skipped, SFT samples cut or dropped."""
        return {f"data/{k}": int(state[k]) for k in METRIC_KEYS if k in state}

    def describe(self, option: str, micro_batches: int, what: str) -> list[str]:
        """Startup summary lines about the data (a mixture's sources), which gives `micro_batches` in `what`."""
        return []

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        stream = self.windows(dict(self._state))
        group = self.batch_size * self.dp_degree
        lo = self.dp_rank * self.batch_size
        hi = lo + self.batch_size
        while True:
            mine = []
            for k in range(group):
                window, state = next(stream)
                if lo <= k < hi:
                    mine.append(window)
            self._state = {**state, "windows": self._state["windows"] + group}
            yield self.collate(mine)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self._state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("kind") != self.kind or set(state_dict) != {"kind", *self.state_keys}:
            raise UserError(
                f"data loader state does not fit this {self.kind} loader "
                f"(saved keys: {', '.join(sorted(state_dict))})"
            )
        self._state = {k: int(state_dict[k]) for k in self.state_keys}

    def stats(self) -> dict[str, int]:
        return dict(self._state)
