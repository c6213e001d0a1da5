"""`python -m qwen3_scratch.serve --model weights/tiny-qwen3` (or `qwen3-serve`): the OpenAI-compatible server.

Loads the checkpoint (LLM), starts the engine thread (AsyncEngine), serves the FastAPI app
(server/app.py) with uvicorn on 127.0.0.1:8000 unless told otherwise. An embedding checkpoint
(Qwen3-Embedding) is served at /v1/embeddings instead. Each flag maps to one parameter.
Like the other commands: bad input is one line on stderr and exit 2, Ctrl-C exits 130, quietly.
SIGTERM drains the server and exits 0; a dead engine (a step that raised, or ran past --step-timeout)
exits 1, for a supervisor to restart it (server/process.py).
"""

import argparse
import sys

from qwen3_scratch.errors import Qwen3Error
from qwen3_scratch.server.limits import BODY_TIMEOUT, MAX_BODY_BYTES  # plain numbers: no FastAPI needed yet
from qwen3_scratch.server.watchdog import DEFAULT_STEP_TIMEOUT

from .flags import OneLineParser, check_quantize_flags, loading, model_flags, quantize_flags, run_cli

PROG = "qwen3-serve"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Serve a Qwen3 checkpoint with OpenAI's HTTP API.")
    model_flags(p)
    quantize_flags(p)
    p.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="(default %(default)s)")
    p.add_argument("--api-key", help="require `Authorization: Bearer <key>` on /v1 routes (default: none)")
    p.add_argument("--kv-cache-memory-gib", type=float,
                   help="memory for the paged KV pool (default: 1 on a CPU; on a GPU what --gpu-memory-utilization leaves)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory weights, activations and KV pool may use, as vLLM's (default %(default)s)")
    p.add_argument("--num-blocks", type=int, help="KV blocks in the pool (default: from --kv-cache-memory-gib)")
    p.add_argument("--block-size", type=int, default=16, help="token slots per KV block (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests in the running batch at most (default %(default)s); 1 or 2 on a CPU runs the "
                        "CLI's one-row kernels, faster for one person's use")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens computed per step at most (default %(default)s)")  # fmt: skip
    p.add_argument("--speculative-config", metavar="JSON",
                   help="speculative decoding, as vLLM's: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 3, \"prompt_lookup_min\": 1}' (prompt lookup) or '{\"model\": "
                        "\"Qwen/Qwen3-0.6B\", \"num_speculative_tokens\": 4}' (a draft model with the same "
                        "tokenizer; default: none)")  # fmt: skip
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="queue each step before reading back the tokens of the step before, so that the host's "
                        "work overlaps the GPU's (default: on a GPU)")  # fmt: skip
    p.add_argument("--request-timeout", type=float,
                   help="seconds a request may take, arrival to last token; later it is aborted with 504 (default: none)")  # fmt: skip
    p.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT,
                   help="seconds one engine step may run; a step still running then means the engine hung: every "
                        "request fails, /health turns 503 and the server exits 1 (default %(default)s)")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="largest request body; larger ones get 413 unread (default %(default)s)")  # fmt: skip
    p.add_argument("--read-timeout", type=float, default=BODY_TIMEOUT,
                   help="seconds a client may take to send a request's headers, and again its body (default %(default)s)")  # fmt: skip
    p.add_argument("--shutdown-grace", type=float, default=20.0,
                   help="on SIGTERM, seconds requests in flight may take to finish before they are aborted (default %(default)s)")  # fmt: skip
    return p


def load(args: argparse.Namespace):
    """The LLM the flags describe (checked first, then loaded)."""
    check_quantize_flags(args)
    for flag in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_body_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise Qwen3Error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise Qwen3Error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    for flag in ("request_timeout", "read_timeout", "shutdown_grace", "step_timeout"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < float("inf"):
            raise Qwen3Error(f"--{flag.replace('_', '-')} must be a positive number of seconds, got {value}")
    from qwen3_scratch.engine.llm import LLM  # imports torch

    return LLM(args.model, weights_dir=args.weights_dir, local_files_only=args.local_files_only, device=args.device,
               dtype=args.dtype, revision=args.revision, verify=args.verify, quantize=args.quantize,
               quantize_group_size=args.quantize_group_size,
               kv_cache_memory_gib=args.kv_cache_memory_gib, gpu_memory_utilization=args.gpu_memory_utilization,
               num_blocks=args.num_blocks, block_size=args.block_size,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               tensor_parallel_size=args.tensor_parallel_size, speculative_config=args.speculative_config,
               async_scheduling=args.async_scheduling)  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    with loading():
        try:
            from qwen3_scratch.server.app import build_app
            from qwen3_scratch.server.process import serve as serve_app
            from qwen3_scratch.server.process import serve_without_engine
        except ImportError as error:
            raise Qwen3Error(f"the server needs FastAPI and uvicorn ({error}): pip install -e \".[serve]\"") from error
        from qwen3_scratch.server.async_engine import start_where_loaded

        # loaded on the engine's own thread, which then steps it (start_where_loaded says why)
        llm, engine = start_where_loaded(lambda: load(args), request_timeout=args.request_timeout,
                                         step_timeout=args.step_timeout)  # fmt: skip
    name = args.served_model_name or args.model
    llm.tokenizer.store_table()  # bpe.py's table of tokenizer.json, if it has none: stored once the server exits
    if llm.is_embedding_model:  # Qwen3-Embedding: /v1/embeddings only, no engine thread, no KV pool
        print("embedding checkpoint: serving /v1/embeddings", file=sys.stderr)
        app = build_app(None, llm.tokenizer, name, None, api_key=args.api_key, embedder=llm.embedder,
                        max_body_bytes=args.max_body_bytes, body_timeout=args.read_timeout)  # fmt: skip
        return serve_without_engine(app, args.host, args.port, args.read_timeout)
    blocks = llm.engine.blocks
    print(f"KV pool: {blocks.num_blocks} blocks x {blocks.block_size} tokens = {blocks.num_blocks * blocks.block_size} "
          f"token slots (context {llm.engine.context})", file=sys.stderr)  # fmt: skip
    app = build_app(engine, llm.tokenizer, args.served_model_name or args.model, llm.get_default_sampling_params(),
                    api_key=args.api_key, max_body_bytes=args.max_body_bytes, body_timeout=args.read_timeout)  # fmt: skip
    try:
        return serve_app(app, engine, args.host, args.port, args.read_timeout, args.shutdown_grace)
    finally:
        engine.stop()
        from qwen3_scratch.kernels.aot_build import start_background_build

        # the kernels compiled while serving (the in-place paged attention, at the first decode step), packaged
        # once the process has exited, so that the next start's first request does not compile them
        start_background_build()


def main(argv=None) -> int:
    return run_cli(PROG, build_parser(), serve, argv)
