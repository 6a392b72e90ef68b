import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from models.llama import LLAMA2_FLAVORS, Transformer
from tests.helpers import ROOT, run_script
from trainer.config import DataConfig
from trainer.data.loader import build_dataloader
from trainer.data.sft import (
    SFTOptions,
    detect_format,
    load_sft_rows,
    parse_row,
    reference_answer,
    render_prompt,
    tokenize_dialog,
)
from trainer.data.tokenizer import Tokenizer
from trainer.data.windows import IGNORE_INDEX
from trainer.errors import UserError

SYS = "You are terse."
CHAT = {"messages": [
    {"role": "system", "content": SYS},
    {"role": "user", "content": "Sort the digits.\n\n3 1 2"},
    {"role": "assistant", "content": "1 2 3"},
    {"role": "user", "content": " Copy the words: red cat "},
    {"role": "assistant", "content": "red cat\n"},
]}
ALPACA = {"instruction": "Reverse the order of the words.", "input": "cat dog owl", "output": "owl dog cat"}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(ROOT / "data" / "tokenizer.model"))


def meta_chat_completion_tokens(tok: Tokenizer, dialog: list[dict[str, str]]) -> list[int]:
    """Meta's llama/generation.py chat_completion, for a dialog ending with the assistant."""
    b_inst, e_inst = "[INST]", "[/INST]"
    b_sys, e_sys = "<<SYS>>\n", "\n<</SYS>>\n\n"
    if dialog[0]["role"] == "system":
        first = b_sys + dialog[0]["content"] + e_sys + dialog[1]["content"]
        dialog = [{"role": dialog[1]["role"], "content": first}, *dialog[2:]]
    tokens = []
    for p, a in zip(dialog[::2], dialog[1::2]):
        tokens += tok.encode(
            f"{b_inst} {p['content'].strip()} {e_inst} {a['content'].strip()} ", bos=True, eos=True
        )
    return tokens


def sft_loader(tok: Tokenizer, path: Path, *, seq_len: int = 64, batch_size: int = 2,
               dp_rank: int = 0, dp_degree: int = 1, seed: int = 0, **options: Any):
    return build_dataloader(
        kind="sft", path=str(path), tokenizer=tok, seq_len=seq_len, batch_size=batch_size,
        dp_rank=dp_rank, dp_degree=dp_degree, seed=seed, sft_options=SFTOptions(**options),
    )


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_chat_template_tokens_match_meta(tok: Tokenizer) -> None:
    opts = SFTOptions()
    ids, _ = tokenize_dialog(parse_row(CHAT, detect_format(CHAT, opts), opts), tok)
    assert ids == meta_chat_completion_tokens(tok, CHAT["messages"])


def test_chat_template_strings(tok: Tokenizer) -> None:
    ids, _ = tokenize_dialog(parse_row(CHAT, "chat", SFTOptions()), tok)
    turns, start = [], 0
    for i, t in enumerate(ids):
        if t == tok.eos_id:
            turns.append(ids[start:i + 1])
            start = i + 1
    assert [t[0] for t in turns] == [tok.bos_id, tok.bos_id] and start == len(ids)
    assert [tok.decode(t) for t in turns] == [
        f"[INST] <<SYS>>\n{SYS}\n<</SYS>>\n\nSort the digits.\n\n3 1 2 [/INST] 1 2 3 ",
        "[INST] Copy the words: red cat [/INST] red cat ",
    ]
    alpaca, _ = tokenize_dialog(parse_row(ALPACA, "alpaca", SFTOptions()), tok)
    assert tok.decode(alpaca) == "[INST] Reverse the order of the words.\n\ncat dog owl [/INST] owl dog cat "
    assert alpaca == meta_chat_completion_tokens(tok, [
        {"role": "user", "content": "Reverse the order of the words.\n\ncat dog owl"},
        {"role": "assistant", "content": "owl dog cat"},
    ])


def expected_labels(tok: Tokenizer, turns: list[tuple[str, str]], train_on: str) -> tuple[list[int], list[int]]:
    """Hand-built (input_ids, labels): prompts carry -100 unless train_on == 'all'."""
    ids, labels = [], []
    for prompt, reply in turns:
        p = tok.encode(prompt, bos=True, eos=False)
        r = tok.encode(reply, bos=False, eos=True)
        ids += p + r
        labels += (p if train_on == "all" else [IGNORE_INDEX] * len(p)) + r
    return ids[:-1], labels[1:]


