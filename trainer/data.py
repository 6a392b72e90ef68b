"""Pretraining data: documents -> tokens -> packed windows -> per-rank micro-batches.

Data order does not depend on the data-parallel degree. The stream of windows
(``seq_len + 1`` tokens each for pretraining; samples or packed rows for SFT) is
numbered globally 0, 1, 2, ... For each micro-batch (a global counter over all
micro-batches, gradient accumulation included) the next ``batch_size * dp_degree``
windows are split in rank order: rank r gets windows ``[r*B, (r+1)*B)`` of that
group. So dp=1,B=8 and dp=2,B=4 put the same 8 windows into every step.

Every rank reads and tokenizes the whole stream and keeps only what it owns.
That costs ``dp_degree`` times the tokenization work of a sharded reader, which
is negligible next to a training step at this project's scale, and it makes the
loader state global: every rank holds the same state, and a state saved at one
dp degree resumes exactly at another.
"""

import json
import logging
import os
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.errors import UserError
from trainer.metrics import warn
from trainer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from trainer.sft_data import SFTOptions

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
DATA_FORMATS = ("auto", "jsonl", "parquet", "text")
KINDS = ("pretrain", "sft")
BAD_ROWS = ("error", "skip")
# Local pretraining data up to this size is checked row by row before the first step, so a
# bad row stops the run before any work. JSON Lines parse at roughly 100 MB/s on one core,
# so this costs seconds at worst; beyond it the check would rival the run it protects, and
# rows are checked as the stream reaches them. SFT data is always read whole up front.
VALIDATE_MAX_BYTES = 1 << 30
# A long read says how far it got once it has taken PROGRESS_AFTER_S, then every PROGRESS_EVERY_S.
PROGRESS_AFTER_S = 1.0
PROGRESS_EVERY_S = 10.0
_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text"}

# Where a row came from, formatted only when an error needs it: (file or dataset, unit, number).
Location = tuple[str, str, int]


def where(loc: Location) -> str:
    name, unit, n = loc
    return f"{name}:{n}" if unit == "line" else f"{name} {unit} {n}"


class BadRow(NamedTuple):
    """Stands in a row stream for a row that could not be read: what is wrong with it."""

    problem: str


Row = dict[str, Any] | BadRow


class Progress:
    """Prints how far a read got, once it has run over PROGRESS_AFTER_S, and when it is done."""

    def __init__(self, what: str, verbose: bool) -> None:
        self.what = what
        self.verbose = verbose
        self.start = self.last = time.perf_counter()
        self.printed = False

    def tick(self, rows: int) -> None:
        if not self.verbose:
            return
        now = time.perf_counter()  # tens of ns, next to microseconds to parse a row
        if now - self.last >= (PROGRESS_EVERY_S if self.printed else PROGRESS_AFTER_S):
            print(f"{self.what}: at row {rows:,} after {now - self.start:.0f} s", flush=True)
            self.last, self.printed = now, True

    def done(self, rows: int) -> None:
        if self.printed:
            print(f"{self.what}: {rows:,} rows in {time.perf_counter() - self.start:.1f} s", flush=True)


def skip_warning(name: str, first: str, count: int | None = None) -> str:
    """The one warning of a run that skips bad rows, naming the first (with the count when known)."""
    rows = f"{count} bad row{'s' * (count != 1)}" if count is not None else "bad rows"
    return (f"skipping {rows} of data {name} (data.bad_rows = 'skip'; counted as data/bad_rows), "
            f"the first: {first}")


