"""Train a tiny Qwen3 from scratch on this CPU, in minutes: a checkpoint that really answers.

    python scripts/tiny/train_tiny.py                        # -> weights/tiny-qwen3-trained and weights/tiny-qwen3-trained-draft
    python scripts/tiny/train_tiny.py --minutes 0.5 --out /tmp/tiny --no-draft

The model is the project's own `Qwen3` class, saved in the Hub's layout (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with the chat template), so every command of the
package and `transformers` load it. The data is made here, offline (tiny_corpus.py, tiny_tasks.py): exercises
in Qwen3's chat format with their working inside <think>, some with thinking off, calculator episodes with
<tool_call> and <tool_response>, and the Python standard library's own text. The tokenizer is a byte-level
BPE trained on that data with make_tiny_checkpoint.py's recipe, Qwen3's control tokens in Qwen3's order.

--minutes is a budget in this CPU's minutes, turned into a number of steps at the speed measured for each
model on the 2-core AMD EPYC (docs/performance.md), so a run is the same for the same seed and thread count
wherever it runs (a faster CPU ends sooner). The draft (fewer layers, same tokenizer, for speculative
decoding) trains the same way after the target, on a share of the budget. training_log.json in each folder
keeps the recipe, the loss curve and the time taken.
"""

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for folder in (ROOT, HERE, ROOT / "scripts" / "checkpoints"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from make_shape_checkpoint import generation_config  # noqa: E402
from make_tiny_checkpoint import (  # noqa: E402
    CHAT_TEMPLATE_FILE,
    SPECIAL_TOKENS,
    model_config,
    tokenizer_config,
    train_tiny_tokenizer,
    write_json,
)
from tiny_corpus import CHAT_MIX, TEXT_SHARE, Packer, chat_documents, text_pieces  # noqa: E402

from qwen3_scratch.kernels.widen import cpu_has_native_bf16  # noqa: E402
from qwen3_scratch.model.config import Qwen3Config  # noqa: E402
from qwen3_scratch.model.qwen3 import Qwen3  # noqa: E402
from qwen3_scratch.text.tokenizer import Tokenizer  # noqa: E402

# Qwen3's own order of its control tokens (ids 151643.. in the real vocabulary, less the vision and FIM ones).
QWEN3_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
VOCAB = 2048  # trained BPE tokens; the 9 control tokens follow, and the embedding rounds up to a multiple of 64
# 2 layers (reading a digit by its place needs two): in five minutes twice the steps of 4 layers, and the better
# model of the two under the AdamW recipe (held-out conversions 60% / 53% against 43% / 53%, text perplexity 143
# against 268; docs/performance-history.md).
TARGET = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)  # fmt: skip
DRAFT = dict(TARGET, num_hidden_layers=1)
# Tokens per second of training on the 2-core EPYC under the lock, a little under what the probes and the default
# run measured (Muon's orthogonalisation costs ~15% of AdamW's speed, docs/performance.md) so that a run with a
# neighbour still fits: --minutes -> steps.
MEASURED_TOKENS_PER_SECOND = {"target": 8_600, "draft": 12_500}
# bf16 matmuls (fp32 weights and optimizer) where the CPU multiplies bf16 in hardware: 2.2x the tokens/s of fp32 at
# this size on the EPYC (Zen 4). A CPU with AVX2 only has no bf16 kernel in oneDNN, and torch's fallback loop runs a
# bf16 product ~40x slower than fp32 (1.3 against 53 GFLOP/s on an EPYC Zen 3): there the whole step runs in fp32.
NATIVE_BF16 = cpu_has_native_bf16()
AUTOCAST = NATIVE_BF16
SEQ_LEN, BATCH = 512, 4
# Peak LR 3e-3, for Muon too (its updates scaled to AdamW's size): Muon at 6e-3 got held-out add 40% against 83%.
LR, MIN_LR_RATIO, WARMUP, WEIGHT_DECAY = 3e-3, 0.1, 50, 0.1
# One vectorised kernel over all the parameters instead of ~10 small ones per parameter tensor: 0.31 s against
# 1.2 s per optimizer step with another job on the second core (docs/performance-history.md).
FUSED_ADAMW = True
# The norms' weights (1.0 at the start) move by about the LR each step under Adam, like the matrices' entries
# (0.02 at the start): relatively, a hundred times slower. q_norm and k_norm set how sharp attention can get.
NORM_LR_SCALE = 10.0  # x1 -> x10: held-out add loss 0.86 -> 0.82, convert 0.87 -> 0.79 after 250 steps; x30 no better
DRAFT_SHARE = 0.15  # of --minutes, after the fixed costs
FIXED_SECONDS = 12  # of --minutes: imports, the tokenizer (~3 s), saving two checkpoints
ROPE_THETA = 10_000.0


