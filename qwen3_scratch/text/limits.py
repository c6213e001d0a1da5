"""How much text one prompt may be, checked before it is tokenized in full.

Prompts are untrusted input (a 100 MB paste, a file that never ends, text that is not UTF-8), so
their size is bounded before any of the expensive work. The limits:

- MAX_PROMPT_BYTES (4 MiB) for one prompt: the longest context any Qwen3 checkpoint runs (131,072
  tokens, with YaRN) x MAX_BYTES_PER_TOKEN. Real text takes 3-5 bytes per token; 32 is generous, so
  a longer prompt could not fit any Qwen3. Once the model is known, its own context x 32 applies.
- Text must be encodable as UTF-8 (argv bytes that were not arrive as lone surrogates).

`count_tokens_upto` then measures a prompt against the context by tokenizing a growing prefix, so a
prompt far too long is refused after tokenizing about one context's worth of it, not all of it.
`check_fits` puts both together against a model's context. The CLIs (cli/inputs.py), Pipeline and the
server share these, and the batch size that bounds a list of prompts; nothing here imports torch.
"""

from collections.abc import Callable

from qwen3_scratch.errors import GenerationError, InputError

MAX_BYTES_PER_TOKEN = 32
LONGEST_QWEN3_CONTEXT = 131_072
MAX_PROMPT_BYTES = LONGEST_QWEN3_CONTEXT * MAX_BYTES_PER_TOKEN  # 4 MiB
# Prompts per batch in Pipeline.generate and `qwen3-generate --batch-size`: each batch is one generation
# with its own KV cache (B x context slots), so 10,000 prompts run in bounded memory, batch by batch.
DEFAULT_BATCH_SIZE = 8


def check_prompt(text: str, label: str) -> str:
    """A prompt given as a str (argv, an API call): within MAX_PROMPT_BYTES and encodable as UTF-8."""
    if len(text) > MAX_PROMPT_BYTES:
        raise InputError(f"{label}: {len(text):,} characters is over the limit of {MAX_PROMPT_BYTES:,} bytes per prompt")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv bytes that were not UTF-8 arrive as lone surrogates
        offset = len(text[: e.start].encode("utf-8", "surrogateescape"))
        raise InputError(f"{label}: byte {offset} is not UTF-8; pass the text as UTF-8") from None
    if len(data) > MAX_PROMPT_BYTES:
        raise InputError(f"{label}: {len(data):,} bytes is over the limit of {MAX_PROMPT_BYTES:,} per prompt")
    return text


def count_tokens_upto(encode: Callable[[str], list], text: str, limit: int) -> int:
    """len(encode(text)) when that is at most `limit`; otherwise some count > limit of a prefix.

    The prefix starts at 4 x limit characters and doubles, so a text far over the limit costs about
    `limit` tokens of work. Each prefix is cut just before a space, a word boundary where Qwen's
    pre-tokenizer splits anyway, so the prefix's tokens are the first tokens of the whole text (inside
    a run of spaces, one more at most): a count over the limit proves the whole text is over it.
    """
    size = 4 * limit
    while size < len(text):
        cut = text.rfind(" ", size // 2, size)
        count = len(encode(text[: cut if cut > 0 else size]))
        if count > limit:
            return count
        size *= 2
    return len(encode(text))


def check_fits(text: str, label: str, encode: Callable[[str], list], context: int) -> None:
    """Refuse a text that cannot fit the context, cheaply, before it is fully tokenized: first by its
    length (MAX_BYTES_PER_TOKEN per token at most), then by tokenizing only about as much of it as the
    context holds. (The exact count, template included, is checked when it runs.)"""
    if len(text) > context * MAX_BYTES_PER_TOKEN:
        raise GenerationError(f"{label} is {len(text):,} characters, more than the model's context of {context} "
                              f"tokens can hold at {MAX_BYTES_PER_TOKEN} per token; shorten the prompt")  # fmt: skip
    check_prompt(text, label)  # UTF-8 (no lone surrogates) and the reading limit, as the CLI's input
    if len(text) >= context and (n := count_tokens_upto(encode, text, context)) >= context:
        raise GenerationError(f"{label} is at least {n} tokens but the model's context is {context}; shorten the prompt")
