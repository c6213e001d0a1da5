"""One `SamplingParams` for every way in: one table of limits, the checkpoint's defaults for what a request
leaves unset, and every field honoured by Pipeline as by the engine (stop strings, stop ids, EOS)."""

import dataclasses
import subprocess
import sys
import warnings

import pytest
from make_tiny_checkpoint import make_tiny_checkpoint

import qwen3_scratch
from qwen3_scratch import LLM, Pipeline, SamplingParams
from qwen3_scratch.checkpoint.placement import DTYPE_HELP
from qwen3_scratch.errors import GenerationError
from qwen3_scratch.sampling.logits import LogitsFilter
from qwen3_scratch.sampling.params import FIELD_CHECKS, MAX_SEED

QWEN3_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True}


def test_every_field_has_a_rule_in_the_table_of_limits():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == set(FIELD_CHECKS), f"fields without a rule: {fields - set(FIELD_CHECKS)}"


@pytest.mark.parametrize(
    "field, value",
    [("seed", 2**70), ("seed", -1), ("seed", MAX_SEED + 1), ("seed", 1.5), ("max_tokens", 0), ("max_tokens", True),
     ("temperature", float("nan")), ("top_k", -2), ("stop", [""]), ("stop_token_ids", [-1]),
     ("stop_token_ids", [2**40]), ("ignore_eos", "yes")],
)  # fmt: skip
def test_values_outside_the_limits_are_refused_naming_the_field(field, value):
    with pytest.raises(GenerationError, match=f"^{field} must be") as info:
        SamplingParams(**{field: value})
    assert "\n" not in str(info.value)


def test_the_largest_seed_torch_takes_is_allowed():
    assert SamplingParams(seed=MAX_SEED).seed == MAX_SEED


def test_vllm_spellings_are_normalised():
    params = SamplingParams(top_k=-1, stop="###")
    assert params.top_k == 0 and params.stop == ["###"]


def test_unset_fields_take_the_checkpoint_defaults_and_given_ones_win():
    params = SamplingParams(top_p=0.5).with_defaults(QWEN3_DEFAULTS)
    assert params.logits_filter == LogitsFilter(temperature=0.6, top_k=20, top_p=0.5)
    assert SamplingParams().with_defaults({}).logits_filter == LogitsFilter(), "no file: vLLM's defaults"
    assert SamplingParams().with_defaults({"do_sample": False, "temperature": 0.7}).greedy


def test_the_old_names_still_work_one_release_and_warn_once():
    qwen3_scratch._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        request_params = qwen3_scratch.RequestParams
        request = qwen3_scratch.GenerationRequest(max_new_tokens=5, temperature=0)
        qwen3_scratch.RequestParams  # noqa: B018 (the second use stays quiet)
    assert request_params is SamplingParams and request == SamplingParams(max_tokens=5, temperature=0)
    assert [str(w.message).split(" is ")[0] for w in caught] == [
        "qwen3_scratch.RequestParams", "qwen3_scratch.GenerationRequest"]  # fmt: skip
    with pytest.raises(TypeError, match="Pipeline.load"):
        qwen3_scratch.GenerationRequest(use_cache=False)


def test_the_public_names_import_from_the_package():
    code = "from qwen3_scratch import load_model, Pipeline, LLM, SamplingParams, Tokenizer; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_command_says_the_same_dtype_rule(command):
    done = subprocess.run([sys.executable, "-m", f"qwen3_scratch.{command}", "--help"], capture_output=True,
                          text=True, timeout=60, env={"COLUMNS": "1000", "PATH": ""})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert DTYPE_HELP in done.stdout, done.stdout


# -- Pipeline honours every field, as the engine does --------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("params") / "tiny-qwen3")


@pytest.fixture(scope="module")
def pipe(tiny):
    return Pipeline.load(str(tiny), device="cpu", dtype="float32")


FREE = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_a_stop_string_ends_the_text_before_it_as_the_engine_does(pipe, tiny):
    whole = "".join(pipe.stream("Hello", FREE, chat=False))
    stop = whole[8:11]  # something the greedy text is sure to say
    params = dataclasses.replace(FREE, stop=[stop])
    cut = "".join(pipe.stream("Hello", params, chat=False))
    assert cut == whole[: whole.index(stop)]
    assert pipe.last_stats.generated_tokens < 24, "generation stops at the stop string, not at max_tokens"
    assert pipe.generate(["Hello", "Hello"], params, chat=False) == [cut, cut]
    engine = LLM(str(tiny), device="cpu", dtype="float32").generate(pipe.tokenizer.encode("Hello"), params)
    assert engine[0].outputs[0].text == cut, "the engine and the simple loop cut at the same place"


def test_stop_token_ids_end_a_row_and_ignore_eos_keeps_them(pipe):
    ids = [t for row in pipe.stream_ids([pipe.tokenizer.encode("Hello")], FREE) for t in row]
    stopper = ids[5]
    params = dataclasses.replace(FREE, stop_token_ids=[stopper])
    stopped = [t for row in pipe.stream_ids([pipe.tokenizer.encode("Hello")], params) for t in row]
    assert stopped == ids[: ids.index(stopper) + 1], "the stop id is the last token, as EOS would be"


def test_unset_sampling_fields_use_the_checkpoint_defaults_in_pipeline(pipe):
    assert pipe.resolve(SamplingParams(seed=1)).logits_filter == SamplingParams().with_defaults(
        pipe.generation_config).logits_filter  # fmt: skip
    same = SamplingParams(max_tokens=12, seed=7, ignore_eos=True)
    explicit = dataclasses.replace(same, **{k: getattr(pipe.resolve(same), k) for k in ("temperature", "top_k", "top_p", "min_p")})
    assert list(pipe.stream("Hi", same)) == list(pipe.stream("Hi", explicit))
