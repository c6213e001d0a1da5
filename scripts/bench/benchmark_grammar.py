"""Per-token cost of a grammar engine on this CPU: xgrammar against llguidance, on Qwen3's real vocabulary.

    python scripts/bench/benchmark_grammar.py            # prints a table and writes docs/benchmarks/grammar_cpu.json

Structured output asks the grammar engine, at every step of every constrained sequence, for the mask of
tokens that keep the output valid (151,669 tokens checked against the grammar's state), then tells it the
token drawn. That work sits on the engine's critical path, once per sequence per step, so this measures it:
a JSON-schema document tokenized with Qwen3's BPE is fed token by token, mask then accept, to 1 matcher
and to 16 matchers stepping together (16 concurrent requests: one after the other, and through each
library's own batch call, which spreads rows over threads). Also the schema's compile time, and building
the engine's tokenizer tables (once per server). Medians of `--repeats` runs, engines alternated.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["admin", "user", "guest"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "score"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["admin", "user"],
            "address": {"city": "London", "zip": "W1 4AB"}, "score": 99.5}  # fmt: skip


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[bytes], eos: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW,
                                 vocab_size=len(vocab), stop_token_ids=eos)  # fmt: skip
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.vocab_size = len(vocab)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled, n):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n):
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def step(self, matchers, bitmask, token, batched):
        if batched:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
        for m in matchers:
            assert m.accept_token(token), "xgrammar refused the document's token"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int]):
        import llguidance
        import llguidance.torch as llt

        self.ll, self.llt = llguidance, llt
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.setup_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.vocab_size = vocab_size

    def compile(self, schema):
        options = {"whitespace_flexible": False}
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        self.ll.LLMatcher(self.tokenizer, grammar)  # compiling happens when a matcher is made: time it here too
        return grammar

    def matchers(self, grammar, n):
        return [self.ll.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def bitmask(self, n):
        return self.llt.allocate_token_bitmask(n, self.vocab_size)

    def step(self, matchers, bitmask, token, batched):
        if batched:
            self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        else:
            for i, m in enumerate(matchers):
                self.llt.fill_next_token_bitmask(m, bitmask, i)
        for m in matchers:
            assert m.consume_token(token), f"llguidance refused the document's token: {m.get_error()}"


def run_once(engine, tokens, n, batched) -> tuple[float, float]:
    """(compile seconds, seconds per token per sequence) for n matchers fed the document together."""
    start = time.perf_counter()
    compiled = engine.compile(SCHEMA)
    compile_s = time.perf_counter() - start
    matchers = engine.matchers(compiled, n)
    bitmask = engine.bitmask(n)
    start = time.perf_counter()
    for token in tokens:
        engine.step(matchers, bitmask, token, batched)
    return compile_s, (time.perf_counter() - start) / len(tokens) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "grammar_cpu.json"))
    args = p.parse_args()
    torch.set_num_threads(2)
    import tempfile

    from real_vocab import build_real_vocab_tokenizer

    from qwen3_scratch.text.token_bytes import vocab_bytes
    from qwen3_scratch.text.tokenizer import Tokenizer

    folder = build_real_vocab_tokenizer(Path(tempfile.mkdtemp()))
    tokenizer = Tokenizer.from_checkpoint(folder)
    vocab_size = 151936  # Qwen3's embedding rows
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    tokens = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":"))) + [eos[0]]  # compact, as both are told
    engines = [XGrammar(vocab_bytes(tokenizer, vocab_size), eos),
               LLGuidance(tokenizer.backend.to_str(), vocab_size, eos)]  # fmt: skip
    cases = [(1, False), (16, False), (16, True)]
    results = {e.name: {"tokenizer_setup_s": e.setup_s} for e in engines}
    samples = {(e.name, n, b): [] for e in engines for n, b in cases}
    compiles = {e.name: [] for e in engines}
    for _ in range(args.repeats):
        for engine in engines:  # alternated, so a noisy moment hits both
            for n, batched in cases:
                compile_s, per_token = run_once(engine, tokens, n, batched)
                samples[(engine.name, n, batched)].append(per_token)
                compiles[engine.name].append(compile_s)
    for (name, n, batched), values in samples.items():
        results[name][f"us_per_token_{n}{'_batched' if batched else ''}"] = 1e6 * statistics.median(values)
    for name, values in compiles.items():
        results[name]["schema_compile_ms"] = 1e3 * statistics.median(values)
    report = {"document_tokens": len(tokens), "vocab_size": vocab_size, "repeats": args.repeats, "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
