"""The learning demos' environments (`sides`: where; `guess`: feedback use) and the learner model variant
(`tiny:qwen2_5_vl/learner`), checked against hand-derived facts: pixel counts, the retry rule, config values."""

from __future__ import annotations

from collections import Counter

import pytest

from vlmrl.config import DataConfig
from vlmrl.envs import guess, sides
from vlmrl.envs.colors import COLORS, FEEDBACK
from vlmrl.types import Role


def _red_share_left(image) -> float:
    """Share of the image's red pixels that lie in its left half (counted pixel by pixel)."""
    w, h = image.size
    px = image.load()
    red = [x for x in range(w) for y in range(h) if px[x, y] == sides.RED]
    return sum(x < w // 2 for x in red) / len(red)


def test_sides_pictures_put_red_on_the_answer_side_with_the_same_colours_either_way():
    tasks = sides.make_tasks(sides.SidesConfig(), DataConfig(path="generated", split="train", limit=8))
    assert Counter(t.answer for t in tasks) == {"left": 4, "right": 4}
    for t in tasks:
        image = t.messages[0].content[0].image
        assert image.size == (sides.WIDTH, sides.HEIGHT)
        assert _red_share_left(image) == (1.0 if t.answer == "left" else 0.0), t.id
        assert {c for _, c in image.getcolors()} == {sides.BACKGROUND, sides.RED, sides.BLUE}, t.id


def test_sides_square_sizes_come_from_the_config():
    """env.min_size/max_size: each square's side (red and blue pixel counts are side+1 squared: PIL's rectangle
    includes both corners) lies in the range; a range off the half is a config error."""
    cfg = sides.SidesConfig(min_size=36, max_size=44)
    for t in sides.make_tasks(cfg, DataConfig(path="generated", split="train", limit=6)):
        counts = {c: n for n, c in t.messages[0].content[0].image.getcolors()}
        for color in (sides.RED, sides.BLUE):
            assert 37**2 <= counts[color] <= 45**2 and int(counts[color] ** 0.5) ** 2 == counts[color], t.id
    with pytest.raises(ValueError, match="env.min_size"):
        sides.make_tasks(sides.SidesConfig(min_size=30, max_size=53), DataConfig(path="generated", limit=2))


def test_sides_eval_split_is_held_out():
    cfg = sides.SidesConfig()
    train = sides.make_tasks(cfg, DataConfig(path="generated", split="train", limit=64))
    test = sides.make_tasks(cfg, DataConfig(path="generated", split="test", limit=64))
    assert not {t.id for t in train} & {t.id for t in test}
    assert not {t.messages[0].content[0].image.tobytes() for t in train} & {
        t.messages[0].content[0].image.tobytes() for t in test
    }


def test_sides_grades_the_boxed_side():
    task = sides.build_task(3, "right")
    env = sides.SidesEnv()
    env.reset(task)
    right, wrong, unboxed = (env.step(s, 0, True) for s in ("\\boxed{Right}", "\\boxed{left}", "right"))
    assert (right.reward, wrong.reward, unboxed.reward) == (pytest.approx(1.0), pytest.approx(0.1), 0.0)
    assert right.done and wrong.done and unboxed.metrics["parse_fail"] == 1.0


def test_guess_canvas_shows_both_colours_and_cases_are_balanced():
    tasks = guess.make_tasks(guess.GuessConfig(), DataConfig(path="generated", split="train", limit=48))
    assert Counter(t.answer for t in tasks) == {c: 12 for c in COLORS}
    for t in tasks:
        left, right = t.meta["shown"]
        assert left != right and t.answer in (left, right)
        px = t.messages[0].content[0].image.load()
        assert px[5, 5] == COLORS[left] and px[111, 55] == COLORS[right] and px[55, 0] == COLORS[left]


def test_guess_wrong_first_try_gets_feedback_and_the_other_colour_wins():
    task = guess.build_task(0, "red", "blue", 1)  # the answer is blue
    env = guess.GuessEnv(guess.GuessConfig(max_turns=2))
    env.reset(task)
    first = env.step("\\boxed{red}", 0, False)
    assert not first.done and first.reward == pytest.approx(0.1) and first.metrics["shown"] == 1.0
    assert [(m.role, m.content[0].text) for m in first.messages] == [(Role.USER, FEEDBACK)]
    second = env.step("\\boxed{blue}", 1, True)
    assert second.done and second.reward == pytest.approx(1.0) and second.metrics["correct"] == 1.0
    env.reset(task)
    off = env.step("\\boxed{green}", 0, False)  # a colour not shown
    assert off.metrics["shown"] == 0.0 and not off.done


def test_guess_demos_teach_the_format_not_the_answer():
    demos = guess.make_demos(guess.GuessConfig(max_turns=2), 400, seed=1)
    firsts = [d[1].content[0].text for d in demos]
    retries = [d for d in demos if len(d) == 4]
    assert len(retries) == 200 and all(d[2].content[0].text == FEEDBACK for d in retries)
    said = Counter(f[len("\\boxed{") : -1] for f in firsts)
    assert set(said) == set(COLORS) and min(said.values()) > 60  # uniform over all four, shown or not
    repeats = sum(d[1].content[0].text == d[3].content[0].text for d in retries)
    assert 25 < repeats < 80  # the retry ignores the first answer: repeats ~1/4 of the time


def test_learner_variant_changes_only_rope_sections_and_init():
    from vlmrl.modeling.loading import tiny_config, tiny_model, tiny_variants

    base, learner = tiny_config("qwen2_5_vl"), tiny_config("qwen2_5_vl", "learner")
    assert tiny_variants("qwen2_5_vl") == ["learner"]
    assert learner.text_config.rope_parameters["mrope_section"] == [0, 0, 8]
    assert learner.text_config.rope_parameters["rope_theta"] == base.text_config.rope_parameters["rope_theta"]
    assert learner.text_config.initializer_range == learner.vision_config.initializer_range == 0.1
    assert base.text_config.initializer_range == base.vision_config.initializer_range == 0.02
    assert learner.text_config.hidden_size == base.text_config.hidden_size == 64
    model = tiny_model("qwen2_5_vl", seed=0, variant="learner")
    q = model.model.language_model.layers[0].self_attn.q_proj.weight
    assert 0.09 < float(q.detach().std()) < 0.11
    with pytest.raises(ValueError, match="tiny:qwen2_5_vl/learner"):
        tiny_config("qwen2_5_vl", "nope")


def test_learner_model_config_loads():
    from vlmrl.config import ModelConfig
    from vlmrl.modeling.loading import load_policy

    model, _ = load_policy(ModelConfig(family="qwen2_5_vl", name_or_path="tiny:qwen2_5_vl/learner"))
    assert model.config.text_config.rope_parameters["mrope_section"] == [0, 0, 8]
    with pytest.raises(ValueError, match="does not match model.family"):
        load_policy(ModelConfig(family="qwen3_vl", name_or_path="tiny:qwen2_5_vl/learner"))
