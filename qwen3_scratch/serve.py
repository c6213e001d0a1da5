"""`python -m qwen3_scratch.serve --model weights/tiny-qwen3` (or `qwen3-serve`): the OpenAI-compatible server.

Loads the checkpoint (LLM), starts the engine thread (AsyncEngine), serves the FastAPI app
(server.py) with uvicorn on 127.0.0.1:8000 unless told otherwise. Each flag maps to one parameter.
"""

import argparse
import sys

import uvicorn

from .async_engine import AsyncEngine
from .errors import Qwen3Error
from .llm import LLM
from .pipeline import DEFAULT_MODEL
from .server import build_app


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="qwen3-serve", description="Serve a Qwen3 checkpoint with OpenAI's HTTP API.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint folder or Hub id")
    p.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    p.add_argument("--weights-dir", default="weights", help="where Hub models are downloaded")
    p.add_argument("--local-files-only", action="store_true", help="never touch the network")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require `Authorization: Bearer <key>` on /v1 routes")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="memory for the paged KV pool")
    p.add_argument("--num-blocks", type=int, help="KV blocks in the pool (overrides --kv-cache-memory-gib)")
    p.add_argument("--block-size", type=int, default=16, help="token slots per KV block")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens computed per step at most")
    return p.parse_args(argv)


def load(args: argparse.Namespace) -> LLM:
    for flag in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise Qwen3Error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    return LLM(args.model, weights_dir=args.weights_dir, local_files_only=args.local_files_only, device=args.device,
               dtype=args.dtype, kv_cache_memory_gib=args.kv_cache_memory_gib, num_blocks=args.num_blocks,
               block_size=args.block_size, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        llm = load(args)
    except Qwen3Error as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    blocks = llm.engine.blocks
    print(f"KV pool: {blocks.num_blocks} blocks x {blocks.block_size} tokens = {blocks.num_blocks * blocks.block_size} "
          f"token slots (context {llm.engine.context})", file=sys.stderr)  # fmt: skip
    engine = AsyncEngine(llm.engine).start()
    app = build_app(engine, llm.tokenizer, args.served_model_name or args.model, llm.get_default_sampling_params(),
                    api_key=args.api_key)  # fmt: skip
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
