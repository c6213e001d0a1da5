"""Log-probabilities in OpenAI's two shapes, from the engine's scored tokens (sampling/logprobs.py).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`, one
entry per generated token (as vLLM: reasoning and tool-call tokens included, in order). `bytes` are the
token's own bytes, so a character split over two tokens can be put back together.
Completions (the legacy shape evaluation harnesses read): `{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`, with the prompt's tokens first under `echo` (the first has no logprob: null). Its
top_logprobs map token text -> logprob for the k likeliest tokens and the token taken (vLLM's rule), so a
harness can tell whether the taken token was the greedy one.
"""

from qwen3_scratch.sampling.logprobs import TokenLogprob
from qwen3_scratch.text.token_bytes import token_bytes
from qwen3_scratch.text.tokenizer import Tokenizer

FLOOR = -9999.0  # JSON has no -inf: OpenAI's floor for an impossible token


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def chat_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict:
    return {"token": tokenizer.decode([token_id]), "logprob": _value(logprob),
            "bytes": list(token_bytes(tokenizer, token_id))}  # fmt: skip


def chat_logprobs(tokenizer: Tokenizer, scored: list[TokenLogprob]) -> dict:
    content = []
    for lp in scored:
        entry = chat_entry(tokenizer, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [chat_entry(tokenizer, i, v) for i, v in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], scored: list[TokenLogprob | None],
                        offset: int = 0) -> dict:  # fmt: skip
    """The legacy shape for token_ids (each scored, or None for an echoed first token); text_offset counts
    characters from `offset`, where these tokens' text starts in the choice's text."""
    body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in zip(token_ids, scored):
        text = tokenizer.decode([token_id])
        body["tokens"].append(text)
        body["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        body["token_logprobs"].append(_value(lp.logprob))
        top = {tokenizer.decode([i]): _value(v) for i, v in lp.top}
        top.setdefault(text, _value(lp.logprob))
        body["top_logprobs"].append(top)
    return body


def vllm_prompt_logprobs(tokenizer: Tokenizer, scored: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` extension: per prompt token, {id: {"logprob", "rank", "decoded_token"}} for the
    token itself and its top alternatives; None for the first token."""
    out = []
    for lp in scored:
        if lp is None:
            out.append(None)
            continue
        entries = {str(lp.token_id): {"logprob": _value(lp.logprob), "rank": lp.rank,
                                      "decoded_token": tokenizer.decode([lp.token_id])}}  # fmt: skip
        for rank, (token_id, value) in enumerate(lp.top, start=1):
            entries.setdefault(str(token_id), {"logprob": _value(value), "rank": rank,
                                               "decoded_token": tokenizer.decode([token_id])})  # fmt: skip
        out.append(entries)
    return out