@pytest.mark.parametrize("train_on", ["responses", "all"])
def test_masking_single_and_multi_turn(tok: Tokenizer, tmp_path: Path, train_on: str) -> None:
    path = write_jsonl(tmp_path / "mixed.jsonl", [CHAT])
    batch = next(iter(sft_loader(tok, path, batch_size=1, pack=False, train_on=train_on)))
    ids, labels = expected_labels(tok, [
        (f"[INST] <<SYS>>\n{SYS}\n<</SYS>>\n\nSort the digits.\n\n3 1 2 [/INST]", "1 2 3 "),
        ("[INST] Copy the words: red cat [/INST]", "red cat "),
    ], train_on)
    assert batch["input_ids"][0].tolist() == ids
    assert batch["labels"][0].tolist() == labels
    if train_on == "responses":
        # the first reply's EOS is trained; the second turn's BOS and prompt are not
        trained = [t for t in labels if t not in (IGNORE_INDEX, tok.eos_id)]
        assert tok.decode(trained).split() == ["1", "2", "3", "red", "cat"]
        assert labels.count(tok.eos_id) == 2 and tok.bos_id not in labels

    path = write_jsonl(tmp_path / "alpaca.jsonl", [{**ALPACA, "input": ""}])
    batch = next(iter(sft_loader(tok, path, batch_size=1, pack=False, train_on=train_on)))
    ids, labels = expected_labels(
        tok, [("[INST] Reverse the order of the words. [/INST]", "owl dog cat ")], train_on
    )
    assert batch["input_ids"][0].tolist() == ids
    assert batch["labels"][0].tolist() == labels


def rows_of_tasks(n: int) -> list[dict[str, str]]:
    words = ["cat", "dog", "owl", "red", "blue", "lamp", "key", "box"]
    return [
        {"instruction": f"Repeat {i}.", "input": " ".join(words[: 1 + i % 7]),
         "output": " ".join(words[: 1 + (i * 3) % 8])}
        for i in range(n)
    ]


def unpack(batch: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    samples = []
    for row in range(batch["input_ids"].shape[0]):
        docs = batch["document_ids"][row]
        for d in docs.unique().tolist():
            sel = docs == d
            pos = batch["position_ids"][row][sel]
            assert pos.tolist() == list(range(int(sel.sum())))  # reset per sample
            labels = batch["labels"][row][sel].tolist()
            if all(x == IGNORE_INDEX for x in labels):
                assert d == docs.max()  # the padding tail: last document, labels ignored
                continue
            samples.append((batch["input_ids"][row][sel].tolist(), labels))
    return samples


def test_packed_equals_unpacked(tok: Tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows_of_tasks(40))
    batch = next(iter(sft_loader(tok, path, pack=False, batch_size=40)))
    unpacked = []
    for x, y in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        n = max(i for i, v in enumerate(y) if v != IGNORE_INDEX) + 1  # a sample ends with EOS
        unpacked.append((x[:n], y[:n]))
    it = iter(sft_loader(tok, path, pack=True, seq_len=64, batch_size=2))
    packed = []
    while len(packed) < 40:
        batch = next(it)
        assert batch["input_ids"].shape == (2, 64)
        assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
        packed += unpack(batch)
    assert packed[:40] == unpacked


def per_sample_loss(model: Transformer, batch: dict[str, torch.Tensor], masked: bool = True) -> list[float]:
    """Summed loss of each sample in a batch, with the model fed as trainer.loss.Loss feeds it."""
    keys = ("position_ids", "document_ids") if masked else ("position_ids",)
    with torch.no_grad():
        logits = model(batch["input_ids"], **{k: batch[k] for k in keys if k in batch})
    labels = batch["labels"]
    token_loss = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(labels)
    # unpacked rows are one document each
    docs = batch.get("document_ids", torch.zeros_like(labels))
    losses = []
    for row in range(labels.shape[0]):
        for d in docs[row].unique().tolist():
            sel = docs[row] == d
            if (labels[row][sel] != IGNORE_INDEX).any():  # not the padding tail
                losses.append(token_loss[row][sel].double().sum().item())
    return losses


def test_packed_and_unpacked_give_the_same_per_sample_model_loss(tok: Tokenizer, tmp_path: Path) -> None:
    n = 12
    path = write_jsonl(tmp_path / "t.jsonl", rows_of_tasks(n))
    args = dataclasses.replace(LLAMA2_FLAVORS["debug"], n_layers=2)
    assert tok.n_words <= args.vocab_size
    torch.manual_seed(0)
    model = Transformer(args).eval()
    with torch.no_grad():
        # Default inits attend almost uniformly; large weights make a leak across samples visible.
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 1.0 if "embeddings" in name else 0.1)

    unpacked_batch = next(iter(sft_loader(tok, path, pack=False, batch_size=n, shuffle=False)))
    unpacked = per_sample_loss(model, unpacked_batch)
    packed, leaky = [], []
    it = iter(sft_loader(tok, path, pack=True, seq_len=64, batch_size=2, shuffle=False))
    while len(packed) < n:
        batch = next(it)
        assert batch["document_ids"].amax(1).gt(1).any()  # several samples share a row
        packed += per_sample_loss(model, batch)
        leaky += per_sample_loss(model, batch, masked=False)
    assert len(unpacked) == n
    torch.testing.assert_close(packed[:n], unpacked, rtol=1e-5, atol=0)
    # ... and the check would catch attention across samples.
    assert max(abs(a - b) / b for a, b in zip(leaky[:n], unpacked)) > 1e-2


