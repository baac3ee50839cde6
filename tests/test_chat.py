"""Chat templates rendered as transformers renders them: loop controls, its tojson, template files, text parts."""
import json

import pytest

from glint.runtime.chat import chat_messages, load_chat_template, render_chat


def test_template_features_transformers_provides(tmp_path):
    template = ("{% for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}"
                "{{ m | tojson }};{% endfor %}{% if add_generation_prompt %}{{ bos_token }}>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                                 "bos_token": {"content": "<s>"}}))
    chat = load_chat_template(tmp_path)
    messages = [{"role": "user", "content": "café ✓", "b": 1}, {"role": "stop", "content": "x"},
                {"role": "user", "content": "never"}]
    # tojson as transformers defines it: no ASCII escapes, keys in their order; {% break %} works
    assert render_chat(chat, messages) == '{"role": "user", "content": "café ✓", "b": 1};<s>>'


def test_template_file_and_missing_template(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{{ eos_token }}")
    chat = load_chat_template(tmp_path)
    assert render_chat(chat, [{"role": "user", "content": "hi"}]) == "hi</s>"
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_chat_template(tmp_path)


def test_messages_text_parts_and_refusals():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}]
    assert chat_messages(parts) == [{"role": "user", "content": "a b"}]
    for bad in ([], "hi", [{"role": "user"}], [{"content": "x"}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]):
        with pytest.raises(ValueError, match="messages must be a non-empty list"):
            chat_messages(bad)
    chat = {"template": "{{ raise_exception('no system role') }}", "tokens": {}}
    with pytest.raises(ValueError, match="the chat template refused these messages: no system role"):
        render_chat(chat, [{"role": "system", "content": "x"}])
