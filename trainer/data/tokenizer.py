"""SentencePiece tokenizer in LLaMA-2's format (Meta's ``tokenizer.model``).

Works unchanged with the real LLaMA-2 ``tokenizer.model`` and with the small
``data/tokenizer.model`` that ``scripts/train_tokenizer.py`` ships.
"""

import hashlib
import os
from typing import Any

from sentencepiece import SentencePieceProcessor

from trainer.errors import UserError


class Tokenizer:
    """Thin wrapper that mirrors Meta's ``llama/tokenizer.py``.

    ``pad_id`` is -1 in LLaMA-2 (no pad piece): it is not a valid embedding
    index, so loaders pad inputs with another id and mask labels with -100.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            if os.path.exists(path):
                raise UserError(f"tokenizer file {path} is not a regular file (a folder, device or pipe)")
            raise UserError(f"tokenizer file not found: {path}")
        self.path = path
        self.sp_model = SentencePieceProcessor()
        try:
            # sentencepiece raises RuntimeError/OSError with a multi-line C++ message; not
            # `Exception`, which would report a SIGTERM during start-up (Interrupted) as a bad file.
            self.sp_model.Load(path)
        except (RuntimeError, OSError) as e:
            raise UserError(
                f"tokenizer file {path} is not a valid sentencepiece model "
                f"({type(e).__name__})"
            ) from None
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise UserError(f"tokenizer file {path} has no BOS/EOS pieces (not LLaMA-style)")

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of its tokenizer: the piece count and a digest of the model file.

        Two tokenizers with these equal map text to the same ids; the path is only for messages.
        """
        with open(self.path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        return {"vocab_size": self.n_words, "sha256": digest, "path": self.path}

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        ids: list[int] = self.sp_model.encode(text)
        if bos:
            ids = [self.bos_id, *ids]
        if eos:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.sp_model.decode([int(i) for i in ids])
