"""How to sample: a request's settings, and logits -> token ids. No model, no text.

params.py (`SamplingParams`, in vLLM's names, and the table of limits every entry point checks
against), logits.py (`LogitsFilter`: temperature, top-k, top-p, min-p as pure functions of logits;
`sample` with no host sync), processors.py (penalties, logit_bias, min_tokens, bad words: pure functions
of logits and the output so far, in vLLM's order), logprobs.py (scoring tokens), structured.py (a
grammar's token mask for structured output, with llguidance), after_reasoning.py (that grammar starting
after `</think>`, the reasoning before it free), rejection.py (which proposed tokens
speculative decoding keeps: greedy agreement, or rejection sampling with the same filters), prompt_lookup.py (the
proposals prompt lookup makes, for the loops and the engine alike), defaults.py (the checkpoint's
generation_config.json and the ids that end a generation).

May import: the package root. Imported by: generation, engine, server, cli.
"""
