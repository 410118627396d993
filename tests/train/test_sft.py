"""`vlmrl sft`: demonstrations through the token builder and export (loss only on assistant tokens), the
cross-entropy objective of the trainer, and a checkpoint that `vlmrl train` and `vlmrl generate` load."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from cli_inprocess import vlmrl  # tests/ is on sys.path (pytest's rootdir-relative import)

from vlmrl.config import ExportStyle, ModelConfig, load
from vlmrl.envs import colors
from vlmrl.export import to_samples
from vlmrl.sft import demo_trajectory, load_demos
from vlmrl.tokens import get_builder
from vlmrl.train.settings import TrainerSettings
from vlmrl.train.sft_loss import sft_loss
from vlmrl.train.trainer import GRPOTrainer
from vlmrl.types import ImagePart, Message, Role, TextPart

ROOT = Path(__file__).resolve().parents[2]


def _conversation() -> list[Message]:
    return [
        Message(Role.USER, [ImagePart(colors.square("blue"), "b"), TextPart(colors.QUESTION)]),
        Message.text(Role.ASSISTANT, "\\boxed{red}"),
        Message.text(Role.USER, colors.FEEDBACK),
        Message.text(Role.ASSISTANT, "I think \\boxed{blue}"),
    ]


def _assistant_mask(ids: list[int], tok) -> list[int]:
    """Hand-built expectation from the processor's full render: 1 from the token after each
    `<|im_start|>assistant\\n` up to and including the `<|im_end|>` that closes it, 0 everywhere else."""
    opener = tok.convert_tokens_to_ids("<|im_start|>")
    header = [opener] + tok.encode("assistant\n", add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    mask, inside = [0] * len(ids), False
    for i in range(len(ids)):
        if not inside and i >= len(header) and ids[i - len(header) : i] == header:
            inside = True
        if inside:
            mask[i] = 1
            inside = ids[i] != end
    return mask


@pytest.mark.parametrize("style", [ExportStyle.concat, ExportStyle.individual])
def test_demo_tokens_equal_full_render_and_mask_only_assistant(qwen25_processor, style):
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    conv = _conversation()
    traj = demo_trajectory(builder, conv, "demo-0")
    full = builder.render_full(conv)
    assert traj.tokens.ids == full.ids  # the processor's own render of the same conversation
    assert torch.equal(traj.tokens.vision.pixel_values, full.vision.pixel_values)
    expected = _assistant_mask(full.ids, qwen25_processor.tokenizer)
    samples = to_samples([traj], style, builder.image_token_id)
    masks = [s.loss_mask.tolist() for s in samples]
    if style is ExportStyle.concat:
        assert masks == [[float(m) for m in expected]]
    else:  # one sample per assistant turn, each cut at its turn's end
        ends = [e for _, e in traj.tokens.turn_spans]
        first = [float(m) if i < ends[0] else 0.0 for i, m in enumerate(expected)][: ends[0]]
        assert masks[0] == first and len(samples) == 2
        assert sum(masks[1]) == sum(expected[ends[0] :]) and masks[1][: ends[0]] == [0.0] * ends[0]
    tok = qwen25_processor.tokenizer
    learned = [i for i, m in zip(full.ids, expected) if m]
    assert tok.decode(learned) == "\\boxed{red}<|im_end|>I think \\boxed{blue}<|im_end|>"


def test_sft_loss_is_masked_mean_nll():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, float("nan"), -4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert sft_loss(logprobs, mask).item() == pytest.approx((2.0 + 3.0 + 0.5) / 3)  # NaN under mask 0 ignored
    assert sft_loss(logprobs, mask, num_tokens=11.0).item() == pytest.approx(5.5 / 11)


def test_color_demos_ignore_the_image():
    """Demonstrated answers are drawn independently of the square: over 400 demos they match it about 1/4 of the
    time (a demo set that taught the task would match always), and retries appear with max_turns 2."""
    cfg = load("colors_sft_tiny", ["sft.num_demos=400"])
    demos = load_demos(cfg)
    rgb = {v: k for k, v in colors.COLORS.items()}
    hits = [rgb[m.content[0].image.getpixel((0, 0))] in m2.text_content for m, m2 in (d[:2] for d in demos)]
    assert 0.15 < sum(hits) / len(hits) < 0.35
    assert sum(len(d) == 4 for d in demos) == 200


def test_demos_from_jsonl(tmp_path):
    colors.square("green").save(tmp_path / "g.png")
    line = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "ref": "g.png"}, {"type": "text", "text": "colour?"}]},
            {"role": "assistant", "content": "\\boxed{green}"},
        ]
    }
    (tmp_path / "demos.jsonl").write_text(json.dumps(line) + "\n\n")
    demos = load_demos(load("colors_sft_tiny", [f"sft.demos={tmp_path / 'demos.jsonl'}"]))
    assert len(demos) == 1 and demos[0][0].images[0].getpixel((3, 3)) == colors.COLORS["green"]
    assert demos[0][1].role is Role.ASSISTANT and demos[0][1].text_content == "\\boxed{green}"
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_demos(load("colors_sft_tiny", [f"sft.demos={tmp_path / 'bad.jsonl'}"]))
    (tmp_path / "torn.jsonl").write_text(json.dumps(line) + "\n" + '{"messages": [')
    with pytest.raises(ValueError, match=r"torn.jsonl:2: not JSON"):
        load_demos(load("colors_sft_tiny", [f"sft.demos={tmp_path / 'torn.jsonl'}"]))


def _clip(folder: Path, frames: int = 4) -> list[Path]:
    """`frames` 56x56 PNG frames of a square moving right, and the same as a GIF (clip.gif) in `folder`."""
    from PIL import Image

    images = []
    for i in range(frames):
        img = Image.new("RGB", (56, 56), (20, 20, 20))
        img.paste((220, 40, 40), (8 + 8 * i, 20, 24 + 8 * i, 36))
        images.append(img)
    paths = []
    for i, img in enumerate(images):
        paths.append(folder / f"f{i}.png")
        img.save(paths[-1])
    images[0].save(folder / "clip.gif", save_all=True, append_images=images[1:], duration=500, loop=0)
    return paths


def test_a_demo_video_is_carried_as_a_video_or_refused_naming_the_line(tmp_path, qwen25_processor, qwen25_model):
    """A video part of a JSONL demonstration (a GIF, or a list of frame files) is read as a video with the family's
    sampling: all its frames reach the token builder, whose ids are the processor's own render of the conversation,
    and an SFT step's loss is the masked mean NLL of the model run on the processor's own render (its
    `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`; M-RoPE positions after a video by the reference
    rule, `vlmrl.modeling.video_positions`, as vLLM samples); a run that reads no video refuses it in one line
    naming the file's line (never the GIF's first frame as an image)."""
    from vlmrl.config import VideoConfig
    from vlmrl.data.row_videos import row_videos
    from vlmrl.types import VideoPart

    frames = _clip(tmp_path)
    lines = []
    for ref in ("clip.gif", [p.name for p in frames]):
        content = [{"type": "video", "ref": ref}, {"type": "text", "text": "Which way does it move?"}]
        lines.append({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "right"}]})
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = load("colors_sft_tiny", [f"sft.demos={path}"])
    videos = row_videos("qwen2_5_vl", None, qwen25_processor, VideoConfig())
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    from vlmrl.modeling.video_positions import use_reference_video_positions

    use_reference_video_positions()
    trajs, nll, count = [], 0.0, 0.0
    for demo in load_demos(cfg, videos):
        part = demo[0].content[0]
        assert isinstance(part, VideoPart) and part.video.read().frames.shape == (4, 56, 56, 3)
        traj = demo_trajectory(builder, demo, "demo-0")
        full = builder.render_full(demo)
        assert traj.tokens.ids == full.ids and traj.tokens.ids.count(builder.video_token_id) > 0
        trajs.append(traj)
        ids, mask = torch.tensor([full.ids]), torch.tensor(traj.tokens.loss_mask[1:], dtype=torch.float64)
        with torch.no_grad():
            logits = qwen25_model(
                input_ids=ids,
                pixel_values_videos=full.video.pixel_values_videos,
                video_grid_thw=full.video.video_grid_thw,
                second_per_grid_ts=full.video.second_per_grid_ts,
                mm_token_type_ids=(ids == builder.video_token_id).long() * 2,
            ).logits[0]
        logp = torch.log_softmax(logits.double(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        nll, count = nll - float((logp * mask).sum()), count + float(mask.sum())
    settings = TrainerSettings(zero_stage=2, lr=1e-3, micro_batch_size=1, max_grad_norm=0.0)
    trainer = GRPOTrainer(copy.deepcopy(qwen25_model).train(), settings, family="qwen2_5_vl", objective="sft")
    samples = to_samples(trajs, ExportStyle.concat, builder.image_token_id, video_token_id=builder.video_token_id)
    assert all(s.video is not None for s in samples)
    assert trainer.train_step(samples).loss == pytest.approx(nll / count, rel=1e-5)
    with pytest.raises(ValueError) as err:
        load_demos(cfg, row_videos("gemma3", None, qwen25_processor, VideoConfig()))
    assert str(err.value) == (
        f"{path}:1: a video part ('clip.gif'), but this run reads no video: model.family=gemma3 takes no video here "
        "(qwen2_vl, qwen2_5_vl and qwen3_vl do)"
    )


@pytest.mark.slow
def test_sft_checkpoint_loads_in_train_and_generate(tmp_path):
    out = tmp_path / "sft"
    res = vlmrl(
        "sft",
        "recipe=colors_sft_tiny",
        "trainer.steps=2",
        "trainer.batch_size=4",
        "sft.num_demos=8",
        f"logging.output_dir={out}",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and losses[1] < losses[0]
    from vlmrl.modeling.loading import load_policy, tiny_model

    model, _ = load_policy(ModelConfig(name_or_path=str(out / "hf"), family="qwen2_5_vl"))
    init = tiny_model("qwen2_5_vl", 0)
    name, weight = next((n, p) for n, p in model.named_parameters() if "embed_tokens" in n)
    assert not torch.equal(weight, dict(init.named_parameters())[name])  # the SFT update is in the saved weights
    common = [
        "recipe=colors_tiny",
        f"model.name_or_path={out / 'hf'}",
        "trainer.steps=1",
        "trainer.batch_size=2",
        "algorithm.group_size=2",
        "logging.progress=false",
    ]
    res = vlmrl("train", *common, f"logging.output_dir={tmp_path / 'rl'}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "rl" / "checkpoints" / "step_1" / "hf").is_dir()
    res = vlmrl("generate", *common, "data.limit=2", f"logging.output_dir={tmp_path / 'gen'}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert len((tmp_path / "gen" / "trajectories.jsonl").read_text().splitlines()) == 4


def test_colors_env_retries_with_feedback_until_right():
    task = colors.build_task(7, "green")
    env = colors.ColorsEnv(colors.ColorsConfig(max_turns=2))
    assert env.reset(task)[0].images[0].getpixel((0, 0)) == colors.COLORS["green"]
    wrong = env.step("\\boxed{red}", 0, False)
    assert (wrong.reward, wrong.done, wrong.correct, wrong.metrics["formatted"]) == (
        pytest.approx(0.1),
        False,
        False,
        1,
    )
    assert wrong.messages[0].text_content == colors.FEEDBACK
    right = env.step("so \\boxed{Green}", 1, True)
    assert (right.reward, right.done, right.correct) == (pytest.approx(1.0), True, True)
    assert env.step("green", 0, False).reward == 0.0  # no \\boxed{}: no format reward
    one = colors.ColorsEnv(colors.ColorsConfig(max_turns=1))
    one.reset(task)
    assert one.step("\\boxed{red}", 0, False).done  # no turn left: no feedback
