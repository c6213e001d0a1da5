"""Chat templates render byte for byte as transformers' apply_chat_template(..., tokenize=False)."""

import json

import pytest
import transformers
from make_tiny_checkpoint import CHAT_TEMPLATE_FILE, make_tiny_checkpoint

from qwen3_scratch.errors import ConfigError, Qwen3Error
from qwen3_scratch.text.chat_template import render_chat_template
from qwen3_scratch.text.tokenizer import Tokenizer

# Plain ChatML (Qwen2.5-style): a default system prompt, every turn verbatim, no reasoning handling.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message.role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
QWEN3_STYLE = CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
# Written the readable way, with indented tags and no `-` trimming: its output is right only under
# transformers' trim_blocks + lstrip_blocks. It also uses `continue` (the loop-controls extension).
INDENTED = """\
{% for message in messages %}
    {% if message.role == 'system' %}
        {% continue %}
    {% endif %}
    [{{ message.role | upper }}] {{ message.content }}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}
"""
TEMPLATES = {"chatml": CHATML, "qwen3-style": QWEN3_STYLE, "indented": INDENTED}

SYSTEM = {"role": "system", "content": "You answer in one line."}
ASK = {"role": "user", "content": "What is 2 + 2?"}
OLD_ANSWER = {"role": "assistant", "content": "<think>\nold reasoning: add them\n</think>\n\nIt is 4."}
FOLLOW_UP = {"role": "user", "content": "你好！And 3 + 3? 🙂"}
NEW_ANSWER = {"role": "assistant", "content": "It is 6.", "reasoning_content": "new reasoning: add again"}

CONVERSATIONS = {
    "user only": [ASK],
    "system and user": [SYSTEM, ASK],
    "multi-turn": [SYSTEM, ASK, OLD_ANSWER, FOLLOW_UP],
    "ends with an answer": [ASK, OLD_ANSWER, FOLLOW_UP, NEW_ANSWER],
    "reasoning under an older name": [ASK, {"role": "assistant", "content": "4", "thinking": "sum"}],
    "content None is dropped": [ASK, {"role": "assistant", "content": None, "reasoning_content": "r"}],
}


def write_checkpoint_with_template(source, folder, template):
    """A tokenizer-only checkpoint: the tiny tokenizer with `template` as its chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))


def both_tokenizers(tiny, folder, template):
    """(our Tokenizer, transformers' tokenizer) on one folder whose chat template is `template`."""
    folder = write_checkpoint_with_template(tiny, folder, template)
    return Tokenizer.from_checkpoint(folder), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=TEMPLATES)
def pair(request, tiny, tmp_path_factory):
    return both_tokenizers(tiny, tmp_path_factory.mktemp(request.param), TEMPLATES[request.param])


@pytest.fixture(scope="module")
def qwen3_pair(tiny, tmp_path_factory):
    return both_tokenizers(tiny, tmp_path_factory.mktemp("qwen3-style"), QWEN3_STYLE)


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_rendering_matches_transformers_byte_for_byte(pair, name, add_generation_prompt, enable_thinking):
    ours, theirs = pair
    messages = CONVERSATIONS[name]
    settings = dict(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    expected = theirs.apply_chat_template(messages, tokenize=False, **settings)
    actual = ours.apply_chat_template(messages, **settings)
    assert actual == expected, (
        f"{name!r} with {settings} differs:\n--- ours\n{actual!r}\n--- transformers\n{expected!r}"
    )


def test_thinking_off_appends_an_empty_think_block(qwen3_pair):
    ours, _ = qwen3_pair
    prompt = ours.apply_chat_template([ASK], enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), f"wrong generation prompt: {prompt!r}"
    assert ours.apply_chat_template([ASK]).endswith("<|im_start|>assistant\n"), "thinking on must open a bare turn"


def test_qwen3_style_template_keeps_only_the_newest_reasoning(qwen3_pair):
    ours, theirs = qwen3_pair
    messages = [SYSTEM, ASK, OLD_ANSWER, FOLLOW_UP, NEW_ANSWER]
    prompt = ours.apply_chat_template(messages, add_generation_prompt=False)
    assert prompt == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert "old reasoning" not in prompt, f"reasoning before the last user turn must be dropped:\n{prompt}"
    assert "It is 4." in prompt, "the old turn's answer must stay"
    assert "<think>\nnew reasoning: add again\n</think>\n\nIt is 6.<|im_end|>" in prompt, (
        f"the turn after the last user message must keep its reasoning:\n{prompt}"
    )


def test_tojson_keeps_non_ascii_and_sees_special_tokens_like_transformers(tiny, tmp_path):
    template = "{{ messages | tojson }}|{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}"
    ours, theirs = both_tokenizers(tiny, tmp_path, template)
    messages = [{"role": "user", "content": "你好 <b>&'🙂"}]
    expected = theirs.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages) == expected, "tojson or the special-token variables differ"
    assert "你好" in expected, "tojson must not escape non-ASCII"


def test_chat_template_jinja_file_wins_over_the_config(tiny, tmp_path):
    folder = write_checkpoint_with_template(tiny, tmp_path, CHATML)
    (folder / "chat_template.jinja").write_text("from the file: {{ messages[0].content }}", encoding="utf-8")
    expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template([ASK], tokenize=False)
    assert Tokenizer.from_checkpoint(folder).apply_chat_template([ASK]) == expected == "from the file: What is 2 + 2?"


def test_template_errors_are_one_line_config_errors_naming_the_template():
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    with pytest.raises(ConfigError) as caught:
        render_chat_template(template, [SYSTEM], template_source="tokenizer_config.json (chat_template)")
    message = str(caught.value)
    assert isinstance(caught.value, Qwen3Error), "template errors must be user-facing Qwen3Errors"
    assert "tokenizer_config.json" in message and "first message must be from the user" in message, message
    assert "\n" not in message, f"user-facing errors are one line: {message!r}"


def test_template_syntax_errors_name_the_line():
    with pytest.raises(ConfigError, match=r"chat_template.jinja \(line 2\).*TemplateSyntaxError") as caught:
        render_chat_template("ok\n{% for m in messages %}", [ASK], template_source="chat_template.jinja")
    assert "\n" not in str(caught.value), "user-facing errors are one line"


def test_a_checkpoint_without_a_template_says_how_to_fix_it(tiny, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError, match="no chat template"):
        Tokenizer.from_checkpoint(tmp_path).apply_chat_template([ASK])


def test_an_empty_conversation_is_refused():
    with pytest.raises(Qwen3Error, match="empty"):
        render_chat_template(CHATML, [])