class DataSource:
    """A resolved data path: local files of one format, or a Hugging Face hub dataset."""

    def __init__(self, path: str, data_format: str = "auto") -> None:
        if data_format not in DATA_FORMATS:
            raise UserError(
                f"unknown data format '{data_format}' (expected one of: {', '.join(DATA_FORMATS)})"
            )
        self.name = path
        path = os.path.expanduser(path)
        if os.path.isdir(path):
            files = sorted(
                os.path.join(path, f) for f in os.listdir(path)
                if not f.startswith(".") and os.path.splitext(f)[1] in _EXTENSIONS
            )
            if data_format != "auto":
                files = [f for f in files if _EXTENSIONS[os.path.splitext(f)[1]] == data_format]
            if not files:
                wanted = ", ".join(e for e, f in _EXTENSIONS.items() if data_format in ("auto", f))
                raise UserError(f"data folder {path} has no data files ({wanted})")
            formats = {_EXTENSIONS[os.path.splitext(f)[1]] for f in files}
            if len(formats) > 1:
                raise UserError(
                    f"data folder {path} mixes formats ({', '.join(sorted(formats))}); "
                    "set the data format or split the folder"
                )
            self.format = formats.pop()
            self.files = files
        elif os.path.isfile(path):
            ext = os.path.splitext(path)[1]
            if data_format == "auto" and ext not in _EXTENSIONS:
                raise UserError(
                    f"cannot tell the format of {path} from its extension; set the data format "
                    f"to one of: {', '.join(DATA_FORMATS[1:])}"
                )
            self.format = _EXTENSIONS[ext] if data_format == "auto" else data_format
            self.files = [path]
        elif _looks_local(path):
            raise UserError(f"data path not found: {path}")
        else:
            self.format = "hub"
            self.files = []
        self.size = sum(os.path.getsize(f) for f in self.files)
        if self.files and self.size == 0:
            raise UserError(f"data path {path} is empty")

    def rows(self, start: int = 0) -> Iterator[tuple[Location, Row]]:
        """Rows in stream order from row ``start`` on (blank JSONL lines are not rows).

        A row that cannot be read (not UTF-8, not JSON, not an object) comes as a
        ``BadRow`` in its place, so the consumer decides whether to stop or skip it and
        row numbers stay those of the file.
        """
        if self.format == "jsonl":
            yield from _jsonl_rows(self.files, start)
        elif self.format == "text":
            yield from _text_rows(self.files, start)
        else:
            yield from self._hf_rows(start)

    def _hf_rows(self, start: int) -> Iterator[tuple[Location, Row]]:
        import datasets  # slow to import; only parquet and hub data need it

        try:
            if self.format == "hub":
                ds = datasets.load_dataset(self.name, split="train", streaming=True)
            else:
                ds = datasets.load_dataset(
                    self.format, data_files=self.files, split="train", streaming=True
                )
            if start:
                ds = ds.skip(start)
            for i, row in enumerate(ds, start):
                yield (self.name, "row", i), row
        except Exception as e:
            raise UserError(f"could not read data {self.name}: {_first_line(e)}") from None

    def locate(self, loc: Location) -> str:
        """Name the file and row of a row numbered across several parquet files."""
        _, unit, i = loc
        if self.format == "parquet" and unit == "row":
            import pyarrow.parquet as pq

            for f in self.files:
                n = pq.ParquetFile(f).metadata.num_rows
                if i < n:
                    return f"{f} row {i}"
                i -= n
        return where(loc)


def _looks_local(path: str) -> bool:
    # Anything that is not "name" or "owner/name" is meant as a file path; so is
    # "data/missing" when "data" exists here. Hub lookups of typos would otherwise
    # retry the network for half a minute before failing.
    parts = path.split("/")
    return (
        path.startswith((".", "/"))
        or os.path.splitext(path)[1] in _EXTENSIONS
        or len(parts) > 2
        or os.path.exists(parts[0])
    )


def _first_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


def _jsonl_rows(files: list[str], start: int) -> Iterator[tuple[Location, Row]]:
    # Read JSON Lines ourselves rather than through datasets: errors name the exact
    # file and line, and resuming skips lines without parsing them.
    index = 0
    for path in files:
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
            f.seek(0)
            if head.startswith(b"[") and path.endswith(".json"):
                items = _json_array(path, f.read())
                for i in range(max(start - index, 0), len(items)):
                    yield (path, "item", i), _object(items[i])
                index += len(items)
                continue
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if index >= start:
                    yield (path, "line", lineno), _json_line(line)
                index += 1


