"""Tokenizers a prepared dataset is made with: the built-in byte tokenizer, or a local Hugging Face tokenizer.

`bytes`: every UTF-8 byte is its own id (0..255). Without EOS the vocabulary is 256, the default `scaletrain train`
model's (stdlib bytes); with EOS it is 257 and the EOS id is 256. A Hugging Face tokenizer is a folder saved with
`save_pretrained` (tokenizer.json, tokenizer_config.json) or a tokenizer.json file, read with the `tokenizers`
library; nothing is downloaded. Documents are encoded without the tokenizer's own special tokens (no BOS); the
prepare step appends EOS itself, so both tokenizers give `encode(document) + [eos]`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from scaletrain.data.manifest import TokenizerInfo

BYTES = "bytes"
BYTES_VOCAB = 256
BYTES_EOS_ID = 256  # one past the byte ids: vocabulary 257 when EOS is on
# special tokens that end a document, in the order a tokenizer without tokenizer_config.json is searched for one
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used as asked; the message is one line naming the path and the fix."""


class DocumentTokenizer(Protocol):
    info: TokenizerInfo

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (int64), no special tokens added."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; EOS (when on) is 256."""

    def __init__(self, eos: bool):
        definition = json.dumps({"kind": BYTES, "version": 1, "eos": eos}, sort_keys=True).encode()
        self.info = TokenizerInfo(
            kind=BYTES,
            name=BYTES,
            fingerprint=hashlib.sha256(definition).hexdigest(),
            vocab_size=BYTES_VOCAB + 1 if eos else BYTES_VOCAB,
            eos_id=BYTES_EOS_ID if eos else None,
        )

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < BYTES_VOCAB).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from a local tokenizer.json (and the EOS token from its folder's configs)."""

    def __init__(self, path: str | Path, eos: bool):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not path.exists():
            raise TokenizerError(
                f"--tokenizer {path}: no such file or folder; pass a Hugging Face tokenizer folder, a tokenizer.json, "
                "or `bytes`"
            )
        if not file.is_file():
            raise TokenizerError(
                f"--tokenizer {path}: no tokenizer.json in this folder; save the tokenizer with save_pretrained "
                "(a fast tokenizer writes tokenizer.json) or pass `bytes`"
            )
        try:
            definition = file.read_bytes()
            self._tok = Tokenizer.from_str(definition.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception subclass for any unreadable definition
            raise TokenizerError(f"--tokenizer {file}: not a tokenizers definition ({_first_line(e)})") from e
        eos_id = _find_eos(self._tok, file.parent) if eos else None
        if eos and eos_id is None:
            raise TokenizerError(
                f"--tokenizer {path}: no EOS token found (tokenizer_config.json eos_token, or a special token "
                f"such as {' '.join(EOS_CANDIDATES[:3])}); set eos_token in tokenizer_config.json or pass --no-eos"
            )
        self.file = file
        self._exact: Any = None  # a copy for exact character offsets (encode_with_offsets), made on first use
        self.info = TokenizerInfo(
            kind="huggingface",
            name=str(path.resolve()),
            fingerprint=hashlib.sha256(definition).hexdigest(),
            vocab_size=self._tok.get_vocab_size(with_added_tokens=True),
            eos_id=eos_id,
        )

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64) of a text that may hold special tokens, and each token's (start, end) characters."""
        if self._exact is None:
            from tokenizers import Tokenizer

            # without the post-processor, whose ByteLevel trim_offsets would shrink a whitespace token to nothing;
            # with no special tokens added it changes no id
            self._exact = Tokenizer.from_str(self._tok.to_str())
            self._exact.post_processor = None
        e = self._exact.encode(text, add_special_tokens=False)
        return np.asarray(e.ids, dtype=np.int64), np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _config_eos(folder: Path) -> str | None:
    """eos_token from tokenizer_config.json, then special_tokens_map.json (a string or {"content": ...})."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            value = json.loads((folder / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


def _find_eos(tok, folder: Path) -> int | None:
    named = _config_eos(folder)
    if named is not None:
        return tok.token_to_id(named)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for candidate in EOS_CANDIDATES:
        if candidate in special:
            return tok.token_to_id(candidate)
    return None


def load_tokenizer(spec: str, eos: bool) -> DocumentTokenizer:
    """`bytes`, or a path to a Hugging Face tokenizer folder / tokenizer.json. Raises TokenizerError (one line)."""
    if spec == BYTES:
        return ByteTokenizer(eos)
    return HFTokenizer(spec, eos)


def tokenizer_for(info: TokenizerInfo) -> DocumentTokenizer | None:
    """The tokenizer a manifest records, if it can still be loaded and is the same one (fingerprint); else None."""
    try:
        tok = load_tokenizer(BYTES if info.kind == BYTES else info.name, eos=info.eos_id is not None)
    except TokenizerError:
        return None
    return tok if tok.info.fingerprint == info.fingerprint else None


def token_array(ids: list[np.ndarray], eos_id: int | None, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Documents' ids as one array of `dtype` (EOS after each document when eos_id is set) and each one's length."""
    extra = 0 if eos_id is None else 1
    lengths = np.fromiter((len(a) + extra for a in ids), dtype=np.int64, count=len(ids))
    if eos_id is None:
        flat = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
        return flat.astype(dtype, copy=False), lengths
    out = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    body = np.ones(len(out), dtype=bool)
    body[ends - 1] = False
    out[body] = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
    out[ends - 1] = eos_id
    return out, lengths
