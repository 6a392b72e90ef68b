from pathlib import Path

import pytest
from sentencepiece import SentencePieceProcessor

from tests.helpers import ROOT, run_script
from trainer.cli import Interrupted
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

MODEL = ROOT / "data" / "tokenizer.model"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(MODEL))


def test_llama2_special_ids(tok: Tokenizer) -> None:
    assert tok.n_words == 2048
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, -1)
    assert tok.sp_model.id_to_piece(0) == "<unk>"
    assert tok.sp_model.id_to_piece(1) == "<s>"
    assert tok.sp_model.id_to_piece(2) == "</s>"


def test_encode_bos_eos(tok: Tokenizer) -> None:
    body = tok.encode("The cat sat.", bos=False, eos=False)
    assert body and 1 not in body and 2 not in body
    assert tok.encode("The cat sat.", bos=True, eos=False) == [1, *body]
    assert tok.encode("The cat sat.", bos=False, eos=True) == [*body, 2]
    assert tok.encode("The cat sat.", bos=True, eos=True) == [1, *body, 2]
    assert tok.encode("", bos=True, eos=True) == [1, 2]


@pytest.mark.parametrize("text", [
    "Once upon a time, there was an orange fox named Zoe.",
    "[INST] Sort the digits in ascending order.\n\n5 2 8 1 [/INST] 1 2 5 8 ",
    "<<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\n",
    "unseen: héllo wörld 😀 ∑ 日本語 \t tabs",
    "12345 + 678 = 13023",
])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, bos=True, eos=True)
    assert tok.decode(ids) == text
    assert 0 not in ids  # byte fallback: nothing becomes <unk>


def test_digits_are_split(tok: Tokenizer) -> None:
    pieces = [tok.sp_model.id_to_piece(i) for i in tok.encode("2024", bos=False, eos=False)]
    assert [p.lstrip("▁") for p in pieces if p != "▁"] == ["2", "0", "2", "4"]


def test_task_vocabulary_is_compact(tok: Tokenizer) -> None:
    # the tokenizer saw corpus + SFT text, so the instruction words are single pieces
    ids = tok.encode("Sort the digits in ascending order.", bos=False, eos=False)
    assert len(ids) <= 8


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.model"
    with pytest.raises(UserError, match=f"tokenizer file not found: {path}"):
        Tokenizer(str(path))


def test_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.model"
    path.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(UserError, match="not a valid sentencepiece model") as e:
        Tokenizer(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)



def test_a_sigterm_while_loading_is_not_a_bad_file(monkeypatch: pytest.MonkeyPatch) -> None:
    # During start-up a SIGTERM raises Interrupted wherever the main thread is; in the tokenizer's
    # load it was reported as "not a valid sentencepiece model" with exit 2 instead of 130.
    def interrupted(self, path):
        raise Interrupted("interrupted (SIGTERM)")

    monkeypatch.setattr(SentencePieceProcessor, "Load", interrupted)
    with pytest.raises(Interrupted):
        Tokenizer(str(MODEL))

@pytest.mark.slow
def test_shipped_model_is_reproducible(tmp_path: Path) -> None:
    out = tmp_path / "tokenizer.model"
    result = run_script("scripts/train_tokenizer.py", ["--out", str(out)])
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == MODEL.read_bytes()