def test_cut_and_dropped_samples_are_counted_on_the_console_at_the_first_batch(tok, tmp_path, capsys) -> None:
    long_prompt = {"instruction": "Copy " + "red cat " * 40, "input": "", "output": "owl dog"}
    long_reply = {"instruction": "Copy.", "input": "", "output": "blue " * 80}
    short = {"instruction": "Copy.", "input": "", "output": "key"}
    path = write_jsonl(tmp_path / "t.jsonl", [long_prompt, short, long_reply, short, short])
    counts = (f"1 of 5 SFT samples of data {path} will be cut to their newest 32 tokens and 1 dropped to fit "
              "training.seq_len = 32 (data.truncation = 'truncate_prompt'; the longest has ")
    dl = build_dataloader(kind="sft", path=str(path), tokenizer=tok, seq_len=32, batch_size=1, dp_rank=0,
                          dp_degree=1, seed=0, sft_options=SFTOptions(pack=False), verbose=True)
    assert capsys.readouterr() == ("", "")
    next(iter(dl))
    out, err = capsys.readouterr()
    assert out.startswith(counts) and out.count("\n") == 1 and err == ""
    next(iter(dl))  # once per loader
    assert capsys.readouterr() == ("", "")
    # Most samples touched: a warning.
    path = write_jsonl(tmp_path / "t.jsonl", [long_prompt, long_prompt, short])
    dl = build_dataloader(kind="sft", path=str(path), tokenizer=tok, seq_len=32, batch_size=1, dp_rank=0,
                          dp_degree=1, seed=0, sft_options=SFTOptions(pack=False), verbose=True)
    next(iter(dl))
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"warning: 2 of 3 SFT samples of data {path} will be cut")
    assert err.rstrip().endswith("most samples lose part of their prompt or all of it; raise training.seq_len")


def test_unpacked_padding(tok: Tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows_of_tasks(2))
    batch = next(iter(sft_loader(tok, path, pack=False, batch_size=2, shuffle=False)))
    assert set(batch) == {"input_ids", "labels"}
    lengths = [len(tokenize_dialog(
        (None, [(f"{r['instruction']}\n\n{r['input']}", r["output"])]), tok)[0]) - 1
        for r in rows_of_tasks(2)]
    assert batch["input_ids"].shape == (2, max(lengths))
    short = lengths.index(min(lengths))
    assert batch["labels"][short, min(lengths):].eq(IGNORE_INDEX).all()
    assert batch["input_ids"][short, min(lengths):].eq(tok.eos_id).all()


