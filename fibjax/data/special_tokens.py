"""The special tokens a tokenizer's source model uses, from the JSON files beside the tokenizer
in a Hugging Face model directory. They are read as data: nothing in the directory is executed.

Each setting comes from the first file that has its key, an explicit null included (Qwen2's
tokenizer_config.json says ``"bos_token": null`` while its config.json still names an id):

    BOS      tokenizer_config.json bos_token, special_tokens_map.json bos_token,
             generation_config.json bos_token_id, config.json bos_token_id
    EOS      the same with eos; a list of ids (chat models' generation_config.json) gives its first
    add_bos  tokenizer_config.json add_bos_token (how transformers' Llama tokenizers decide)

A setting no file gives is the tokenizer's own: a SentencePiece model's BOS/EOS pieces, or the
tokens a tokenizer.json's post-processor wraps a text in (Llama 3 prepends <|begin_of_text|>).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from fibjax.data.tokenizer_base import TOKENIZER_CONFIG, SpecialTokens, TokenizerError

# where BOS and EOS are looked for, in order: (file, key); add_bos only in tokenizer_config.json
_TOKEN_PLACES = (
    (TOKENIZER_CONFIG, "{}_token"),
    ("special_tokens_map.json", "{}_token"),
    ("generation_config.json", "{}_token_id"),
    ("config.json", "{}_token_id"),
)
_PLACES = {token: tuple((name, key.format(token)) for name, key in _TOKEN_PLACES) for token in ("bos", "eos")} | {
    "add_bos": ((TOKENIZER_CONFIG, "add_bos_token"),)
}
SIDE_FILES = tuple(name for name, _ in _TOKEN_PLACES)


def read_side_settings(directory: Path) -> dict[str, tuple[Path, object]]:
    """setting ("bos", "eos", "add_bos") -> (file, value as written) for each setting a file gives."""
    parsed: dict[Path, dict] = {}
    found = {}
    for setting, places in _PLACES.items():
        for name, key in places:
            path = directory / name
            if path not in parsed:
                parsed[path] = _read_json(path)
            if key in parsed[path]:
                found[setting] = (path, parsed[path][key])
                break
    return found


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} holds a JSON {type(data).__name__}, not the object of settings a Hugging Face model directory has")
    return data


def resolve(
    side: dict[str, tuple[Path, object]],
    *,
    own_bos: int | None,
    own_eos: int | None,
    own_add_bos: bool,
    token_id: Callable[[str], int | None],
    vocab_size: int,
    source: str,
) -> SpecialTokens:
    """The settings the side files give, else the tokenizer's own (``own_add_bos``: the tokenizer
    itself begins a text with ``own_bos``)."""

    def as_id(setting: str) -> int | None:
        path, value = side[setting]
        if isinstance(value, dict) and isinstance(value.get("content"), str):  # a serialized AddedToken
            value = value["content"]
        if isinstance(value, list) and value:
            value = value[0]
        if value is None:
            return None
        if isinstance(value, str):
            found = token_id(value)
            if found is None:
                raise TokenizerError(f"{path}: its {setting} token {value!r} is not in the vocabulary of {source}")
            return found
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
            return value
        raise TokenizerError(f"{path}: its {setting} token {value!r} is neither a token of {source} nor an id below its vocabulary size {vocab_size}")

    bos = as_id("bos") if "bos" in side else own_bos
    eos = as_id("eos") if "eos" in side else own_eos
    if eos is None:
        raise TokenizerError(
            f"{source} names no EOS token, and fibjax ends every document with one: give the Hugging Face model directory "
            f"(its {TOKENIZER_CONFIG} names eos_token) or put a {TOKENIZER_CONFIG} with eos_token beside the file"
        )
    if "add_bos" in side:
        path, add_bos = side["add_bos"]
        if not isinstance(add_bos, bool):
            raise TokenizerError(f"{path}: add_bos_token is {add_bos!r}, not true or false")
    else:
        add_bos = own_add_bos and bos == own_bos
    if add_bos and bos is None:
        raise TokenizerError(f"{side['add_bos'][0]}: add_bos_token is true, but {source} has no BOS token")
    return SpecialTokens(bos, eos, add_bos)
