"""POST /v1/embeddings: OpenAI's embeddings API over an embedding checkpoint (engine/embedder.py).

Fields: `input` (a string, a list of strings, token ids or a list of them), `model`, `dimensions`
(Matryoshka: the first coordinates, normalised again), `encoding_format` ("float", or "base64": the
little-endian float32 bytes, which the `openai` SDK asks for by default and decodes itself), and
`user` (accepted: OpenAI's abuse-monitoring id; nothing reads it). Anything else is refused by name.

Embedding runs off the event loop, one batch at a time (a lock): the model is the server's only worker.
"""

import asyncio
import base64

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict

from .fields import RefusedField, accepted, implemented
from .schema import EMBEDDING_RESPONSES

EMBEDDINGS = {
    "input": implemented(["hello", "world"]),
    "model": implemented("tiny-embedding"),
    "dimensions": implemented(8),
    "encoding_format": implemented("base64"),
    "user": accepted("user-1", "an identifier for OpenAI's own abuse monitoring; nothing here reads it"),
}

router = APIRouter()
_lock = asyncio.Lock()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept so that an unknown field is refused by name

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = None
    encoding_format: str = "float"
    user: str | None = None

    def check_fields(self) -> None:
        for name in self.model_dump(exclude_unset=True):
            if name not in EMBEDDINGS:
                raise RefusedField(name, f"unknown field {name!r}: /v1/embeddings takes {', '.join(EMBEDDINGS)}")
        if self.encoding_format not in ("float", "base64"):
            raise RefusedField("encoding_format", "encoding_format must be 'float' or 'base64'")

    def inputs(self) -> list:
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


def encode(vector, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


@router.post("/v1/embeddings", responses=EMBEDDING_RESPONSES)
async def embeddings(body: EmbeddingRequest, request: Request):
    s = request.app.state.serving
    s.check_model(body.model)
    body.check_fields()
    if s.embedder is None:
        raise RefusedField("model", f"{s.model_name} is a generative model; serve an embedding checkpoint "
                                    "(Qwen3-Embedding) for /v1/embeddings")  # fmt: skip
    ids = [s.embedder.token_ids(x) if isinstance(x, str) else list(x) for x in body.inputs()]
    s.embedder.check(ids, body.dimensions)
    async with _lock:
        vectors = await run_in_threadpool(s.embedder.embed_ids, ids, body.dimensions)
    data = [{"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)]  # fmt: skip
    tokens = sum(len(x) for x in ids)
    return {"object": "list", "data": data, "model": s.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip
