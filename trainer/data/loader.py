"""Pretraining data: documents -> tokens -> packed windows -> per-rank micro-batches.

Every step takes the same global windows whatever the data-parallel degree, and the
loader state is global (``trainer.data.windows``).

Who tokenizes what. Documents are packed into ``seq_len + 1`` windows across document
boundaries, so where window k starts depends on the token count of every document
before it: a rank cannot find its own windows without the lengths of everyone else's.
So each rank of the run tokenizes only every world-th row, in ``data.num_workers``
worker processes ahead of use (``trainer.data.sharding``), and the ranks swap the
resulting tokens, one gloo all-gather per round of rows, about one round per
micro-batch (``trainer.data.exchange``). Every rank then holds the whole stream having
tokenized 1/world of it, and cuts the same windows as a single reader would, keeping
its own. The training thread only exchanges and cuts.

The trade-offs:

* Every rank receives all tokens of each micro-batch group (4 bytes x batch_size x
  dp x (seq_len + 1): 0.26 MB per step for the 7B config on 8 GPUs) and still scans
  every row, without parsing it, to keep row numbers global. Both grow with the number
  of ranks but cost well under a millisecond per step, next to the tokenization they
  replace (docs/benchmarks.md). Swapping lengths only would send less, but which rank
  needs a document is known only once the lengths are, so each rank would tokenize
  the documents of its own windows a second time.
* The exchange makes ranks read in step: a rank whose workers fall behind holds the
  others at the next round, as it would hold the training's collectives anyway.
* A bad row or a read error reaches every rank in the same round, so all ranks stop
  at the same step (and save the same checkpoint).
* The loader state is the position of the next unused token as the training thread
  took it, the same on every rank for any dp degree or number of workers; rows
  prefetched beyond it are read again after a resume.

A process that is no rank of a run (tests, scripts) reads alone: each simulated rank
tokenizes the whole stream. SFT data (``trainer.data.sft``) is small, read whole up
front on every rank and tokenized as it is used.
"""

import typing
import warnings
from array import array
from collections.abc import Iterator

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.config.schema import DataKind
from trainer.config.sources import SourceConfig
from trainer.data.exchange import Exchange, LocalExchange
from trainer.data.mixture import MixtureDataset
from trainer.data.sft import SFTDataset
from trainer.data.sft_options import SFTOptions
from trainer.data.sharding import (
    BadDoc,
    EpochEnd,
    ShareReader,
    merged_rows,
    read_share,
    text_problem,
)
from trainer.data.source import BadRow as BadRow  # scripts import it from here
from trainer.data.source import DataSource, Progress, skip_warning
from trainer.data.tokenizer import Tokenizer
from trainer.data.windows import ESTIMATE_DOCS, WindowDataset
from trainer.data.windows import IGNORE_INDEX as IGNORE_INDEX  # tests import it from here
from trainer.errors import UserError
from trainer.log import warn

KINDS = typing.get_args(DataKind)
BAD_ROWS = ("error", "skip")
# Local pretraining data up to this size is checked row by row before the first step, so a
# bad row stops the run before any work. JSON Lines parse at roughly 100 MB/s on one core,
# so this costs seconds at worst; beyond it the check would rival the run it protects, and
# rows are checked as the stream reaches them. SFT data is always read whole up front.
VALIDATE_MAX_BYTES = 1 << 30

# A stretch of one document inside a window: tokens[lo:hi].
Piece = tuple[array, int, int]


