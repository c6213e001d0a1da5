"""The offline API over the engine, in vLLM's shape and names, so vLLM's snippets run unchanged:

    from qwen3_scratch import LLM, SamplingParams
    llm = LLM("Qwen/Qwen3-0.6B")
    outputs = llm.generate(["Hello, my name is", "The capital of France is"],
                           SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=0))
    for out in outputs:
        print(out.prompt, "->", out.outputs[0].text, out.outputs[0].finish_reason)
    chat = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=256))
    print(chat[0].outputs[0].message["reasoning_content"], chat[0].outputs[0].message["content"])

All prompts go to the engine at once; continuous batching runs them (engine.py). Sampling fields a
request leaves unset take the checkpoint's defaults (sampling/params.py), as on every other path.
"""

import itertools
from dataclasses import dataclass, field, replace

import torch

from qwen3_scratch.checkpoint.hub import resolve_checkpoint
from qwen3_scratch.checkpoint.placement import pick_device, pick_dtype
from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.errors import GenerationError
from qwen3_scratch.model.kv_cache import kv_cache_bytes
from qwen3_scratch.parallel.model import load_parallel_model
from qwen3_scratch.sampling.defaults import load_generation_config, stop_token_ids
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.chat_parser import END_THINK, prompt_opens_thinking
from qwen3_scratch.text.stop import AnswerStop
from qwen3_scratch.text.tokenizer import Tokenizer

from .embedder import Embedder, EmbeddingOutput, EmbeddingRequestOutput
from .engine import LLMEngine
from .draft_proposer import load_draft
from .speculative_config import SpeculativeConfig

GIB = 2**30


@dataclass
class Logprob:
    """vLLM's: one token's log-probability, its rank among all tokens (1 = likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, a stop string or stop token) or "length"
    message: dict | None = None  # chat only: the parsed assistant message (content, reasoning, tool calls)
    # with SamplingParams(logprobs=k): per token, {id: Logprob} for the token drawn and the top k
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)  # one per choice (SamplingParams.n), by index
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with prompt_logprobs=k; None for token 0


def as_vllm_logprobs(scored, tokenizer: Tokenizer) -> dict[int, Logprob] | None:
    """A sampling.logprobs.TokenLogprob -> vLLM's {id: Logprob}: the token taken, then its top alternatives."""
    if scored is None:
        return None
    out = {scored.token_id: Logprob(scored.logprob, scored.rank, tokenizer.decode([scored.token_id]))}
    for rank, (token_id, logprob) in enumerate(scored.top, start=1):
        out.setdefault(token_id, Logprob(logprob, rank, tokenizer.decode([token_id])))
    return out


