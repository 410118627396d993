"""Conversions to and from vLLM's inputs and outputs (`vlmrl.rollout.vllm.engine`), with fake vLLM objects: runs
without vllm installed. The real engine is tested by `make test-vllm` (tests/real_vllm/; not tests/vllm, which
would shadow the vllm package on sys.path)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.vllm.convert import (
    choose_logprobs_mode,
    collapse_image_placeholders,
    generate_body,
    generation_from_generate_choice,
    generation_from_vllm,
    image_data_url,
    logprobs_exact,
    max_abs_delta,
    prompt_logprobs_list,
    sampling_kwargs,
    to_stop_reason,
    to_vllm_prompt,
)
from vlmrl.rollout.vllm.video import VideoIds
from vlmrl.rollout.vllm.weights import write_weights
from vlmrl.types import EnginePrompt, StopReason, VisionInputs

IMG = 151655
EOS, EOT = 151645, 151643


def decode(ids):
    return " ".join(map(str, ids))


def lp(x):
    return SimpleNamespace(logprob=x, rank=1, decoded_token=None)


def completion(ids, logprobs, finish, stop_reason=None, index=0):
    """A fake `vllm.CompletionOutput` with `logprobs=0` (one {token: Logprob} dict per sampled token)."""
    return SimpleNamespace(
        index=index,
        token_ids=ids,
        logprobs=[{t: lp(x)} for t, x in zip(ids, logprobs)],
        finish_reason=finish,
        stop_reason=stop_reason,
        text="ignored",
    )


# --- inputs ---------------------------------------------------------------------------------------------------
def test_text_prompt_is_token_ids_verbatim():
    prompt = EnginePrompt([1, 2, 3], [])
    assert to_vllm_prompt(prompt, IMG, 2) == {"prompt_token_ids": [1, 2, 3]}


def _vision(grids):
    grid = torch.tensor(grids)
    return VisionInputs(torch.zeros(int(grid.prod(-1).sum()), 8), grid)


def test_expanded_placeholders_collapse_to_one_per_image():
    ids = [5, 151652] + [IMG] * 4 + [151653, 6, 151652] + [IMG] * 2 + [151653, 7]
    images = ["a", "b"]
    prompt = EnginePrompt(ids, images, [_vision([[1, 4, 4], [1, 2, 4]])])  # 16 / 4 = 4 and 8 / 4 = 2 tokens
    out = to_vllm_prompt(prompt, IMG, 2)
    assert out["prompt_token_ids"] == [5, 151652, IMG, 151653, 6, 151652, IMG, 151653, 7]
    assert out["multi_modal_data"] == {"image": images}


def test_adjacent_images_split_by_counts_and_mismatches_raise():
    assert collapse_image_placeholders([1] + [IMG] * 6 + [2], IMG, [4, 2], 2) == [1, IMG, IMG, 2]
    assert collapse_image_placeholders([1, IMG, IMG, 2, IMG, 3], IMG, None, 2) == [1, IMG, 2, IMG, 3]
    with pytest.raises(ValueError, match="does not match"):
        collapse_image_placeholders([1] + [IMG] * 5 + [2], IMG, [4, 2], 2)  # a cut vision span
    with pytest.raises(ValueError, match="2 images"):
        collapse_image_placeholders([1] + [IMG] * 4 + [2], IMG, [4], 2)
    with pytest.raises(ValueError, match="1 images"):
        collapse_image_placeholders([1, 2], IMG, None, 1)


def test_collapse_then_vllm_expansion_recovers_the_builder_ids(request, small_images):
    """What vLLM 0.32 does with the collapsed prompt (each placeholder -> grid.prod() // merge**2 copies) gives back
    the builder's ids token for token."""
    qwen25_processor = request.getfixturevalue("qwen25_processor")
    from vlmrl.tokens import get_builder
    from vlmrl.types import ImagePart, Message, Role, TextPart

    builder = get_builder("qwen2_5_vl", qwen25_processor)
    msg = Message(
        Role.USER,
        [ImagePart(small_images[0]), TextPart("Compare"), ImagePart(small_images[2]), TextPart("Which is larger?")],
    )
    prompt = builder.start([msg]).prompt()
    merge = qwen25_processor.image_processor.merge_size
    out = to_vllm_prompt(prompt, builder.image_token_id, merge)
    assert out["prompt_token_ids"].count(builder.image_token_id) == 2
    assert out["multi_modal_data"]["image"] == prompt.images
    counts = iter((prompt.vision.image_grid_thw.prod(-1) // merge**2).tolist())
    expanded = [
        t for tok in out["prompt_token_ids"] for t in ([tok] * next(counts) if tok == builder.image_token_id else [tok])
    ]
    assert expanded == prompt.token_ids


def test_sampling_kwargs_and_generate_body():
    params = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, stop=["</answer>"], seed=3)
    kw = sampling_kwargs(params, 4, [EOS, EOT], seed=3)
    assert kw["n"] == 4 and kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["max_tokens"] == 7
    assert kw["logprobs"] == 0 and kw["top_k"] == 0 and kw["min_p"] == 0.0 and kw["repetition_penalty"] == 1.0
    assert kw["stop"] == ["</answer>"] and kw["stop_token_ids"] == [EOS, EOT] and kw["seed"] == 3
    assert sampling_kwargs(SamplingParams(), 1, [EOS], None)["stop"] is None
    body = generate_body(EnginePrompt([1, 2], []), sampling_kwargs(SamplingParams(), 4, [EOS], None), "policy", IMG, 2)
    assert body["token_ids"] == [1, 2] and body["model"] == "policy" and "content_parts" not in body
    sp = body["sampling_params"]
    assert "seed" not in sp and "stop" not in sp and sp["logprobs"] == 0 and sp["n"] == 4
    assert sp["top_k"] == 0 and sp["repetition_penalty"] == 1.0  # never the model's generation_config
    assert body["return_token_ids"] and body["output_mode"] == "tokens"
    assert "logit_bias" not in kw


def test_placeholder_ids_are_never_sampled_by_vllm(qwen25_processor):
    """The family's image and video placeholders get vLLM's lowest logit bias, in-process and in the server body;
    the engine factory passes the builder's `placeholder_token_ids`."""
    import json

    from vlmrl.tokens import get_builder

    ids = get_builder("qwen2_5_vl", qwen25_processor).placeholder_token_ids
    assert ids == (IMG, 151656)  # <|image_pad|>, <|video_pad|>
    kw = sampling_kwargs(SamplingParams(), 2, [EOS], None, ids)
    assert kw["logit_bias"] == {IMG: -100.0, 151656: -100.0}
    body = json.loads(json.dumps(generate_body(EnginePrompt([1, 2], []), kw, "policy", IMG, 2)))
    assert body["sampling_params"]["logit_bias"] == {str(IMG): -100.0, "151656": -100.0}  # vLLM reads str keys


def test_generate_body_collapses_placeholders_and_sends_lossless_pngs():
    from PIL import Image

    ids = [5, 151652] + [IMG] * 4 + [151653, 6, 151652] + [IMG] * 2 + [151653, 7]
    a = Image.new("RGB", (5, 3), (200, 10, 30))
    a.putpixel((1, 2), (1, 2, 3))
    b = Image.new("RGB", (2, 2), (0, 255, 0))
    prompt = EnginePrompt(ids, [a, b], [_vision([[1, 4, 4], [1, 2, 4]])])
    body = generate_body(prompt, {"max_tokens": 1}, "policy", IMG, 2)
    assert body["token_ids"] == [5, 151652, IMG, 151653, 6, 151652, IMG, 151653, 7]
    urls = [part["url"] for part in body["content_parts"]]
    assert [part["type"] for part in body["content_parts"]] == ["image_url", "image_url"]
    import base64
    import io

    for url, image in zip(urls, [a, b]):  # decoded independently: the same pixels, in prompt order
        assert url.startswith("data:image/png;base64,")
        back = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert back.size == image.size and list(back.convert("RGB").getdata()) == list(image.getdata())
    assert image_data_url(a) == urls[0]


def test_logprobs_mode_matches_our_convention():
    """Ours: log_softmax(logits / T) of the full distribution. processed = after T and top-p; raw = before T."""
    assert choose_logprobs_mode(0.7, 1.0) == "processed_logprobs"
    assert choose_logprobs_mode(1.0, 1.0) == "processed_logprobs"
    assert choose_logprobs_mode(1.0, 0.9) == "raw_logprobs"
    assert choose_logprobs_mode(0.7, 0.9) == "processed_logprobs"
    assert logprobs_exact("processed_logprobs", 0.7, 1.0) and not logprobs_exact("processed_logprobs", 1.0, 0.9)
    assert logprobs_exact("raw_logprobs", 1.0, 0.9) and not logprobs_exact("raw_logprobs", 0.7, 1.0)
    assert not logprobs_exact(choose_logprobs_mode(0.7, 0.9), 0.7, 0.9)


# --- outputs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "finish, stop_reason, expected",
    [
        ("stop", None, StopReason.EOS),  # the model's EOS
        ("stop", EOT, StopReason.EOS),  # one of vlmrl's stop_token_ids
        ("stop", "</answer>", StopReason.STOP_STRING),
        ("length", None, StopReason.LENGTH),
    ],
)
def test_stop_reason_mapping(finish, stop_reason, expected):
    assert to_stop_reason(finish, stop_reason) is expected


def test_stop_reason_abort_raises():
    with pytest.raises(RuntimeError, match="abort"):
        to_stop_reason("abort", None)


def test_generation_from_vllm_keeps_ids_and_eos():
    gen = generation_from_vllm(completion([11, 12, EOS], [-0.5, -1.0, -0.1], "stop"), [EOS, EOT], decode)
    assert gen.token_ids == [11, 12, EOS] and gen.logprobs == [-0.5, -1.0, -0.1]
    assert gen.stop_reason is StopReason.EOS and gen.text == "11 12 151645"
    gen = generation_from_vllm(completion([11, EOT], [-0.5, -2.0], "stop", EOT), [EOS, EOT], decode)
    assert gen.stop_reason is StopReason.EOS and gen.token_ids[-1] == EOT
    gen = generation_from_vllm(completion([11, 12], [-0.5, -1.0], "stop", "2"), [EOS], decode)
    assert gen.stop_reason is StopReason.STOP_STRING and gen.token_ids == [11, 12]
    gen = generation_from_vllm(completion([11, 12], [-0.5, -1.0], "length"), [EOS], decode)
    assert gen.stop_reason is StopReason.LENGTH


def test_generation_from_vllm_rejects_inconsistent_outputs():
    with pytest.raises(RuntimeError, match="end with"):  # EOS stop without the EOS id in the ids
        generation_from_vllm(completion([11, 12], [-0.5, -1.0], "stop"), [EOS], decode)
    bad = completion([11, 12], [-0.5, -1.0], "length")
    bad.logprobs = bad.logprobs[:1]
    with pytest.raises(RuntimeError, match="1 logprobs for 2 tokens"):
        generation_from_vllm(bad, [EOS], decode)
    bad.logprobs = None
    with pytest.raises(RuntimeError, match="no logprobs"):
        generation_from_vllm(bad, [EOS], decode)


def test_generation_from_generate_choice():
    """A `choices[i]` of vLLM's `/inference/v1/generate` (`output_mode="tokens"`, `logprobs=0`)."""
    choice = {
        "index": 0,
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": [7, EOS],
        "logprobs": {
            "content": [
                {"token_id": 7, "logprob": -1.5, "rank": 2, "top_logprobs": []},
                {"token_id": EOS, "logprob": -0.25, "rank": 1, "top_logprobs": []},
            ]
        },
    }
    gen = generation_from_generate_choice(choice, [EOS], decode)
    assert gen.token_ids == [7, EOS] and gen.logprobs == [-1.5, -0.25] and gen.stop_reason is StopReason.EOS
    length = {
        **choice,
        "finish_reason": "length",
        "token_ids": [7],
        "logprobs": {"content": [{"token_id": 7, "logprob": -1.5}]},
    }
    assert generation_from_generate_choice(length, [EOS], decode).stop_reason is StopReason.LENGTH
    with pytest.raises(RuntimeError, match="no logprobs"):
        generation_from_generate_choice({**choice, "logprobs": None}, [EOS], decode)
    with pytest.raises(RuntimeError, match="differ"):
        generation_from_generate_choice({**choice, "token_ids": [8, EOS]}, [EOS], decode)


def test_prompt_logprobs_layout_and_delta():
    ids = [5, 6, 7]
    engine_style = [None, {6: lp(-1.0), 99: lp(-0.1)}, {7: lp(-2.0)}]
    server_style = [None, {"6": {"logprob": -1.0, "rank": 3}}, {"7": {"logprob": -2.0, "rank": 1}}]
    assert prompt_logprobs_list(ids, engine_style) == [0.0, -1.0, -2.0]
    assert prompt_logprobs_list(ids, server_style) == [0.0, -1.0, -2.0]
    with pytest.raises(RuntimeError, match="2 prompt logprobs for 3"):
        prompt_logprobs_list(ids, engine_style[:2])
    assert max_abs_delta([[0.0, -1.0, -2.0]], [[9.0, -1.5, -2.0]]) == 0.5  # position 0 is never compared
    assert max_abs_delta([], []) == 0.0


# --- settings, factory, weights --------------------------------------------------------------------------------
def test_nested_vllm_config_reaches_the_engine_as_it_is(monkeypatch):
    """`make_engine` hands `rollout.vllm` (the typed node from the config, not a copy) and the rollout's context
    length, temperature and top_p to `make_vllm_engine` (a recording stand-in: runs without vllm)."""
    import importlib.util
    import sys
    import types

    from vlmrl.config import load
    from vlmrl.rollout import make_engine

    seen = {}

    class RecordingEngine:
        def __init__(self, policy, processor, eos_ids, image_token_id, config, **kwargs):
            seen.update(config=config, eos_ids=eos_ids, image_token_id=image_token_id, **kwargs)

    fake = types.ModuleType("vlmrl.rollout.vllm.engine")
    fake.make_vllm_engine = RecordingEngine
    monkeypatch.setitem(sys.modules, "vlmrl.rollout.vllm.engine", fake)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a)
    )
    cfg = load(
        None,
        [
            "rollout=vllm",
            "rollout.temperature=0.7",
            "rollout.top_p=0.9",
            "rollout.max_context_tokens=999",
            "rollout.vllm.kv_cache_gb=0.5",
            "rollout.vllm.sync_check_seqs=3",
            "rollout.vllm.seed=7",
        ],
    )
    processor = SimpleNamespace(tokenizer=object(), image_processor=SimpleNamespace(merge_size=2))
    vision = {"<|vision_start|>": 151652, "<|vision_end|>": 151653}
    builder = SimpleNamespace(
        stop_token_ids={EOS, 151643},
        image_token_id=IMG,
        placeholder_token_ids=(IMG, 151656),
        video_token_id=151656,
        vision_tokens=tuple(vision),
        tokenizer=SimpleNamespace(convert_tokens_to_ids=vision.get),
        video_timestamps=True,
    )
    make_engine(cfg.rollout, None, processor, builder)
    assert seen["config"] is cfg.rollout.vllm
    assert (seen["config"].kv_cache_gb, seen["config"].sync_check_seqs, seen["config"].seed) == (0.5, 3, 7)
    assert (seen["max_model_len"], seen["temperature"], seen["top_p"], seen["merge_size"]) == (999, 0.7, 0.9, 2)
    assert seen["eos_ids"] == [151643, EOS] and seen["image_token_id"] == IMG
    assert seen["suppress_ids"] == (IMG, 151656)
    assert seen["video"] == VideoIds(151656, 151652, 151653, timestamps=True)


def test_make_engine_without_vllm_is_a_clear_error(monkeypatch):
    """Runs in both venvs: where vllm is installed, it is made unimportable for this test (never a skip)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib.util.find_spec("vllm") is None, `import vllm` fails
    from vlmrl.rollout import make_engine

    with pytest.raises(ValueError, match=r"vlmrl\[vllm\]") as err:
        make_engine(SimpleNamespace(engine="vllm"), None, None, None)
    assert "Python >= 3.11" not in str(err.value)  # this interpreter is new enough: vLLM is only missing
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    with pytest.raises(ValueError, match=r"vLLM 0.32 and 0.33 need Python >= 3.11; this is 3.10"):
        make_engine(SimpleNamespace(engine="vllm"), None, None, None)


def test_weights_file_keeps_tied_lm_head(tmp_path):
    """The synced checkpoint holds `lm_head.weight` even when it is tied (save_pretrained drops it, and vLLM's CPU
    build then keeps a stale LM head)."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    write_weights(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], model.model.embed_tokens.weight)
    assert set(tensors) == set(model.state_dict()) and (tmp_path / "config.json").is_file()
