"""The SFT keys of the [data] section, as the options of the SFT reader (``trainer.data.sft``)."""

import dataclasses
from dataclasses import dataclass

from trainer.config import DataConfig
from trainer.errors import UserError

# SFTOptions() holds the [data] section's defaults, so the API and train.py agree.
_DATA = DataConfig()


@dataclass
class SFTOptions:
    """How SFT rows are read, rendered, masked, truncated and batched: the SFT keys of [data].

    truncation, for a sample longer than ``seq_len + 1`` tokens:
      * ``"truncate_prompt"``: keep the BOS and the last ``seq_len`` tokens, so
        the final assistant reply (with its EOS) stays whole and the oldest
        context is cut. If the final reply alone is longer than ``seq_len``
        tokens, the sample is dropped.
      * ``"drop"``: drop the sample.
    Truncated and dropped samples are counted in ``stats()`` (``truncated``,
    ``dropped``); nothing is cut from a final reply.
    """

    format: str = _DATA.sft_format
    instruction_field: str = _DATA.instruction_field
    input_field: str = _DATA.input_field
    output_field: str = _DATA.output_field
    messages_field: str = _DATA.messages_field
    train_on: str = _DATA.train_on
    pack: bool = _DATA.pack
    truncation: str = _DATA.truncation
    shuffle: bool = _DATA.shuffle

    def __post_init__(self) -> None:
        for name, key in _CONFIG_KEYS.items():
            allowed = _CHOICES[key]
            if allowed and getattr(self, name) not in allowed:
                raise UserError(
                    f"SFT option {name} = '{getattr(self, name)}' is not one of: {', '.join(allowed)}"
                )

    @classmethod
    def from_config(cls, data: DataConfig) -> "SFTOptions":
        """The options a run's [data] section sets."""
        return cls(**{name: getattr(data, key) for name, key in _CONFIG_KEYS.items()})


# Each option and the [data] key that sets it (and lists its choices).
_CONFIG_KEYS = {
    "format": "sft_format", "instruction_field": "instruction_field", "input_field": "input_field",
    "output_field": "output_field", "messages_field": "messages_field", "train_on": "train_on",
    "pack": "pack", "truncation": "truncation", "shuffle": "shuffle",
}
_CHOICES = {f.name: f.metadata["choices"] for f in dataclasses.fields(DataConfig)}