def default_num_blocks(config, dtype_bytes: int, block_size: int, memory_gib: float, max_num_seqs: int,
                       draft_config=None) -> int:  # fmt: skip
    """Blocks that fit in memory_gib, but no more than max_num_seqs full contexts need. draft_config: a draft
    model's, whose pool has as many blocks (engine/draft_proposer.py), so each block costs both."""
    per_block = sum(kv_cache_bytes(c, block_size, bytes_per_value=dtype_bytes) for c in (config, draft_config) if c)
    by_memory = int(memory_gib * GIB) // per_block
    by_use = max_num_seqs * -(-config.max_position_embeddings // block_size)
    return max(1, min(by_memory, by_use))


def gpu_kv_memory_gib(config, device, utilization: float, max_num_batched_tokens: int, dtype_bytes: int) -> float:
    """GiB for the KV pool on a GPU, vLLM's rule: the pool takes what is left of `utilization` x the card
    once the weights (already loaded) and anything else on it are counted, less room for one step's activations
    (its widest tensors: the MLP's gate/up/product over the step's tokens, and fp32 logits of as many rows)."""
    if not 0 < utilization <= 1:
        raise GenerationError(f"gpu_memory_utilization must be in (0, 1], not {utilization}")
    free, total = torch.cuda.mem_get_info(device)
    activations = max_num_batched_tokens * (3 * config.intermediate_size * dtype_bytes + config.vocab_size * 4)
    budget = utilization * total - (total - free) - 2 * activations
    if budget <= 0:
        raise GenerationError(f"no GPU memory left for the KV pool at gpu_memory_utilization={utilization} "
                              f"({free / GIB:.1f} GiB free of {total / GIB:.1f}); raise it or free the GPU")
    return budget / GIB


# Most rows a CPU engine's step has where the one-row layout is the faster one (engine_layout).
ONE_ROW_LAYOUT_MAX_SEQS = 2


def engine_layout(device: torch.device, max_num_seqs: int, tensor_parallel_size: int = 1) -> str:
    """The model's layout for the engine (kernels/layout.py): "batch" (q/k/v and gate/up fused, every matrix
    reordered for oneDNN, whose products are fastest once a step has many rows), except on a CPU serving at
    most ONE_ROW_LAYOUT_MAX_SEQS requests at a time (a person's own server): "decode", the CLI's one-row kernels
    over the checkpoint's own mapped matrices. There, 0.6B shapes, bf16, AMD EPYC, 2 threads, a decode step at
    1 / 2 / 4 / 16 rows took 55 / 66 / 78 / 205 ms against 71-88 / 86 / 79 / 127 with "batch", prefill as fast,
    1.9 GB of memory against 3.1 (docs/performance.md). The tokens are the same either way (float rounding)."""
    one_row = device.type == "cpu" and max_num_seqs <= ONE_ROW_LAYOUT_MAX_SEQS and tensor_parallel_size == 1
    return "decode" if one_row else "batch"


class LLM:
    def __init__(
        self,
        model: str,
        *,
        weights_dir="weights",
        local_files_only: bool = False,
        revision: str | None = None,
        verify: bool = False,
        device: str = "auto",
        dtype: str = "auto",
        quantize: str | None = None,
        quantize_group_size: int | None = None,
        kv_cache_memory_gib: float | None = None,
        gpu_memory_utilization: float = 0.9,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        tensor_parallel_size: int = 1,
        speculative_config: dict | str | None = None,
        async_scheduling: bool | None = None,
    ):
        speculative_config = SpeculativeConfig.parse(speculative_config)  # refused before anything loads
        self.checkpoint = resolve_checkpoint(model, weights_dir, local_files_only=local_files_only, revision=revision,
                                             verify=verify)  # fmt: skip
        device = pick_device(device)
        # Laid out for batches (engine_layout), quantized to "int8" or "int4" (kernels/quantize.py,
        # kernels/int4.py) now. tensor_parallel_size > 1: split over that many processes (parallel/); the KV pool
        # is then per rank.
        optimize = engine_layout(torch.device(device), max_num_seqs, tensor_parallel_size)
        layout = dict(optimize=optimize, quantize=quantize, quantize_group_size=quantize_group_size)
        dtype = pick_dtype(dtype, device, quantize, optimize)
        if tensor_parallel_size != 1:  # (0 or -1 are refused there, in one line)
            self.model = load_parallel_model(self.checkpoint, tensor_parallel_size, device, dtype, **layout)
        else:
            self.model = load_model(self.checkpoint, device=device, dtype=dtype, **layout)
        self.tokenizer = Tokenizer.from_checkpoint(self.checkpoint)
        draft = None
        if speculative_config is not None and speculative_config.method == "draft_model":  # same placement, unquantized
            draft = load_draft(speculative_config.model, self.model, self.tokenizer, weights_dir=weights_dir,
                               local_files_only=local_files_only)
        self.generation_config = load_generation_config(self.checkpoint)
        self.embedder = Embedder(self.model, self.tokenizer)
        self._ids = itertools.count()
        self.engine: LLMEngine | None = None
        if self.model.lm_head is None:  # an embedding checkpoint (Qwen3-Embedding): embed() only, no KV pool
            return
        if num_blocks is None:  # kv_cache_memory_gib, else on a GPU what gpu_memory_utilization leaves, else 1 GiB
            dtype_bytes = self.model.activation_dtype.itemsize
            if kv_cache_memory_gib is None:
                kv_cache_memory_gib = 1.0
                if self.model.device.type == "cuda":
                    kv_cache_memory_gib = gpu_kv_memory_gib(self.model.config, self.model.device,
                                                            gpu_memory_utilization, max_num_batched_tokens,
                                                            dtype_bytes)  # fmt: skip
            num_blocks = default_num_blocks(self.model.config, dtype_bytes, block_size, kv_cache_memory_gib,
                                            max_num_seqs, draft.config if draft is not None else None)  # fmt: skip
        self.engine = LLMEngine(
            self.model, self.tokenizer, self.eos_ids, num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
            speculative_config, draft, async_scheduling,
        )

    @property
    def is_embedding_model(self) -> bool:
        return self.engine is None

    def embed(self, prompts, *, dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """One unit-length embedding per prompt (str, list of str, or token-id lists), in order; dimensions
        keeps the first coordinates (Matryoshka) and normalises again. Queries: wrap them with
        engine.embedder.format_query(task, query) first, as Qwen3-Embedding's card says."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.embedder.token_ids(p) if isinstance(p, str) else list(p) for p in prompts]
        vectors = self.embedder.embed_ids(ids, dimensions)
        return [EmbeddingRequestOutput(i, EmbeddingOutput(v.tolist())) for i, v in zip(ids, vectors)]

    @property
    def eos_ids(self) -> list[int]:
        return stop_token_ids(self.generation_config, self.model.config.eos_token_ids, self.tokenizer.eos_token_id)

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling defaults, as vLLM's LLM uses them."""
        return SamplingParams().with_defaults(self.generation_config)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. prompts: str, list of str, or list of token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = [(p, p, self.tokenizer.encode(p)) if isinstance(p, str) else (p, None, list(p)) for p in prompts]
        return self._run([(text, ids) for _, text, ids in requests], sampling_params)

    def chat(self, messages, sampling_params=None, *, tools=None, enable_thinking: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:  # fmt: skip
        """One RequestOutput per conversation; outputs[0].message holds the parsed reply (reasoning apart,
        tool calls parsed), outputs[0].text the raw text. messages: one list of dicts, or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.chat_ids(m, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                                    tools=tools)  # fmt: skip
            for m in conversations
        ]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if enable_thinking:
            params = [self._grammar_after_reasoning(p) for p in params]
        outputs = self._run([(None, ids) for ids in prompts], params)
        for out, p in zip(outputs, params):
            after = p is not None and p.structured_outputs is not None and p.structured_outputs.reasoning_end_str
            thinking = bool(after) or prompt_opens_thinking(out.prompt_token_ids, self.tokenizer)
            for completion in out.outputs:
                # the answer ends before a stop string
                completion.message = AnswerStop.reply(self.tokenizer, completion.token_ids, thinking,
                                                      p.stop if p else [], p.min_tokens if p else 0)  # fmt: skip
        return outputs

    def _grammar_after_reasoning(self, params: SamplingParams | None) -> SamplingParams | None:
        """A chat that thinks first: its grammar, if any, starts after </think> (sampling/after_reasoning.py),
        as the server's does."""
        spec = params.structured_outputs if params is not None else None
        if spec is None or spec.reasoning_end_str is not None or self.tokenizer.token_to_id(END_THINK) is None:
            return params
        return replace(params, structured_outputs=replace(spec, reasoning_end_str=END_THINK))

    def _run(self, prompts: list[tuple[str | None, list[int]]], sampling_params) -> list[RequestOutput]:
        if self.engine is None:
            raise GenerationError(f"{self.checkpoint} is an embedding checkpoint (no lm_head): it can embed "
                                  "(LLM.embed, /v1/embeddings), not generate")  # fmt: skip
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        params = [(p or SamplingParams()).with_defaults(self.generation_config) for p in params]
        outputs: dict[str, RequestOutput] = {}
        for (text, ids), p in zip(prompts, params):
            request_id = str(next(self._ids))
            outputs[request_id] = RequestOutput(request_id, text, ids)
            self.engine.check_prompt(ids, p)  # every request checked before any runs
        for request_id, p in zip(outputs, params):
            self.engine.add_request(request_id, outputs[request_id].prompt_token_ids, p)
        texts = {(request_id, i): "" for request_id, p in zip(outputs, params) for i in range(p.n)}
        while self.engine.has_unfinished():
            for step in self.engine.step():
                if step.error is not None:  # a fault of this request's own: say so rather than return less
                    for request_id in outputs:
                        self.engine.abort(request_id)
                    raise step.error
                texts[(step.request_id, step.index)] += step.new_text
                if step.finished:
                    self._finished(outputs[step.request_id], step, texts[(step.request_id, step.index)])
        for out in outputs.values():
            out.outputs.sort(key=lambda c: c.index)
        return list(outputs.values())

    def _finished(self, out: RequestOutput, step, text: str) -> None:
        """One choice of `out` is done: add its CompletionOutput (and, the first time, the prompt's logprobs)."""
        seq = step.seq
        completion = CompletionOutput(step.index, text, seq.output_ids, step.finish_reason)
        if seq.params.logprobs is not None:
            completion.logprobs = [as_vllm_logprobs(lp, self.tokenizer) for lp in seq.sampling.logprobs]
            completion.cumulative_logprob = sum(lp.logprob for lp in seq.sampling.logprobs)
        if seq.params.prompt_logprobs is not None and out.prompt_logprobs is None:
            out.prompt_logprobs = [as_vllm_logprobs(lp, self.tokenizer) for lp in seq.sampling.prompt_logprobs]
        out.outputs.append(completion)
        out.num_cached_tokens = max(out.num_cached_tokens, seq.num_cached_prompt)
        out.finished = len(out.outputs) == seq.params.n
