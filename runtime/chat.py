"""Chat prompts: the checkpoint's chat template, rendered as transformers renders it (for `glint serve`)."""
from __future__ import annotations

import json
import pathlib

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def load_chat_template(folder) -> dict | None:
    """The checkpoint's chat template (tokenizer_config.json's chat_template, or chat_template.jinja) and its
    special tokens; None when it has no template."""
    folder = pathlib.Path(folder)
    path = folder / "tokenizer_config.json"
    config = {}
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        return None
    token = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731 (AddedToken dicts)
    return {"template": template, "tokens": {k: token(config.get(k)) or "" for k in SPECIAL_TOKENS}}


def chat_messages(messages) -> list[dict]:
    """The request's messages with string content (a list of text parts is joined, as vLLM does)."""
    def text(content):
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        return None

    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and text(m.get("content")) is not None
            for m in messages):
        raise ValueError("messages must be a non-empty list of {role, content} objects with text content")
    return [dict(m, content=text(m["content"])) for m in messages]


def render_chat(chat: dict, messages: list[dict]) -> str:
    """The prompt text for `messages`, rendered as transformers renders chat templates: sandboxed jinja2 with
    loop controls, its tojson, strftime_now and raise_exception, and the special tokens."""
    import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        return env.from_string(chat["template"]).render(messages=messages, add_generation_prompt=True,
                                                        **chat["tokens"])
    except TemplateError as e:
        raise ValueError(f"the chat template refused these messages: {e}") from None