def test_truncation_keeps_the_reply_and_counts(tok: Tokenizer, tmp_path: Path) -> None:
    long_prompt = {"instruction": "Copy " + "red cat " * 40, "input": "", "output": "owl dog"}
    long_reply = {"instruction": "Copy.", "input": "", "output": "blue " * 80}
    short = {"instruction": "Copy.", "input": "", "output": "key"}
    path = write_jsonl(tmp_path / "t.jsonl", [long_prompt, short, long_reply, short])

    dl = sft_loader(tok, path, seq_len=32, pack=False, batch_size=3, shuffle=False)
    batch = next(iter(dl))
    assert dl.dataset.stats() == {"epoch": 1, "index": 0, "samples": 4, "truncated": 1,
                                  "dropped": 1, "bad_rows": 0, "windows": 3}
    assert batch["input_ids"].shape == (3, 32)
    assert batch["input_ids"][0, 0] == tok.bos_id
    reply = tok.encode("owl dog ", bos=False, eos=True)
    assert batch["labels"][0, -len(reply):].tolist() == reply  # reply whole, at the end
    # ... predicted from the end of "[/INST]", which the cut kept
    assert batch["input_ids"][0, -len(reply)] == tok.encode("[/INST]", False, False)[-1]

    dl = sft_loader(tok, path, seq_len=32, pack=False, batch_size=2, shuffle=False, truncation="drop")
    batch = next(iter(dl))
    assert dl.dataset.stats()["dropped"] == 2 and dl.dataset.stats()["truncated"] == 0

    path = write_jsonl(tmp_path / "all_long.jsonl", [long_reply])
    with pytest.raises(UserError, match="all 1 SFT samples are longer than seq_len 32"):
        next(iter(sft_loader(tok, path, seq_len=32)))


def global_sft_steps(tok: Tokenizer, path: Path, dp: int, steps: int, state=None, **kw) -> list:
    per_rank = []
    for rank in range(dp):
        dl = sft_loader(tok, path, batch_size=4 // dp, dp_rank=rank, dp_degree=dp, **kw)
        if state is not None:
            dl.load_state_dict(copy.deepcopy(state))
        it = iter(dl)
        per_rank.append([next(it) for _ in range(steps)])
    return [
        [{k: v[i].tolist() for k, v in per_rank[r][s].items()}
         for r in range(dp) for i in range(4 // dp)]
        for s in range(steps)
    ]


@pytest.mark.parametrize("pack", [True, False])
def test_sft_dp_independence_shuffle_and_resume(tok: Tokenizer, tmp_path: Path, pack: bool) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows_of_tasks(30))
    kw = {"pack": pack, "seq_len": 48}
    if not pack:  # rows are padded per micro-batch: compare without the padding
        def strip(steps):
            return [[{k: [t for t, y in zip(v, r["labels"]) if y != IGNORE_INDEX] for k, v in r.items()}
                     for r in s] for s in steps]
    else:
        def strip(steps):
            return steps
    ref = strip(global_sft_steps(tok, path, dp=1, steps=30, **kw))
    assert strip(global_sft_steps(tok, path, dp=2, steps=30, **kw)) == ref
    dl = sft_loader(tok, path, batch_size=4, **kw)
    it = iter(dl)
    for _ in range(11):
        next(it)
    state = dl.state_dict()
    assert strip(global_sft_steps(tok, path, dp=2, steps=19, state=state, **kw)) == ref[11:]
    assert strip(global_sft_steps(tok, path, dp=4, steps=19, state=state, **kw)) == ref[11:]
    stats = dl.dataset.stats()
    assert stats["samples"] > 30 and stats["epoch"] >= 1  # wrapped into epoch 2

    # epochs are shuffled differently, and the seed matters
    ds = dl.dataset
    assert ds.order(0) != ds.order(1) and sorted(ds.order(0)) == list(range(30))
    other = sft_loader(tok, path, seed=1, **kw).dataset
    assert other.order(0) != ds.order(0)
    assert sft_loader(tok, path, shuffle=False, **kw).dataset.order(3) == list(range(30))


def test_render_prompt_and_reference(tok: Tokenizer) -> None:
    opts = SFTOptions()
    for row in (CHAT, ALPACA):
        full, _ = tokenize_dialog(parse_row(row, detect_format(row, opts), opts), tok)
        prompt = render_prompt(row, tok, opts)
        answer = reference_answer(row, opts)
        assert full == prompt + tok.encode(f"{answer} ", bos=False, eos=True)
    assert reference_answer(CHAT, opts) == "red cat"
    assert tok.decode(render_prompt(ALPACA, tok, opts)).endswith("cat dog owl [/INST]")


def sft_error(tok: Tokenizer, tmp_path: Path, rows: list[Any], **options: Any) -> str:
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError) as e:
        sft_loader(tok, path, **options)
    msg = str(e.value)
    assert "\n" not in msg
    return msg.replace(str(path), "FILE")


def test_bad_rows(tok: Tokenizer, tmp_path: Path) -> None:
    ok = json.dumps(ALPACA)
    cases = [
        ([ok, {"instruction": "x", "input": ""}], "FILE:2: missing field 'output'"),
        ([ok, "", {**ALPACA, "output": "  "}], "FILE:3: empty response (field 'output')"),
        ([ok, {**ALPACA, "input": 5}], "FILE:2: field 'input' must be a string, got int"),
        ([ok, "{not json"], "FILE:2: not valid JSON"),
        ([{"prompt": "x"}], "FILE:1: cannot tell the SFT format"),
        ([{"messages": "hi"}], "FILE:1: field 'messages' must be a non-empty list of messages"),
        ([{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}],
         "FILE:1: messages[1] has role 'user', expected 'assistant'"),
        ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}]}],
         "FILE:1: conversation must end with an assistant message"),
        ([{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}]}],
         "FILE:1: messages[1] has role 'assistant', expected 'user'"),
        ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}],
         "FILE:1: messages[1]: empty assistant response"),
        ([{"messages": [{"role": "user"}]}], "FILE:1: messages[0] needs string fields 'role' and 'content'"),
    ]
    for rows, expected in cases:
        assert sft_error(tok, tmp_path, rows).startswith(expected), expected
    # a chat file read as alpaca is caught on its first row
    assert sft_error(tok, tmp_path, [CHAT], format="alpaca").startswith("FILE:1: missing field 'instruction'")