def corpus_for_bpe(template: str, seed: int, chats: int = 3000, text_chars: int = 1_500_000):
    """Lines to train the BPE on: rendered chat turns and standard-library text, control tokens removed."""
    import random

    from qwen3_scratch.text.chat_template import render_chat_template

    class Renderer:  # what chat_documents needs of a tokenizer while none exists yet: the template, as text
        def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=True, tools=None):
            return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                        enable_thinking=enable_thinking, tools=tools)  # fmt: skip

        def encode(self, text, split_special_tokens=False):
            self.texts.append(text)
            return [0] * len(text)

    renderer, rng = Renderer(), random.Random(seed)
    renderer.texts = []
    for _ in range(chats):
        chat_documents(renderer, rng)
    lines, size = [], 0
    for piece in text_pieces():
        lines.append(piece)
        size += len(piece)
        if size >= text_chars:
            break
    for text in renderer.texts:
        for token in SPECIAL_TOKENS + QWEN3_ADDED:
            text = text.replace(token, "\n")
        lines.append(text)
    return lines


def build_tokenizer(seed: int) -> Tokenizer:
    template = CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    backend = train_tiny_tokenizer(VOCAB, corpus_for_bpe(template, seed), added=QWEN3_ADDED)
    config = tokenizer_config(backend, template)
    return Tokenizer(backend, {**config, "model_max_length": TARGET["max_position_embeddings"]}, template)


