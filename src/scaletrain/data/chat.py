"""Chat and prompt-completion samples -> token ids and a loss mask (1: trained as a target, 0: not).

A chat sample (a `messages` list of {role, content}) is rendered with the tokenizer folder's own chat template by
transformers' renderer (`apply_chat_template`, not re-implemented). Real templates carry no `{% generation %}`
markers, so the assistant spans are found by rendering prefixes: assistant turn i starts where the conversation up
to before it, rendered with the generation prompt, ends, and stops where the conversation up to and including it
ends (less trailing whitespace after its end-of-turn token, e.g. ChatML's newline). Each rendered prefix must be a
text prefix of the whole rendering, else the template is not prefix-stable and is refused. The whole rendering is
tokenized once (no special tokens added: the template writes BOS itself where it wants one) and a token is trained
when its characters lie inside an assistant span: the assistant's content and its end-of-turn token; system and
user turns, role headers and the generation prompt are not trained.

A prompt-completion sample is the prompt as a user turn and the completion as the assistant turn when the
tokenizer has a chat template; without one, prompt and completion are tokenized apart and concatenated, with the
loss on the completion and the EOS after it only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHAT = "chat"
PROMPT_COMPLETION = "prompt-completion"
TEXT = "text"
FORMATS = (TEXT, CHAT, PROMPT_COMPLETION)
TEMPLATE_FILE = "chat_template.jinja"


class SampleError(ValueError):
    """One sample that cannot be rendered; the caller adds the file and line or row."""


class TemplateError(ValueError):
    """A chat template that cannot be used at all; the message is one line naming the folder and the fix."""


def tokenizer_folder(spec: str) -> Path | None:
    """The folder of a Hugging Face tokenizer argument (a folder, or a tokenizer.json in one); None for `bytes`."""
    if spec == "bytes":
        return None
    path = Path(spec)
    return path if path.is_dir() else path.parent


def read_chat_template(folder: Path | None) -> str | None:
    """The folder's chat template: `chat_template` of tokenizer_config.json, else chat_template.jinja; None if
    neither (a dict of named templates gives its "default")."""
    if folder is None:
        return None
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if isinstance(template, list):  # transformers' form for several named templates
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if isinstance(template, str) and template.strip():
        return template
    file = folder / TEMPLATE_FILE
    if file.is_file():
        text = file.read_text()
        return text if text.strip() else None
    return None


def template_sha256(template: str | None) -> str | None:
    return None if template is None else hashlib.sha256(template.encode()).hexdigest()


@dataclass
class Encoded:
    ids: np.ndarray  # int64
    mask: np.ndarray  # uint8, same length: 1 where the token is trained as a target


class ChatEncoder:
    """Renders samples with a tokenizer folder's chat template (template: its text, or None for prompt-completion
    by plain concatenation with `eos_id` after the completion) and tokenizes them with `tokenizer`, the dataset's
    own (data/tokenizer.py), so chat and text data of one tokenizer give the same ids for the same text."""

    def __init__(self, folder: Path | None, template: str | None, tokenizer, eos_id: int | None):
        self.template = template
        self._backend = tokenizer
        self._eos_id = eos_id
        self._hf = None
        if template is not None:
            from transformers import PreTrainedTokenizerFast

            assert folder is not None
            self._hf = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
            self._hf.chat_template = template

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        from jinja2 import TemplateError as JinjaError

        assert self._hf is not None
        try:
            text = self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except JinjaError as e:  # the template's own raise_exception (a refused role, an order it does not take)
            raise SampleError(f"the chat template refuses this conversation: {_one_line(e)}") from None
        if not isinstance(text, str):
            raise SampleError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def chat(self, messages: object) -> Encoded:
        """Token ids and mask of one conversation (a list of {role, content}; SampleError if not, or if the
        template refuses it; TemplateError if the template is not prefix-stable). Turns with role "assistant"
        are trained."""
        msgs = check_messages(messages)
        whole = self._render(msgs, generation_prompt=False)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = self._render(msgs[:i], generation_prompt=True)
            through = self._render(msgs[: i + 1], generation_prompt=False)
            for prefix, what in ((before, "before"), (through, "through")):
                if not whole.startswith(prefix):
                    raise TemplateError(
                        f"the chat template is not prefix-stable: the conversation rendered {what} assistant turn "
                        f"{i} is not the start of the whole rendering, so the assistant spans cannot be found; "
                        "use a template that renders earlier turns the same whatever follows"
                    )
            end = len(through.rstrip())  # the end-of-turn token is kept, the whitespace the template adds after it not
            if end > len(before):
                spans.append((len(before), end))
        ids, offsets = self._backend.encode_with_offsets(whole)
        mask = np.zeros(len(ids), dtype=np.uint8)
        if len(ids):
            for lo, hi in spans:
                # a token is trained when its characters lie in the span; one straddling a boundary is not
                mask[(offsets[:, 0] >= lo) & (offsets[:, 1] <= hi) & (offsets[:, 1] > offsets[:, 0])] = 1
        return Encoded(ids, mask)

    def prompt_completion(self, prompt: object, completion: object) -> Encoded:
        """Token ids and mask of a prompt and its completion (strings; SampleError if not)."""
        for value, what in ((prompt, "prompt"), (completion, "completion")):
            if not isinstance(value, str):
                raise SampleError(f"the {what} is {type(value).__name__}, not a string")
        assert isinstance(prompt, str) and isinstance(completion, str)
        if self.template is not None:
            return self.chat([{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}])
        first, second = self._backend.encode_batch([prompt, completion])
        tail = [] if self._eos_id is None else [self._eos_id]
        ids = np.concatenate([first, second, np.asarray(tail, dtype=np.int64)]).astype(np.int64)
        mask = np.concatenate([np.zeros(len(first), np.uint8), np.ones(len(second) + len(tail), np.uint8)])
        return Encoded(ids, mask)


def check_messages(messages: object) -> list[dict]:
    """A list of {"role": str, "content": str} (other keys kept for the template), else SampleError."""
    if not isinstance(messages, list) or not messages:
        raise SampleError(f"messages is {_describe(messages)}, not a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SampleError(f"message {i} is {type(m).__name__}, not an object with role and content")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise SampleError(f"message {i}: {key!r} is {_describe(m.get(key))}, not a string")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]  # Parquet structs fill absent keys


def _describe(value: object) -> str:
    if value is None:
        return "missing"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return type(value).__name__


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
