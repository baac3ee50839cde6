"""Tokenizers: the HF `tokenizers` tokenizer a checkpoint (or an exported artifact) carries."""
from __future__ import annotations

import pathlib


def load_tokenizer(folder: pathlib.Path):
    """An HF `tokenizers` tokenizer when the folder has tokenizer.json, else None."""
    path = pathlib.Path(folder) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception types for malformed files
        raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