def _json_line(line: bytes) -> Row:
    try:
        # utf-8-sig: a byte order mark is accepted, as json.loads accepts it in bytes
        text = line.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return BadRow(_not_utf8(e))
    try:
        return _object(json.loads(text))
    except (ValueError, RecursionError) as e:
        return BadRow(f"not valid JSON ({_first_line(e)})")


def _object(row: Any) -> Row:
    return row if isinstance(row, dict) else BadRow(f"expected a JSON object, got {type(row).__name__}")


def _not_utf8(e: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start + 1})"


def _json_array(path: str, raw: bytes) -> list[Any]:
    # A .json file holding one array of objects (like alpaca_data.json); a broken file
    # has no rows to skip, so it is always an error.
    try:
        return json.loads(raw)
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({_first_line(e)})") from None


def _text_rows(files: list[str], start: int) -> Iterator[tuple[Location, Row]]:
    # One row per line, as datasets' text builder makes them (universal newlines, line breaks
    # dropped, blank lines kept as rows), read here so that an undecodable line is one bad row
    # at its line number instead of an error for the whole file. bytes.splitlines splits at
    # \n, \r\n and \r only: the universal newlines.
    index = 0
    for path in files:
        lineno = 0
        with open(path, "rb") as f:
            for chunk in f:
                for line in chunk.splitlines():
                    lineno += 1
                    if index >= start:
                        row: Row
                        try:
                            row = {"text": line.decode("utf-8")}
                        except UnicodeDecodeError as e:
                            row = BadRow(_not_utf8(e))
                        yield (path, "line", lineno), row
                    index += 1