def config_for(shapes: dict, tokenizer: Tokenizer) -> dict:
    """config.json: the tiny checkpoint's Hub-style config with these shapes and this vocabulary."""
    vocab_size = -(-tokenizer.vocab_size // 64) * 64
    ids = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    return {**model_config(vocab_size, *ids), **shapes, "max_window_layers": shapes["num_hidden_layers"],
            "rope_theta": ROPE_THETA}


def new_model(config: dict, seed: int) -> Qwen3:
    """Qwen3 with transformers' initialisation (N(0, 0.02), norms 1), the output projections scaled down by
    sqrt(2 x layers) as GPT-2 does, so the residual stream starts at the same size however deep."""
    torch.manual_seed(seed)
    model = Qwen3(Qwen3Config.from_dict(config))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(param)
        else:
            std = 0.02 / math.sqrt(2 * config["num_hidden_layers"]) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(param, 0.0, std)
    return model.train()


def logits_with_grad(model: Qwen3, batch) -> torch.Tensor:
    """Qwen3.forward is an inference function (@torch.no_grad); training calls the same code undecorated."""
    return Qwen3.forward.__wrapped__(model, batch.ids, position_ids=batch.positions, mask=batch.mask)  # (B, T, V)


def token_losses(model: Qwen3, batch, autocast: bool) -> torch.Tensor:
    """The next-token loss at every position (B, T), 0 where nothing is trained."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = logits_with_grad(model, batch)
    losses = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=-100, reduction="none")
    return losses.view(batch.targets.shape)


def mean_where(losses: torch.Tensor, where: torch.Tensor) -> float:
    return round((losses * where).sum().item() / max(1, int(where.sum())), 4)


def learning_rate(step: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_RATIO of the peak."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def orthogonalise_in_fp32(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """torch's Muon orthogonalisation (a quintic Newton-Schulz iteration), its products in fp32 and each result
    rounded to bf16 as torch's own bf16 iteration rounds it: the same update to within a bf16 rounding, at fp32's
    speed on a CPU without bf16 kernels (4 s of a 5 s step in bf16 there, 0.1 s in fp32)."""
    a, b, c = ns_coefficients

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.bfloat16().float()

    x = rounded(grad.T if grad.size(0) > grad.size(1) else grad)
    x = rounded(x / rounded(x.norm()).clamp(min=eps))
    for _ in range(ns_steps):
        gram = rounded(x @ x.T)
        gram = rounded(torch.addmm(gram, gram, gram, beta=b, alpha=c))
        x = rounded(torch.addmm(x, gram, x, beta=a))
    return x.T if grad.size(0) > grad.size(1) else x


class Fp32Muon(torch.optim.Muon):
    """torch.optim.Muon with orthogonalise_in_fp32 in place of its bf16 iteration, which torch offers no setting
    for: swapped in for the length of each step only."""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim import _muon  # where Muon's step looks the iteration up

        original, _muon._zeropower_via_newtonschulz = _muon._zeropower_via_newtonschulz, orthogonalise_in_fp32
        try:
            return super().step(closure)
        finally:
            _muon._zeropower_via_newtonschulz = original


def optimizers_for(model: Qwen3) -> list[torch.optim.Optimizer]:
    """Muon for the layers' matrices (their updates orthogonalised, every direction moving at once), AdamW for
    the embedding (the tied head) and the norms, as Muon's authors use it. Each group's `lr_scale` times the
    schedule's LR is its learning rate."""
    layers = [p for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n]
    embedding = [p for n, p in model.named_parameters() if p.dim() == 2 and ".layers." not in n]
    vectors = [p for n, p in model.named_parameters() if p.dim() < 2]  # norms: no weight decay
    # match_rms_adamw scales each update to the size AdamW's would have, so one LR serves both.
    muon = (torch.optim.Muon if NATIVE_BF16 else Fp32Muon)([{"params": layers, "lr_scale": 1.0}], lr=LR,
                                                        weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw")
    groups = [{"params": embedding, "weight_decay": WEIGHT_DECAY, "lr_scale": 1.0},
              {"params": vectors, "weight_decay": 0.0, "lr_scale": NORM_LR_SCALE}]  # fmt: skip
    return [muon, torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=FUSED_ADAMW)]


def train(model: Qwen3, tokenizer: Tokenizer, steps: int, seed: int, name: str, autocast: bool = AUTOCAST,
          mix: dict[str, float] | None = None) -> dict:
    """Train for `steps` steps of BATCH x SEQ_LEN tokens on `mix` (default tiny_corpus.CHAT_MIX); returns the
    log (loss per step, time, speed)."""
    packer, optimizers = Packer(tokenizer, seed, SEQ_LEN, mix), optimizers_for(model)
    losses, chat_losses, text_losses, trained_tokens, data_seconds, start = [], [], [], 0, 0.0, time.perf_counter()
    bar = tqdm(range(steps), desc=f"training {name}", unit="step", dynamic_ncols=True, mininterval=1.0)
    for step in bar:
        data_start = time.perf_counter()
        batch = packer.batch(BATCH)
        data_seconds += time.perf_counter() - data_start
        for group in (group for optimizer in optimizers for group in optimizer.param_groups):
            group["lr"] = learning_rate(step, steps) * group["lr_scale"]
        losses_now = token_losses(model, batch, autocast)
        trained = batch.targets >= 0
        loss = losses_now.sum() / trained.sum()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
        losses.append(round(loss.item(), 4))
        chat_losses.append(mean_where(losses_now.detach(), trained & ~batch.is_text))
        text_losses.append(mean_where(losses_now.detach(), trained & batch.is_text))
        trained_tokens += int(trained.sum())
        elapsed = time.perf_counter() - start
        bar.set_postfix(chat=f"{chat_losses[-1]:.3f}", text=f"{text_losses[-1]:.2f}",
                        tok_s=f"{(step + 1) * BATCH * SEQ_LEN / elapsed:,.0f}")  # fmt: skip
    elapsed = time.perf_counter() - start
    return {"steps": steps, "batch": BATCH, "seq_len": SEQ_LEN, "tokens": steps * BATCH * SEQ_LEN,
            "trained_tokens": trained_tokens, "seconds": round(elapsed, 1), "data_seconds": round(data_seconds, 1),
            "tokens_per_second": round(steps * BATCH * SEQ_LEN / elapsed), "loss": losses, "chat_loss": chat_losses,
            "text_loss": text_losses}  # fmt: skip


def save_checkpoint(out: Path, model: Qwen3, tokenizer: Tokenizer, config: dict, log: dict) -> Path:
    """The Hub's layout, bf16 weights as Qwen3 ships them; a tied lm_head is not stored (save_pretrained's way)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
               if not (config["tie_word_embeddings"] and name == "lm_head.weight")}  # fmt: skip
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.backend.save(str(out / "tokenizer.json"))
    template = tokenizer.chat_template
    write_json(out / "tokenizer_config.json", {**tokenizer_config(tokenizer.backend, template),
                                               "model_max_length": config["max_position_embeddings"]})  # fmt: skip
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(config))
    write_json(out / "training_log.json", log)
    return out


def steps_for(minutes: float, kind: str, share: float = 1.0) -> int:
    """Steps that `share` of a budget of `minutes` buys at this CPU's measured speed, after the fixed costs."""
    seconds = max(0.0, minutes * 60 - FIXED_SECONDS) * share
    return max(1, round(seconds * MEASURED_TOKENS_PER_SECOND[kind] / (BATCH * SEQ_LEN)))


def train_checkpoint(out, shapes: dict, tokenizer: Tokenizer, steps: int, seed: int, name: str,
                     mix: dict[str, float] | None = None) -> Path:
    config = config_for(shapes, tokenizer)
    model = new_model(config, seed)
    log = train(model, tokenizer, steps, seed, name, mix=mix)
    log = {"recipe": {"shapes": shapes, "seed": seed, "lr": LR, "warmup": WARMUP, "min_lr_ratio": MIN_LR_RATIO,
                      "weight_decay": WEIGHT_DECAY, "optimizer": "Muon (layers, match_rms_adamw) + AdamW(0.9, 0.95)",
                      "norm_lr_scale": NORM_LR_SCALE,
                      "chat_mix": mix or CHAT_MIX, "text_share": TEXT_SHARE,
                      "dtype": "float32 weights, bf16 autocast" if AUTOCAST else "float32"},
           "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
           "parameters": sum(p.numel() for p in model.parameters()), **log}  # fmt: skip
    return save_checkpoint(Path(out), model.eval(), tokenizer, config, log)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Train a tiny Qwen3 on this CPU in minutes (data made offline).")
    p.add_argument("--out", default="weights/tiny-qwen3-trained", help="checkpoint folder (default %(default)s)")
    p.add_argument("--draft-out", default=None, help="the draft's folder (default: OUT-draft)")
    p.add_argument("--minutes", type=float, default=5.0, help="budget in this CPU's minutes, draft included (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed for the data, the tokenizer's corpus and the weights (default %(default)s)")
    p.add_argument("--no-draft", action="store_true", help="train the target only (default: both)")
    p.add_argument("--steps", type=int, default=None, help="the target's steps, instead of --minutes (default: from --minutes)")
    args = p.parse_args(argv)
    if not args.minutes > 0:
        p.error(f"--minutes must be > 0, got {args.minutes}")
    start = time.perf_counter()
    tokenizer = build_tokenizer(args.seed)
    print(f"tokenizer: {tokenizer.vocab_size} tokens ({time.perf_counter() - start:.1f} s)")
    steps = args.steps or steps_for(args.minutes, "target", 1 if args.no_draft else 1 - DRAFT_SHARE)
    out = train_checkpoint(args.out, TARGET, tokenizer, steps, args.seed, "target")
    print(f"wrote {out}")
    if not args.no_draft:
        draft = train_checkpoint(args.draft_out or f"{args.out}-draft", DRAFT, tokenizer,
                                 steps_for(args.minutes, "draft", DRAFT_SHARE), args.seed, "draft")  # fmt: skip
        print(f"wrote {draft}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
