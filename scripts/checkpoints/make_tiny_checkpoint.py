"""Write a tiny random Qwen3 checkpoint, laid out exactly like a Hub download.

    python scripts/checkpoints/make_tiny_checkpoint.py --out weights/tiny-qwen3
    python scripts/checkpoints/make_tiny_checkpoint.py --moe      # weights/tiny-qwen3-moe: a Qwen3-MoE (8 experts, 2 per token)

It needs only torch, safetensors, tokenizers and this package (not transformers), so a new user can try every
command of qwen3-scratch in seconds, with no download. The weights are random, so the text is
nonsense, but every file is in the Hub's format: a byte-level BPE `tokenizer.json` with Qwen3's
special tokens, `tokenizer_config.json` with a Qwen3-style chat template, a Hub-style `config.json`,
`generation_config.json` with Qwen3's sampling defaults, and bf16 weights split in shards with
`model.safetensors.index.json`.
"""

import argparse
import json
from pathlib import Path

from make_shape_checkpoint import generation_config, write_weights
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
CHAT_TEMPLATE_FILE = HERE / "qwen3_chat_template.jinja"

# Qwen3's control tokens, in Qwen3's order. The first three are special (dropped by
# `skip_special_tokens`); the think tags are plain added tokens, so decoding keeps them.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
# Qwen3's tool-call markup: plain added tokens too, appended after the think tags so their ids stay put.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen2/Qwen3's pre-tokenizer split: contractions, words with an optional leading symbol, single
# digits, runs of punctuation, newlines, spaces. transformers' Qwen2Tokenizer rebuilds its backend
# with exactly this split, so the tiny tokenizer uses it too or the two would disagree.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Enough varied text for ~1000 merges: English, Chinese, emoji and code, so common words and
# characters become single tokens while rarer characters stay split across byte tokens.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model reads tokens and predicts the next one.
Attention lets every token look back at the tokens before it; the cache keeps their keys and values.
Rotary position embeddings turn each pair of channels by an angle that grows with the position.
Grouped-query attention shares one key and value head between several query heads to save memory.
RMS normalization divides by the root mean square of the activations and then scales by a weight.
Sampling with temperature, top-k and top-p trades a little accuracy for a lot of variety.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Please summarize the following paragraph in one sentence, and then explain your reasoning.
Let me think step by step. First, we add the numbers. Then we check the answer twice.
The weather is lovely this morning, so we walked along the river and watched the boats.
人工智能正在改变世界。语言模型可以回答问题、写代码、翻译文章。
你好！今天天气很好，我们一起去公园散步吧。
请一步一步地思考，然后给出最终答案。我们先把问题分解成几个小问题。
注意力机制让每个词都能看到前面的词。模型越大，需要的内存就越多。
中文和英文混合的句子也很常见，比如 Qwen3 是一个开源的大语言模型。
I love pizza 🍕 and coffee ☕. Great job 👍! Let's celebrate 🎉🎉 with friends 😀😀.
Rockets 🚀 go up, hearts ❤️ are warm, the sun ☀️ shines, and stars ⭐ glow at night 🌙.
def greet(name: str) -> str:
    return f"Hello, {name}!"

for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

class Counter:
    def __init__(self):
        self.count = 0

    def add(self, amount=1):
        self.count += amount
        return self.count

x = torch.zeros(4, 8)
y = x.view(2, 16).transpose(0, 1).contiguous()
print(json.dumps({"name": "qwen3", "layers": 28, "heads": [16, 8]}, indent=2))
"""

# Small but complete: GQA (4 query heads share 2 kv heads) and head_dim 64 != hidden / heads (32), so
# q_proj widens 128 -> 256 like Qwen3 itself (0.6B: head_dim 128 with hidden 1024 and 16 heads, 1024 -> 2048).
SHAPES = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
)
# --moe: every layer routes each token to 2 of 8 experts of width 96, with 30B-A3B's settings otherwise
# (renormalised top-k, no dense layers, untied lm_head).
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
SHARD_BYTES = 500_000  # the tiny model is ~1.3 MB: a few shards plus model.safetensors.index.json


def train_tiny_tokenizer(vocab_size: int = 1024, corpus=None, added=THINK_TOKENS + TOOL_TOKENS) -> Tokenizer:
    """Train a Qwen-style byte-level BPE on `corpus` (lines of text; default the built-in one) and add
    Qwen3's control tokens: the three special ones, then `added` (plain added tokens) in that order.

    Training is deterministic, so every call returns the same tokenizer. The control tokens get
    the ids right after the trained vocabulary.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            # The regex above already split words; ByteLevel only maps bytes to printable symbols.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # All 256 byte symbols are in the alphabet, so any text (unseen characters too) can be encoded.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus if corpus is not None else CORPUS.splitlines(keepends=True), trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, chat_template: str) -> dict:
    """The `tokenizer_config.json` of a Qwen3 repo, with this tokenizer's ids."""
    added = {}
    for token in SPECIAL_TOKENS + THINK_TOKENS + TOOL_TOKENS:
        added[str(tokenizer.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": SHAPES["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def model_config(vocab_size: int, endoftext_id: int, im_end_id: int) -> dict:
    """The `config.json` of a Qwen3 repo, in the Hub's (transformers 4.5x) key names."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": endoftext_id,
        "eos_token_id": im_end_id,
        **SHAPES,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_window_layers": SHAPES["num_hidden_layers"],
        "model_type": "qwen3",
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1_000_000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def moe_model_config(config: dict) -> dict:
    """The dense tiny config.json turned into a Qwen3-MoE one, as Qwen3-30B-A3B's is laid out."""
    return {**config, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **MOE,
            "tie_word_embeddings": False, "output_router_logits": False, "router_aux_loss_coef": 0.001}  # fmt: skip


def make_tiny_checkpoint(out_dir="weights/tiny-qwen3", seed: int = 0, moe: bool = False) -> Path:
    """Write a complete tiny random Qwen3 (moe: Qwen3-MoE) checkpoint into `out_dir` and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer()
    endoftext_id = tokenizer.token_to_id("<|endoftext|>")
    im_end_id = tokenizer.token_to_id("<|im_end|>")
    # Round the embedding rows up to a multiple of 64, as Qwen3 does (151669 tokens, 151936 rows).
    vocab_size = -(-tokenizer.get_vocab_size(with_added_tokens=True) // 64) * 64
    config = model_config(vocab_size, endoftext_id, im_end_id)
    if moe:
        config = moe_model_config(config)

    tokenizer.save(str(out / "tokenizer.json"))
    chat_template = CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, chat_template))
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(config))
    # The same writer as the full-size shape checkpoints, with shards small enough that the Hub's
    # sharded layout (several files and an index) is what a new user sees.
    write_weights(out, config, seed, max_shard_bytes=SHARD_BYTES)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random Qwen3 checkpoint (no download).")
    parser.add_argument("--out", default=None, help="folder to write (default weights/tiny-qwen3[-moe])")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    parser.add_argument("--moe", action="store_true", help="a mixture-of-experts Qwen3-MoE (8 experts, 2 per token)")
    args = parser.parse_args(argv)
    out = args.out or ("weights/tiny-qwen3-moe" if args.moe else "weights/tiny-qwen3")
    out = make_tiny_checkpoint(out, seed=args.seed, moe=args.moe)
    print(f"wrote a tiny random Qwen3{'-MoE' if args.moe else ''} checkpoint to {out}")


if __name__ == "__main__":
    main()
