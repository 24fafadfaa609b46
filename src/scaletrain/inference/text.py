"""Prompts and chat turns to token ids, and completions back to text, as the model was trained to read them.

A Hugging Face tokenizer folder is read by transformers (PreTrainedTokenizerFast); a chat turn is rendered with the
folder's own chat template (data/chat.py reads it as `data prepare --format chat` does) with the generation
prompt, and tokenized without added special tokens, as prepare tokenized the training conversations. Generation
stops at the tokenizer's EOS and, for chat, at the template's end-of-turn token (found by rendering one assistant
turn, not by name). `bytes`: UTF-8 bytes are the ids (the built-in byte-level data); EOS is 256 when the model's
vocabulary has it.
"""

from __future__ import annotations

from pathlib import Path

BYTES = "bytes"
BYTES_VOCAB = 256
_PROBE = "scaletrain-probe-answer"  # an assistant turn's content, rendered to find what the template writes after it


class TextCodec:
    """Encoding and decoding for one tokenizer (`bytes` or a folder); ValueError (one line) when it cannot load."""

    def __init__(self, tokenizer: str, vocab_size: int):
        self.name = tokenizer
        self.vocab_size = vocab_size
        self._hf = None
        self.template: str | None = None
        if tokenizer == BYTES:
            return
        from transformers import PreTrainedTokenizerFast

        from scaletrain.data.chat import read_chat_template, tokenizer_folder

        folder = tokenizer_folder(tokenizer)
        if folder is None or not (folder / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer: {tokenizer} holds no tokenizer.json; pass a Hugging Face tokenizer folder")
        self._hf = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        self.template = read_chat_template(Path(folder))
        if self.template is not None:
            self._hf.chat_template = self.template

    @property
    def eos_id(self) -> int | None:
        if self._hf is None:
            return BYTES_VOCAB if self.vocab_size > BYTES_VOCAB else None
        return self._hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Ids of plain text, no special tokens added (as `data prepare` encodes documents)."""
        if self._hf is None:
            return list(text.encode("utf-8"))
        return list(self._hf.encode(text, add_special_tokens=False))

    def chat(self, user: str, system: str | None = None) -> list[int]:
        """Ids of a conversation of one user turn (after a system turn when given) rendered by the chat template
        with the generation prompt: the model's answer comes next."""
        if self._hf is None or self.template is None:
            raise ValueError(
                f"--chat: the tokenizer {self.name} has no chat template; use --prompt, or pass --tokenizer DIR "
                f"with one"
            )
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": user}
        ]
        text = self._render(messages, generation_prompt=True)
        return self.encode(text)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        from jinja2 import TemplateError as JinjaError

        assert self._hf is not None
        try:
            text = self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except JinjaError as e:  # the template's own raise_exception, e.g. a system turn it does not take
            raise ValueError(f"--chat: the chat template refuses this conversation: {e}") from None
        return str(text)

    def stop_ids(self, chat: bool) -> list[int]:
        """Token ids that end a completion: EOS, and under --chat the template's end-of-turn token."""
        stops = [] if self.eos_id is None else [self.eos_id]
        if chat and self._hf is not None:
            user = [{"role": "user", "content": "hi"}]
            asked = self._render(user, generation_prompt=True)
            answered = self._render([*user, {"role": "assistant", "content": _PROBE}], generation_prompt=False)
            after = answered[len(asked) :].split(_PROBE, 1)[-1].strip()
            ids = self.encode(after) if after else []
            if len(ids) == 1 and ids[0] not in stops:
                stops.append(ids[0])
        return stops

    def decode(self, ids: list[int]) -> str:
        """The completion's text, special tokens (end of turn, EOS) left out."""
        if self._hf is None:
            return bytes(i for i in ids if i < BYTES_VOCAB).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=True)