class WindowDataset(IterableDataset):
    """Hands this rank its windows of each micro-batch; the state is global.

    Subclasses produce the window stream from a state and say how to batch
    windows. The state is a flat dict of ints (plus ``kind``), identical on all
    ranks. ``stats()`` gives the same numbers for logging (``epoch`` included).

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


class PretrainDataset(WindowDataset):
    """Documents as BOS + text + EOS, concatenated and cut into ``seq_len + 1`` windows.

    No shuffling: windows come in stream order, epoch after epoch. The state is
    the position of the next unused token, ``(epoch, doc, offset)`` = token
    ``offset`` of document ``doc`` (row number within the epoch). The packing
    buffer is always a suffix of one document, so resuming re-tokenizes that
    document and drops its first ``offset`` tokens. ``bad_rows`` counts the bad
    rows skipped before that document (each time the stream passes one), so it
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
    ) -> None:
        super().__init__(batch_size, dp_rank, dp_degree)
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        # a line of a text file is the field "text"
        self.text_field = "text" if source.format == "text" else text_field
        self.bad_rows = bad_rows
        self.verbose = verbose
        self._warned = False

    def _problem(self, row: Row) -> str | None:
        if isinstance(row, BadRow):
            return row.problem
        if not isinstance(row.get(self.text_field), str):
            return _field_problem(row, self.text_field)
        return None

    def _bad_row(self, loc: Location, problem: str) -> str:
        """The line naming a bad row; with data.bad_rows = "error" it stops the run."""
        line = f"{self.source.locate(loc)}: {problem}"
        if self.bad_rows == "error":
            raise UserError(line)
        return line

    def _no_documents(self) -> UserError:
        return UserError(f"data {self.source.name} has no documents (no non-empty '{self.text_field}')")

    def validate(self) -> None:
        """Read every row once, before the first step: a bad row stops the run here, or is warned about."""
        progress = Progress(f"checking data {self.source.name} ({self.source.size / 1e6:,.1f} MB)", self.verbose)
        found, bad, first = False, 0, ""
        n = 0
        for n, (loc, row) in enumerate(self.source.rows(), 1):
            problem = self._problem(row)
            if problem is not None:
                first = first or self._bad_row(loc, problem)
                bad += 1
            elif not found and row[self.text_field].strip():
                found = True
            progress.tick(n)
        progress.done(n)
        if not found:
            raise self._no_documents()
        if bad and self.verbose:
            warn(skip_warning(self.source.name, first, bad))
        # the stream need not warn again about rows already reported
        self._warned = True

    def documents(self, epoch: int, start: int, bad: int) -> Iterator[tuple[int, int, int, list[int]]]:
        """Yield (epoch, doc, bad rows skipped so far, tokens) forever, from row ``start`` of ``epoch``."""
        while True:
            found = False
            for doc, (loc, row) in enumerate(self.source.rows(start), start):
                problem = self._problem(row)
                if problem is not None:
                    line = self._bad_row(loc, problem)
                    if self.verbose and not self._warned:
                        warn(skip_warning(self.source.name, line))
                    self._warned = True
                    bad += 1
                    continue
                text = row[self.text_field]
                if text.strip():
                    found = True
                    yield epoch, doc, bad, self.tokenizer.encode(text, bos=True, eos=True)
            if not found and start == 0:
                raise self._no_documents()
            epoch, start = epoch + 1, 0

    def windows(self, state: dict[str, int]) -> Iterator[tuple[list[int], dict[str, int]]]:
        size = self.seq_len + 1
        buf: list[int] = []
        for epoch, doc, bad, tokens in self.documents(state["epoch"], state["doc"], state["bad_rows"]):
            skip = state["offset"] if (epoch, doc) == (state["epoch"], state["doc"]) else 0
            buf.extend(tokens[skip:])
            pos = 0
            while len(buf) - pos >= size:
                pos += size
                yield buf[pos - size:pos], {
                    "epoch": epoch, "doc": doc, "offset": len(tokens) - (len(buf) - pos), "bad_rows": bad,
                }
            del buf[:pos]

    def collate(self, windows: list[list[int]]) -> dict[str, torch.Tensor]:
        t = torch.tensor(windows, dtype=torch.long)
        return {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


def _field_problem(row: dict[str, Any], field: str) -> str:
    if row.get(field) is None:
        return f"missing field '{field}' (fields: {', '.join(map(str, row)) or 'none'})"
    return f"field '{field}' must be a string, got {type(row[field]).__name__}"


def build_dataloader(
    *,
    kind: str,
    path: str,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    text_field: str = "text",
    data_format: str = "auto",
    sft_options: "SFTOptions | None" = None,
    bad_rows: str = "error",
    verbose: bool = False,
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
    ``verbose``: this process prints progress and warnings (one rank of a run).
    """
    if kind not in KINDS:
        raise UserError(f"unknown data kind '{kind}' (expected one of: {', '.join(KINDS)})")
    for name, value, low in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1),
                             ("dp_degree", dp_degree, 1)):
        if value < low:
            raise UserError(f"{name} must be >= {low}, got {value}")
    if not 0 <= dp_rank < dp_degree:
        raise UserError(f"dp_rank {dp_rank} is outside [0, {dp_degree})")
    if bad_rows not in BAD_ROWS:
        raise UserError(f"unknown bad_rows '{bad_rows}' (expected one of: {', '.join(BAD_ROWS)})")
    source = DataSource(path, data_format)
    dataset: WindowDataset
    if kind == "pretrain":
        dataset = PretrainDataset(
            source, tokenizer, seq_len, batch_size, dp_rank, dp_degree, text_field, bad_rows, verbose
        )
        if source.files and source.size <= VALIDATE_MAX_BYTES:
            dataset.validate()
    else:
        from trainer.sft_data import SFTDataset, SFTOptions  # sft_data imports this module

        dataset = SFTDataset(
            source, tokenizer, seq_len, batch_size, dp_rank, dp_degree, seed,
            sft_options or SFTOptions(), bad_rows, verbose,
        )
    # Batches are built inside the dataset, so batch_size=None; no workers, so the
    # dataset's state is exactly what has been handed out.
    with warnings.catch_warnings():
        # torchdata 0.11 calls a deprecated torch API on construction; not actionable here
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(dataset, batch_size=None, num_workers=0)