def test_options_are_the_data_section() -> None:
    # one source of defaults: the API's SFTOptions() is what train.py does with an empty [data]
    assert SFTOptions() == SFTOptions.from_config(DataConfig())
    assert SFTOptions().pack is False
    data = DataConfig(sft_format="chat", messages_field="turns", train_on="all", pack=True,
                      truncation="drop", shuffle=False)
    assert SFTOptions.from_config(data) == SFTOptions(
        format="chat", messages_field="turns", train_on="all", pack=True, truncation="drop", shuffle=False)
    # choices come from the config too
    with pytest.raises(UserError, match="SFT option train_on = 'prompts' is not one of: responses, all"):
        SFTOptions.from_config(DataConfig(train_on="prompts"))


def test_bad_options(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="SFT option truncation = 'cut' is not one of"):
        SFTOptions(truncation="cut")
    with pytest.raises(UserError, match="SFT option format = 'sharegpt' is not one of"):
        SFTOptions(format="sharegpt")
    (tmp_path / "t.txt").write_text("hello\n")
    with pytest.raises(UserError, match="SFT data must be JSON Lines or parquet"):
        sft_loader(tok, tmp_path / "t.txt")


def test_parquet_chat_rows(tok: Tokenizer, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([CHAT, CHAT]), tmp_path / "c.parquet")
    batch = next(iter(sft_loader(tok, tmp_path / "c.parquet", pack=False, seq_len=128, shuffle=False)))
    assert batch["input_ids"][0].tolist() == meta_chat_completion_tokens(tok, CHAT["messages"])[:-1]
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    pq.write_table(pa.Table.from_pylist([CHAT, bad]), tmp_path / "c.parquet")
    with pytest.raises(UserError, match=r"c\.parquet row 1: messages\[1\] has role 'user'"):
        sft_loader(tok, tmp_path / "c.parquet")


def test_shipped_sft_data(tok: Tokenizer) -> None:
    opts = SFTOptions()
    train = load_sft_rows(str(ROOT / "data" / "sft" / "train.jsonl"), opts)
    held_out = load_sft_rows(str(ROOT / "data" / "sft" / "eval.jsonl"), opts)
    chat = load_sft_rows(str(ROOT / "data" / "sft" / "chat_example.jsonl"), opts)
    assert len(train) >= 5000 and len(held_out) >= 200 and chat

    def key(r: dict[str, str]) -> tuple[str, str]:
        # the input may sit in the instruction after a colon
        return (r["input"] or r["instruction"].split(": ")[-1], r["output"])

    assert not {key(r) for r in held_out} & {key(r) for r in train}
    longest = max(len(tokenize_dialog((None, [(r["instruction"], r["output"])]), tok)[0])
                  for r in train[:500])
    assert longest < 64  # compact: many samples per packed 256-token row
    dl = sft_loader(tok, ROOT / "data" / "sft" / "chat_example.jsonl", seq_len=256, pack=True)
    assert next(iter(dl))["input_ids"].shape == (2, 256)


def test_shipped_sft_data_is_reproducible(tmp_path: Path) -> None:
    result = run_script("scripts/make_sft_data.py", ["--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    for name in ("train.jsonl", "eval.jsonl", "chat_example.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "data" / "sft" / name).read_bytes(), name
