"""Embeddings (Qwen3-Embedding): the headless checkpoint loads strictly, LLM.embed equals transformers' AutoModel
last-token embedding, and POST /v1/embeddings serves it to the real `openai` client (floats, base64, dimensions)."""

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers
from checkpoints import build_embedding_checkpoint
from make_tiny_checkpoint import make_tiny_checkpoint
from openai_server import serving

from qwen3_scratch import LLM, load_model
from qwen3_scratch.engine.embedder import format_query
from qwen3_scratch.errors import CheckpointError, GenerationError

TEXTS = ["The capital of France is Paris.", "KV caches keep keys and values.", format_query("Find the city", "Paris?")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tiny = make_tiny_checkpoint(tmp_path_factory.mktemp("embed-tok") / "tiny")
    return build_embedding_checkpoint(tmp_path_factory.mktemp("embed") / "tiny-embedding", tiny)


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), dtype="float32")


def reference(folder, texts):
    """The model card's recipe with transformers: left padding, AutoModel, last token, L2 normalised."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, padding_side="left")
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [end] for t in texts]
    batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (B, T, C)
    return F.normalize(hidden[:, -1], dim=-1)


def test_the_embedding_checkpoint_loads_headless_and_strict(folder, tmp_path):
    model = load_model(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"], "as Qwen's repos"
    assert model.lm_head is None
    with pytest.raises(ValueError, match="embedding checkpoint"):
        model(torch.tensor([[1, 2]]))
    with pytest.raises(CheckpointError, match="quantize"):
        load_model(folder, quantize="int8")


def test_llm_embed_equals_transformers_automodel_last_token(folder, llm):
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    theirs = reference(folder, TEXTS)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)))
    short = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, dimensions=16)])
    torch.testing.assert_close(short, F.normalize(theirs[:, :16], dim=-1), rtol=1e-5, atol=1e-5)


def test_an_embedding_model_does_not_generate(llm):
    with pytest.raises(GenerationError, match="embedding checkpoint"):
        llm.generate("hi")


def test_the_embeddings_route_serves_the_openai_client(folder, llm):
    theirs = reference(folder, TEXTS)
    with serving(None, "tiny-embedding", embedder=llm.embedder) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        floats = client.embeddings.create(model="tiny-embedding", input=TEXTS, encoding_format="float")
        assert [d.index for d in floats.data] == [0, 1, 2]
        torch.testing.assert_close(torch.tensor([d.embedding for d in floats.data]), theirs, rtol=1e-5, atol=1e-5)
        # with no encoding_format the SDK asks for base64 and decodes it
        default = client.embeddings.create(model="tiny-embedding", input=TEXTS[0], dimensions=8)
        torch.testing.assert_close(torch.tensor(default.data[0].embedding), F.normalize(theirs[0, :8], dim=0),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        raw = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny-embedding", "input": [[5, 6, 7]],
                                                       "encoding_format": "base64"}).json()  # fmt: skip
        vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32)
        assert vector.shape == (64,) and abs(np.linalg.norm(vector) - 1) < 1e-5 and raw["usage"]["prompt_tokens"] == 3
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model="tiny-embedding", input="x", dimensions=1000)
        assert info.value.param == "dimensions"
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny-embedding", prompt="x")
        assert "embedding" in info.value.message
