"""Supervised fine-tuning data: alpaca or chat rows in LLaMA-2's chat format.

Each conversation is tokenized the way Meta's ``chat_completion`` does::

    <s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s><s>[INST] {user} [/INST] ...

one BOS...EOS per user/assistant turn, contents stripped, the system prompt
folded into the first user message. An alpaca row is a one-turn chat whose user
message is ``instruction`` plus ``"\\n\\n" + input`` when ``input`` is not empty.

Prompt and reply are tokenized separately (``"[INST] ... [/INST]"`` and
``"{reply} "``); SentencePiece never merges across the space between them, so the
tokens equal Meta's and the reply boundary is exact.

Windows for the data-parallel scheme of ``trainer.data.windows`` are samples (unpacked)
or packed rows (``pack=True``), numbered in the per-epoch sample order, which a
seeded shuffle makes the same for every dp degree.
"""

import random
from collections.abc import Iterator
from typing import Any

import torch

from trainer.data.sft_options import SFTOptions
from trainer.data.source import BadRow, DataSource, Progress, skip_warning
from trainer.data.tokenizer import Tokenizer
from trainer.data.windows import ESTIMATE_DOCS, IGNORE_INDEX, WindowDataset
from trainer.errors import UserError
from trainer.log import info, warn

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"

# A conversation: optional system prompt and (user, assistant) turns.
Dialog = tuple[str | None, list[tuple[str, str]]]


def detect_format(row: dict[str, Any], options: SFTOptions) -> str:
    if options.format != "auto":
        return options.format
    if options.messages_field in row:
        return "chat"
    if options.instruction_field in row or options.output_field in row:
        return "alpaca"
    raise UserError(
        f"cannot tell the SFT format: expected field '{options.messages_field}' (chat) or "
        f"'{options.instruction_field}'/'{options.output_field}' (alpaca), "
        f"found: {', '.join(map(str, row)) or 'none'}"
    )


def parse_row(row: dict[str, Any], fmt: str, options: SFTOptions) -> Dialog:
    """Validate one row; errors are UserError messages without the location."""
    if fmt == "alpaca":
        instruction = _string(row, options.instruction_field, required=True)
        extra = _string(row, options.input_field, required=False)
        output = _string(row, options.output_field, required=True)
        if not instruction.strip():
            raise UserError(f"empty instruction (field '{options.instruction_field}')")
        if not output.strip():
            raise UserError(f"empty response (field '{options.output_field}')")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return None, [(user, output)]

    messages = row.get(options.messages_field)
    if not isinstance(messages, list) or not messages:
        raise UserError(f"field '{options.messages_field}' must be a non-empty list of messages")
    system = None
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"{options.messages_field}[{i}] must be an object with role and content")
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(f"{options.messages_field}[{i}] needs string fields 'role' and 'content'")
    if messages[0]["role"] == "system":
        system = messages[0]["content"]
        messages = messages[1:]
    offset = 1 if system is not None else 0
    for i, m in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise UserError(
                f"{options.messages_field}[{i + offset}] has role '{m['role']}', expected "
                f"'{expected}' (after an optional system message, turns alternate user/assistant)"
            )
        if expected == "assistant" and not m["content"].strip():
            raise UserError(f"{options.messages_field}[{i + offset}]: empty assistant response")
    if len(messages) % 2 == 1 or not messages:
        raise UserError("conversation must end with an assistant message")
    return system, [(u["content"], a["content"]) for u, a in zip(messages[::2], messages[1::2])]


def _string(row: dict[str, Any], field: str, required: bool) -> str:
    value = row.get(field)
    if value is None:
        if required:
            raise UserError(f"missing field '{field}'")
        return ""
    if not isinstance(value, str):
        raise UserError(f"field '{field}' must be a string, got {type(value).__name__}")
    return value


def turn_strings(dialog: Dialog) -> list[tuple[str, str]]:
    """(prompt, reply) strings of each turn, each to be encoded with BOS / EOS."""
    system, turns = dialog
    out = []
    for k, (user, assistant) in enumerate(turns):
        if k == 0 and system is not None:
            user = f"{B_SYS}{system}{E_SYS}{user}"
        out.append((f"{B_INST} {user.strip()} {E_INST}", f"{assistant.strip()} "))
    return out


def encode_turns(dialog: Dialog, tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with BOS, reply ids with EOS) of each turn."""
    return [
        (tokenizer.encode(prompt, bos=True, eos=False), tokenizer.encode(reply, bos=False, eos=True))
        for prompt, reply in turn_strings(dialog)
    ]


def tokenize_dialog(
    dialog: Dialog, tokenizer: Tokenizer, train_on: str = "responses"
) -> tuple[list[int], list[bool]]:
    """Token ids and, per token, whether the loss is taken on it (predicting it)."""
    return _flatten(encode_turns(dialog, tokenizer), train_on)


def _flatten(
    turns: list[tuple[list[int], list[int]]], train_on: str
) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    trained: list[bool] = []
    for p, r in turns:
        ids += p + r
        trained += [train_on == "all"] * len(p) + [True] * len(r)
    return ids, trained


def load_sft_rows(path: str, options: SFTOptions, data_format: str = "auto") -> list[dict[str, Any]]:
    """All rows of an SFT file, validated (errors name the file and line)."""
    return [entry[0] for entry in _load(DataSource(path, data_format), options) if entry is not None]


def _load(
    source: DataSource, options: SFTOptions, bad_rows: str = "error", verbose: bool = False
) -> list[tuple[dict[str, Any], Dialog] | None]:
    """(row, dialog) of every row, None in place of a bad row skipped (bad_rows = "skip")."""
    if source.format == "text":
        raise UserError(f"SFT {source.what} is text; SFT data must be JSON Lines or parquet")
    out: list[tuple[dict[str, Any], Dialog] | None] = []
    fmt = None
    bad, first = 0, ""
    progress = Progress(f"reading SFT {source.what}", verbose)
    for loc, row in source.rows():
        try:
            if isinstance(row, BadRow):
                raise UserError(row.problem)
            fmt = fmt or detect_format(row, options)
            out.append((row, parse_row(row, fmt, options)))
        except UserError as e:
            line = f"{source.locate(loc)}: {e}"
            if bad_rows == "error":
                raise UserError(line) from None
            first = first or line
            bad += 1
            out.append(None)
        progress.tick(len(out))
    progress.done(len(out))
    if not out:
        raise UserError(f"SFT {source.what} has no rows")
    if bad == len(out):
        raise UserError(f"all {bad} rows of SFT {source.what} are bad, the first: {first}")
    if bad and verbose:
        warn(skip_warning(source.what, first, bad))
    return out


def render_prompt(sample: dict[str, Any], tokenizer: Tokenizer, options: SFTOptions) -> list[int]:
    """Tokens a model sees before its final reply (all earlier turns included).

    Generation continues from here; the expected continuation is
    ``reference_answer(sample)`` (then a space and EOS, which eval should strip).
    """
    turns = encode_turns(parse_row(sample, detect_format(sample, options), options), tokenizer)
    return [t for p, r in turns[:-1] for t in p + r] + turns[-1][0]


def reference_answer(sample: dict[str, Any], options: SFTOptions) -> str:
    """The final assistant reply, stripped, to compare with generated text."""
    _, turns = parse_row(sample, detect_format(sample, options), options)
    return turns[-1][1].strip()


class SFTDataset(WindowDataset):
    """SFT samples as windows: one per row (unpacked) or greedily packed rows.

    All rows are read and validated up front (SFT sets are small); tokenization
    happens as samples are used. State: the next sample ``index`` in ``epoch``'s
    order plus running counts of ``samples`` used, ``truncated`` and ``dropped``,
    and of ``bad_rows`` passed over. A skipped bad row keeps its place in the
    order, so the order and the counts do not depend on how many rows are bad.
    """

    kind = "sft"
    state_keys = ("epoch", "index", "samples", "truncated", "dropped", "bad_rows", "windows")

    def __init__(
        self, source: DataSource, tokenizer: Tokenizer, seq_len: int, batch_size: int, dp_rank: int,
        dp_degree: int, seed: int, options: SFTOptions, bad_rows: str = "error", verbose: bool = False,
    ) -> None:
        super().__init__(batch_size, dp_rank, dp_degree)
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.options = options
        self.dialogs = [None if e is None else e[1] for e in _load(source, options, bad_rows, verbose)]
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else tokenizer.eos_id
        self._order: tuple[int, list[int]] = (-1, [])
        # Said once, when the first batch is read (before the first step).
        self._fit_report = verbose
        self.source = source

    def _fit(self, turns: list[tuple[list[int], list[int]]]) -> str:
        """"fits", "truncated" (BOS + the newest seq_len tokens are kept) or "dropped", for a sample's turns."""
        if sum(len(p) + len(r) for p, r in turns) <= self.seq_len + 1:
            return "fits"
        if self.options.truncation == "drop" or len(turns[-1][1]) > self.seq_len:
            return "dropped"
        return "truncated"

    def _report_fit(self) -> None:
        """Count the samples cut or dropped to fit seq_len (a cut prompt can lose the instruction the
        reply answers); a warning when that is most of them. Tokenizes each sample once more."""
        self._fit_report = False
        fits, longest = {"fits": 0, "truncated": 0, "dropped": 0}, 0
        for turns in (encode_turns(d, self.tokenizer) for d in self.dialogs if d is not None):
            fits[self._fit(turns)] += 1
            longest = max(longest, sum(len(p) + len(r) for p, r in turns))
        total, touched = sum(fits.values()), fits["truncated"] + fits["dropped"]
        counts = (f"{fits['truncated']} of {total} SFT samples of {self.source.what} will be cut to their newest "
                  f"{self.seq_len} tokens and {fits['dropped']} dropped to fit training.seq_len = {self.seq_len} "
                  f"(data.truncation = '{self.options.truncation}'; the longest has {longest} tokens)")
        if 2 * touched > total:
            warn(f"{counts}: most samples lose part of their prompt or all of it; raise training.seq_len")
        elif touched:
            info(counts)

    def order(self, epoch: int) -> list[int]:
        if self._order[0] != epoch:
            order = list(range(len(self.dialogs)))
            if self.options.shuffle:
                random.Random(f"sft:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def sample(self, dialog: Dialog) -> tuple[tuple[list[int], list[int]] | None, bool]:
        """((input_ids, labels), truncated) of ``dialog``; None when it is dropped."""
        turns = encode_turns(dialog, self.tokenizer)
        ids, trained = _flatten(turns, self.options.train_on)
        fit = self._fit(turns)
        if fit == "dropped":
            return None, False
        if fit == "truncated":
            # BOS, then the newest seq_len tokens: the final reply survives whole
            ids = ids[:1] + ids[-self.seq_len:]
            trained = trained[:1] + trained[-self.seq_len:]
        labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])]
        return (ids[:-1], labels), fit == "truncated"

    def samples(self, state: dict[str, int]) -> Iterator[tuple[Any, dict[str, int]]]:
        """Yield (sample or None, counts including it, position after it), forever."""
        if self._fit_report:
            self._report_fit()
        epoch, index = state["epoch"], state["index"]
        counts = {k: state[k] for k in ("samples", "truncated", "dropped", "bad_rows")}
        while True:
            order = self.order(epoch)
            kept = 0
            for i in range(index, len(order)):
                dialog = self.dialogs[order[i]]
                sample, truncated = (None, False) if dialog is None else self.sample(dialog)
                counts = {
                    "samples": counts["samples"] + (dialog is not None),
                    "truncated": counts["truncated"] + truncated,
                    "dropped": counts["dropped"] + (dialog is not None and sample is None),
                    "bad_rows": counts["bad_rows"] + (dialog is None),
                }
                kept += sample is not None
                nxt = (epoch, i + 1) if i + 1 < len(order) else (epoch + 1, 0)
                yield sample, {"epoch": nxt[0], "index": nxt[1], **counts}
            if kept == 0 and index == 0:
                raise UserError(
                    f"all {sum(d is not None for d in self.dialogs)} SFT samples are longer than seq_len {self.seq_len} "
                    f"and were dropped (truncation = '{self.options.truncation}')"
                )
            epoch, index = epoch + 1, 0

    def windows(self, state: dict[str, int]) -> Iterator[tuple[Any, dict[str, int]]]:
        if not self.options.pack:
            for sample, after in self.samples(state):
                if sample is not None:
                    yield sample, after
            return
        # Greedy packing in order: a sample that does not fit closes the row and
        # starts the next one, so the state after a row is "before that sample".
        row: list[tuple[list[int], list[int]]] = []
        used = 0
        before = state
        for sample, after in self.samples(state):
            if sample is not None:
                if used + len(sample[0]) > self.seq_len:
                    yield row, before
                    row, used = [], 0
                row.append(sample)
                used += len(sample[0])
            before = after

    def epoch_windows(self) -> float | None:
        """Samples per epoch; packed, their tokens (estimated from the first ones) per seq_len."""
        dialogs = [d for d in self.dialogs if d is not None]
        lengths = [sum(len(p) + len(r) for p, r in encode_turns(d, self.tokenizer)) for d in dialogs[:ESTIMATE_DOCS]]
        return len(dialogs) * sum(lengths) / max(len(lengths), 1) / self.seq_len if self.options.pack else len(dialogs)

    def collate(self, windows: list[Any]) -> dict[str, torch.Tensor]:
        if not self.options.pack:
            width = max(len(x) for x, _ in windows)
            return {
                "input_ids": torch.tensor([x + [self.pad_id] * (width - len(x)) for x, _ in windows]),
                "labels": torch.tensor([y + [IGNORE_INDEX] * (width - len(y)) for _, y in windows]),
            }
        batch: dict[str, list[list[int]]] = {
            "input_ids": [], "labels": [], "position_ids": [], "document_ids": []
        }
        for row in windows:
            inputs, labels, positions, docs = [], [], [], []
            for d, (x, y) in enumerate(row):
                inputs += x
                labels += y
                positions += range(len(x))
                docs += [d] * len(x)
            # the padding tail is one more document, so attention never joins it to a sample
            pad = self.seq_len - len(inputs)
            batch["input_ids"].append(inputs + [self.pad_id] * pad)
            batch["labels"].append(labels + [IGNORE_INDEX] * pad)
            batch["position_ids"].append(positions + list(range(pad)))
            batch["document_ids"].append(docs + [len(row)] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
