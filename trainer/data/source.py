"""Data sources: local JSON Lines, text and parquet files or a Hugging Face hub dataset, read as rows.

A row that cannot be read comes as a ``BadRow`` in its place, so the consumer decides
whether to stop or skip it and row numbers stay those of the file. Shared by
pretraining (``trainer.data.loader``) and SFT (``trainer.data.sft``).
"""

import glob
import hashlib
import json
import os
import time
import typing
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from trainer.config.schema import DataFormat
from trainer.data.globbing import glob_files
from trainer.errors import UserError
from trainer.log import info, route_library_warnings

DATA_FORMATS = typing.get_args(DataFormat)
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
            info(f"{self.what}: at row {rows:,} after {now - self.start:.0f} s")
            self.last, self.printed = now, True

    def done(self, rows: int) -> None:
        if self.printed:
            info(f"{self.what}: {rows:,} rows in {time.perf_counter() - self.start:.1f} s")


def skip_warning(what: str, first: str, count: int | None = None) -> str:
    """The one warning of a run that skips bad rows of `what` (DataSource.what), naming the first
    (with the count when known)."""
    rows = f"{count} bad row{'s' * (count != 1)}" if count is not None else "bad rows"
    return (f"skipping {rows} of {what} (data.bad_rows = 'skip'; counted as data/bad_rows), "
            f"the first: {first}")


class DataSource:
    """A resolved data path: local files of one format (a file, a folder or a glob), or a Hugging Face hub dataset.

    `option` is the config key the path came from (data.path, validation.path): errors about the
    path name it, and so do the lines of bad rows of any data but data.path's.
    """

    def __init__(self, path: str, data_format: str = "auto", option: str = "data.path") -> None:
        if data_format not in DATA_FORMATS:
            raise UserError(
                f"unknown data format '{data_format}' (expected one of: {', '.join(DATA_FORMATS)})"
            )
        self.name = path
        self.option = option
        path = os.path.expanduser(path)
        if os.path.isdir(path) or glob.has_magic(path):
            self.files, self.format = self._files_of(path, data_format)
        elif os.path.isfile(path):
            ext = os.path.splitext(path)[1]
            if data_format == "auto" and ext not in _EXTENSIONS:
                raise UserError(
                    f"{option} {path}: cannot tell the format from its extension; set data.format "
                    f"to one of: {', '.join(DATA_FORMATS[1:])}"
                )
            self.format = _EXTENSIONS[ext] if data_format == "auto" else data_format
            self.files = [path]
        elif os.path.exists(path):
            raise UserError(f"{option} {path} is not a regular file or folder (a device or pipe)")
        elif _looks_local(path):
            raise UserError(f"{option} not found: {path}")
        else:
            self.format = "hub"
            self.files = []
        self.size = sum(os.path.getsize(f) for f in self.files)
        if self.files and self.size == 0:
            raise UserError(f"{option} {path} is empty")

    def _files_of(self, path: str, data_format: str) -> tuple[list[str], str]:
        """The data files of a folder or a glob, in name order, and their one format."""
        what = "folder" if os.path.isdir(path) else "glob"
        if what == "folder":
            names = [os.path.join(path, f) for f in os.listdir(path) if not f.startswith(".")]
        else:
            names = [f for f in glob_files(path) if os.path.isfile(f)]
        files = sorted(f for f in names if os.path.splitext(f)[1] in _EXTENSIONS)
        if data_format != "auto":
            files = [f for f in files if _EXTENSIONS[os.path.splitext(f)[1]] == data_format]
        if not files:
            wanted = ", ".join(e for e, f in _EXTENSIONS.items() if data_format in ("auto", f))
            found = "has no data files" if what == "folder" else "matches no data files"
            raise UserError(f"{self.option} {what} {path} {found} ({wanted})")
        formats = {_EXTENSIONS[os.path.splitext(f)[1]] for f in files}
        if len(formats) > 1:
            raise UserError(
                f"{self.option} {what} {path} mixes formats ({', '.join(sorted(formats))}); "
                "set data.format or narrow it to one"
            )
        return files, formats.pop()

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of its training data, for a resume to notice a changed corpus:
        the path, and the number, names and sizes of its files (a hub dataset: its name only)."""
        listing = "\0".join(f"{os.path.basename(f)}:{os.path.getsize(f)}" for f in self.files)
        return {"path": self.name, "files": len(self.files), "bytes": self.size,
                "digest": hashlib.sha256(listing.encode()).hexdigest()[:16]}

    @property
    def what(self) -> str:
        """How messages name this data: 'data <path>' for the training data, '<option> <path>' for other data."""
        return f"data {self.name}" if self.option == "data.path" else f"{self.option} {self.name}"

    def rows(
        self, start: int = 0, wanted: Callable[[int], bool] | None = None
    ) -> Iterator[tuple[Location, Row | None]]:
        """Rows in stream order from row ``start`` on (blank JSONL lines are not rows).

        A row that cannot be read (not UTF-8, not JSON, not an object) comes as a
        ``BadRow`` in its place. With ``wanted``, a row whose number it rejects comes as
        None, unparsed: a reader that needs every k-th row still counts all of them
        but pays for parsing only its own.
        """
        if self.format == "jsonl":
            try:
                yield from _jsonl_rows(self.files, start, wanted)
            except UserError as e:  # a broken .json array: no rows to skip
                raise UserError(self._row_prefix() + str(e)) from None
        elif self.format == "text":
            yield from _text_rows(self.files, start, wanted)
        else:
            yield from self._hf_rows(start, wanted)

    def _hf_rows(
        self, start: int, wanted: Callable[[int], bool] | None
    ) -> Iterator[tuple[Location, Row | None]]:
        import datasets  # slow to import; only parquet and hub data need it

        route_library_warnings()  # datasets logs through a handler of its own

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
                yield (self.name, "row", i), row if wanted is None or wanted(i) else None
        except UserError:  # Interrupted (a SIGTERM while reading) among them: not a bad file
            raise
        except Exception as e:
            raise UserError(f"could not read {self.what}: {_first_line(e)}") from None

    def _row_prefix(self) -> str:
        return "" if self.option == "data.path" else f"{self.option} "

    def locate(self, loc: Location) -> str:
        """Name the file and row of a row (numbered across several parquet files), after the option
        unless it is data.path: a bad held-out row is not taken for a training one."""
        prefix = self._row_prefix()
        _, unit, i = loc
        if self.format == "parquet" and unit == "row":
            import pyarrow.parquet as pq

            for f in self.files:
                n = pq.ParquetFile(f).metadata.num_rows
                if i < n:
                    return f"{prefix}{f} row {i}"
                i -= n
        return prefix + where(loc)


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


def _jsonl_rows(
    files: list[str], start: int, wanted: Callable[[int], bool] | None
) -> Iterator[tuple[Location, Row | None]]:
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
                    n = index + i
                    yield (path, "item", i), _object(items[i]) if wanted is None or wanted(n) else None
                index += len(items)
                continue
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if index >= start:
                    row = _json_line(line) if wanted is None or wanted(index) else None
                    yield (path, "line", lineno), row
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


def _text_rows(
    files: list[str], start: int, wanted: Callable[[int], bool] | None
) -> Iterator[tuple[Location, Row | None]]:
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
                        row: Row | None = None
                        if wanted is None or wanted(index):
                            try:
                                row = {"text": line.decode("utf-8")}
                            except UnicodeDecodeError as e:
                                row = BadRow(_not_utf8(e))
                        yield (path, "line", lineno), row
                    index += 1