class PretrainDataset(WindowDataset):
    """Documents as BOS + text + EOS, concatenated and cut into ``seq_len + 1`` windows.

    No shuffling: windows come in stream order, epoch after epoch. The state is
    the position of the next unused token, ``(epoch, doc, offset)`` = token
    ``offset`` of document ``doc`` (row number within the epoch). What a window
    leaves unused is always a suffix of one document, so resuming re-tokenizes that
    document and drops its first ``offset`` tokens. ``bad_rows`` counts the
    bad rows skipped before that document (each time the stream passes one), so it
    resumes exactly too.
    """

    kind = "pretrain"
    state_keys = ("epoch", "doc", "offset", "bad_rows", "windows")

    def __init__(
        self,
        source: DataSource,
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        dp_rank: int,
        dp_degree: int,
        text_field: str = "text",
        bad_rows: str = "error",
        verbose: bool = False,
        num_workers: int = 0,
        exchange: Exchange | None = None,
    ) -> None:
        super().__init__(batch_size, dp_rank, dp_degree)
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        # a line of a text file is the field "text"
        self.text_field = "text" if source.format == "text" else text_field
        self.bad_rows = bad_rows
        self.verbose = verbose
        self.num_workers = num_workers
        self.exchange = exchange if exchange is not None else LocalExchange()
        self._warned = False
        self.rows: int | None = None  # counted by validate()

    def _bad_row(self, line: str) -> str:
        """The line naming a bad row; with data.bad_rows = "error" it stops the run."""
        if self.bad_rows == "error":
            raise UserError(line)
        return line

    def _no_documents(self) -> UserError:
        return UserError(f"{self.source.what} has no documents (no non-empty '{self.text_field}')")

    def validate(self) -> None:
        """Read every row once, before the first step: a bad row stops the run here, or is warned about.

        Each participant of the exchange parses its share of the rows; they swap what they found.
        """
        exchange = self.exchange
        progress = Progress(f"checking {self.source.what} ({self.source.size / 1e6:,.1f} MB)", self.verbose)
        first: tuple[int, str] | None = None
        found, bad, n = False, 0, 0
        for n, (loc, row) in enumerate(self.source.rows(0, lambda i: i % exchange.size == exchange.rank), 1):
            if row is not None:
                problem = text_problem(row, self.text_field)
                if problem is not None:
                    first = first or (n - 1, f"{self.source.locate(loc)}: {problem}")
                    bad += 1
                    if self.bad_rows == "error":
                        break
                elif not found and row[self.text_field].strip():
                    found = True
            progress.tick(n)
        progress.done(n)
        self.rows = n
        reports = exchange.all_gather((first, bad, found))
        firsts = sorted(r[0] for r in reports if r[0] is not None)
        line = self._bad_row(firsts[0][1]) if firsts else ""
        if not any(r[2] for r in reports):
            raise self._no_documents()
        bad = sum(r[1] for r in reports)
        if bad and self.verbose:
            warn(skip_warning(self.source.what, line, bad))
        # the stream need not warn again about rows already reported
        self._warned = True

    def documents(self, epoch: int, start: int, bad: int) -> Iterator[tuple[int, int, int, array]]:
        """Yield (epoch, doc, bad rows skipped so far, tokens) forever, from row ``start`` of ``epoch``."""
        reader = ShareReader(
            self.source, self.tokenizer, self.text_field, self.exchange.rank, self.exchange.size, epoch, start
        )
        group_tokens = self.batch_size * self.dp_degree * (self.seq_len + 1)
        rows = merged_rows(read_share(reader, self.num_workers), self.exchange, epoch, start, group_tokens)
        tokens, whole = 0, start == 0
        for epoch, doc, entry in rows:
            if isinstance(entry, EpochEnd):
                if whole:
                    self._check_epoch_size(tokens, group_tokens)
                tokens, whole = 0, True
            elif isinstance(entry, BadDoc):
                line = self._bad_row(entry.line)
                if self.verbose and not self._warned:
                    warn(skip_warning(self.source.what, line))
                self._warned = True
                bad += 1
            elif entry is not None:
                tokens += len(entry)
                yield epoch, doc, bad, entry

    def _check_epoch_size(self, tokens: int, group_tokens: int) -> None:
        """A whole epoch of `tokens` tokens: refused when it cannot fill one sequence, warned about when
        it cannot fill one micro-batch of every rank (each batch then holds it several times)."""
        if tokens == 0:
            raise self._no_documents()
        size = self.seq_len + 1
        if tokens < size:
            raise UserError(
                f"{self.source.what} holds {tokens} tokens, fewer than one sequence of seq_len + 1 = {size}: "
                "every sequence would repeat it; give more data or lower training.seq_len"
            )
        if tokens < group_tokens and self.verbose:
            warn(f"{self.source.what} holds {tokens} tokens, fewer than one micro-batch of all ranks "
                 f"({group_tokens} = batch_size x dp x (seq_len + 1)): each batch repeats it", once=True)

    def windows(self, state: dict[str, int]) -> Iterator[tuple[list[Piece], dict[str, int]]]:
        # Windows are lists of pieces of documents, so the windows of other ranks cost no copy.
        size = self.seq_len + 1
        pieces: list[Piece] = []
        filled = 0
        for epoch, doc, bad, tokens in self.documents(state["epoch"], state["doc"], state["bad_rows"]):
            lo = state["offset"] if (epoch, doc) == (state["epoch"], state["doc"]) else 0
            while lo < len(tokens):
                hi = min(lo + size - filled, len(tokens))
                pieces.append((tokens, lo, hi))
                filled += hi - lo
                lo = hi
                if filled == size:
                    yield pieces, {"epoch": epoch, "doc": doc, "offset": lo, "bad_rows": bad}
                    pieces, filled = [], 0

    def window_tokens(self, window: list[Piece]) -> int:
        return self.seq_len  # every label of a window is a token

    def epoch_windows(self) -> float | None:
        """The rows validate() counted times the mean tokens of the first documents, in windows."""
        if self.rows is None:
            return None
        lengths = []
        for _, row in self.source.rows():
            if row is not None and text_problem(row, self.text_field) is None and row[self.text_field].strip():
                lengths.append(len(self.tokenizer.encode(row[self.text_field], bos=True, eos=True)))
                if len(lengths) == ESTIMATE_DOCS:
                    break
        return self.rows * sum(lengths) / max(len(lengths), 1) / (self.seq_len + 1)

    def collate(self, windows: list[list[Piece]]) -> dict[str, torch.Tensor]:
        rows = []
        for pieces in windows:
            row = array("i")
            for tokens, lo, hi in pieces:
                row += tokens[lo:hi]
            rows.append(torch.frombuffer(row, dtype=torch.int32))
        t = torch.stack(rows).long()
        return {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


def _check_loader_args(
    kind: str, seq_len: int, batch_size: int, dp_rank: int, dp_degree: int, num_workers: int, bad_rows: str
) -> None:
    if kind not in KINDS:
        raise UserError(f"unknown data kind '{kind}' (expected one of: {', '.join(KINDS)})")
    for name, value, low in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1),
                             ("dp_degree", dp_degree, 1), ("num_workers", num_workers, 0)):
        if value < low:
            raise UserError(f"{name} must be >= {low}, got {value}")
    if not 0 <= dp_rank < dp_degree:
        raise UserError(f"dp_rank {dp_rank} is outside [0, {dp_degree})")
    if bad_rows not in BAD_ROWS:
        raise UserError(f"unknown bad_rows '{bad_rows}' (expected one of: {', '.join(BAD_ROWS)})")


