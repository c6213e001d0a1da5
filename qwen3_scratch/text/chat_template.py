"""Chat templates: turn a list of messages into the prompt text a chat model was trained on.

A checkpoint ships its own Jinja template (in `tokenizer_config.json` or `chat_template.jinja`).
Templates are untrusted code from the Hub, so they run in Jinja's immutable sandbox. The settings
below are the ones `transformers` renders with, because a template is only correct in the
environment it was written for: `trim_blocks`/`lstrip_blocks` decide every newline of the prompt,
and a model prompted with one stray newline answers differently. The tests check the output
against `transformers.apply_chat_template(..., tokenize=False)` byte for byte.
"""

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from qwen3_scratch.errors import ConfigError, Qwen3Error, printable

# Older names for an assistant message's reasoning. transformers copies whichever is set to
# `reasoning_content` (what Qwen3's template reads) and to `thinking` (what gpt-oss's reads).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    template_source: str = "the chat template",
    **extra,
) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with a checkpoint's chat template.

    tools: JSON schemas of the functions the model may call ({"type": "function", "function": {...}}),
    documents: retrieved texts for templates that support them; both reach the template under those
    names exactly as transformers passes them (None when absent, so `{% if tools %}` is false).
    bos_token / eos_token (and any `extra` variable, e.g. pad_token) are visible to the template
    under those names; a None token is left undefined, as transformers does.
    template_source names where the template came from, for error messages.
    Raises ConfigError, one line, when the template does not compile or fails while rendering.
    """
    if not messages:
        raise Qwen3Error("apply_chat_template: the message list is empty; pass at least one message")
    variables = {"bos_token": bos_token, "eos_token": eos_token, **extra}
    variables = {name: value for name, value in variables.items() if value is not None}
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=_normalise_messages(messages),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **variables,
        )
    except jinja2.TemplateError as error:
        raise ConfigError(_one_line_error(error, template_source)) from error
    except Qwen3Error:
        raise
    except (ArithmeticError, RecursionError, TypeError, ValueError, LookupError, AttributeError, MemoryError) as error:
        # The template is downloaded code: 1/0, a macro calling itself or a filter fed the wrong type
        # are its bugs, not ours, and are reported like its syntax errors.
        where = f"{template_source}: {type(error).__name__}: {printable(' '.join(str(error).split()))}"
        raise ConfigError(f"{where}; fix the template or the messages passed to it") from error


def _normalise_messages(messages: list[dict]) -> list[dict]:
    """Copy the messages the way transformers does before rendering.

    Keys set to None are dropped (OpenAI-style APIs send `content=None`; templates test for a
    missing key, not for None), and reasoning under any of its names is exposed under all of them.
    """
    normalised = []
    for message in messages:
        if not isinstance(message, dict):
            raise Qwen3Error(f"apply_chat_template: each message must be a dict, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalised.append(message)
    return normalised


def _one_line_error(error: jinja2.TemplateError, source: str) -> str:
    where = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
    message = printable(" ".join(str(error.message or error).split()))
    return f"{source}{where}: {type(error).__name__}: {message}; fix the template or the messages passed to it"


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """Compile once per template text: a chat loop renders the same template every turn."""
    environment = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, plus a bound on `*` and `**`, which it lets through unchecked:
    `{{ "a" * 10**10 }}` in a downloaded template would otherwise try to allocate 10 GB."""

    intercepted_binops = frozenset({"*", "**"})
    MAX_ITEMS = 10**7

    def call_binop(self, context, operator, left, right):
        sizes = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
        counts = [x for x in (left, right) if isinstance(x, int)]
        too_big = (operator == "*" and sizes and counts and sizes[0] * max(counts) > self.MAX_ITEMS) or (
            operator == "**" and isinstance(right, int) and isinstance(left, int) and abs(right) > 64 and abs(left) > 1
        )
        if too_big:
            raise jinja2.sandbox.SecurityError(f"the result of {operator} is too large for a prompt")
        return super().call_binop(context, operator, left, right)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own `tojson` escapes <, >, & and ' for HTML and writes non-ASCII as \uXXXX; a prompt
    # is not HTML, and tool schemas in Chinese must reach the model as Chinese.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    # Templates call this to reject input they cannot render (e.g. roles out of order).
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    # Some templates (Llama 3's) print today's date in the system prompt.
    return datetime.now().strftime(format)



class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: a block that renders its body unchanged.

    transformers uses the tag to find the assistant's text for training masks, and some Hub
    templates contain it; without the tag they would not even compile here.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A scope, like the macro call transformers wraps it in: names set inside stay inside.
        return jinja2.nodes.Scope(body, lineno=lineno)