def build_dataloader(
    *, kind: str, path: str, tokenizer: Tokenizer, seq_len: int, batch_size: int, dp_rank: int, dp_degree: int,
    seed: int, text_field: str = "text", data_format: str = "auto", sft_options: SFTOptions | None = None,
    bad_rows: str = "error", num_workers: int = 0, exchange: Exchange | None = None, verbose: bool = False,
    option: str = "data.path", sources: list[SourceConfig] | None = None,
) -> StatefulDataLoader:
    """Endless loader of this rank's micro-batches (dicts of LongTensors).

    pretrain: ``input_ids``, ``labels`` of shape (batch_size, seq_len).
    sft: the same keys (labels -100 outside trained tokens); packed SFT adds
    ``position_ids`` and ``document_ids`` and has fixed shapes, unpacked SFT is
    padded to the longest sample of the micro-batch.
    ``loader.dataset.stats()`` has ``epoch``, ``windows`` and for SFT the counts
    of ``samples``, ``truncated`` and ``dropped`` samples, and ``bad_rows``
    skipped, for logging. ``seed`` drives SFT shuffling; pretraining data comes in
    stream order.

    Bad rows (not UTF-8, not JSON, a missing or mistyped field) stop with a
    UserError naming the file and line, or with ``bad_rows="skip"`` are skipped and
    counted. Local data is checked whole here, before any batch, when it is SFT data
    or at most VALIDATE_MAX_BYTES; otherwise as the stream reaches each row.

    Pretraining only: ``exchange`` is the group of processes that share the reading
    (``world_exchange()`` in a run: every rank of it calls this together), None to read
    alone; ``num_workers`` worker processes tokenize this process's share ahead of use.
    ``verbose``: this process prints progress and warnings (one rank of a run).
    ``option``: the config key `path` came from (data.path, validation.path), named by data errors.
    A pretraining corpus shorter than one sequence is refused.

    ``sources`` (non-empty): a weighted mixture instead of ``path`` (``trainer.data.mixture``), each
    checked here like ``path``, its errors naming ``<section>.sources[i] (<name>)``.
    """
    _check_loader_args(kind, seq_len, batch_size, dp_rank, dp_degree, num_workers, bad_rows)

    def dataset_of(path: str, data_format: str, text_field: str, option: str) -> WindowDataset:
        source = DataSource(path, data_format, option)
        if kind == "sft":
            return SFTDataset(source, tokenizer, seq_len, batch_size, dp_rank, dp_degree, seed,
                              sft_options or SFTOptions(), bad_rows, verbose)
        part = PretrainDataset(source, tokenizer, seq_len, batch_size, dp_rank, dp_degree, text_field, bad_rows,
                               verbose, num_workers, exchange)
        if source.files and source.size <= VALIDATE_MAX_BYTES:
            part.validate()
        return part

    dataset: WindowDataset
    if sources:
        section = option.split(".")[0]
        parts = [dataset_of(src.path, src.format or data_format, src.text_field or text_field, src.option(section, i))
                 for i, src in enumerate(sources)]
        dataset = MixtureDataset(parts, [src.label(i) for i, src in enumerate(sources)],
                                 [src.weight for src in sources], seed, batch_size, dp_rank, dp_degree)
    else:
        dataset = dataset_of(path, data_format, text_field, option)
    # Batches are built inside the dataset (batch_size=None), in this process (workers only
    # tokenize ahead), so the saved state is the same for any number of workers and ranks.
    with warnings.catch_warnings():
        # torchdata 0.11 calls a deprecated torch API on construction; not actionable here
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(dataset, batch_size=None, num_workers=0)
