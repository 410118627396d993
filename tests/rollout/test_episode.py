"""The episode state machine with a scripted engine, the real Qwen2.5-VL builder and the Geometry3K env:
retry with feedback, turn-discounted reward, context budget, and both exports against the full render."""

from __future__ import annotations

import pytest
import torch
from conftest import GEOMETRY3K

from vlmrl.config import DataConfig, EnvConfig, ExportConfig, ExportStyle
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.export import count_images, to_samples
from vlmrl.reward import RewardStage
from vlmrl.rollout.engine import Engine, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.types import Generation, StopReason, Trajectory


class ScriptedEngine(Engine):
    """Replies with scripted texts in call order (canonical token ids + <|im_end|>), logprob -0.5 per token."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tok, self.replies, self.calls = tokenizer, list(replies), []
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, params):
        self.calls.append((len(prompts[0].token_ids), n, params.max_new_tokens))
        out = []
        for _ in prompts:
            gens = []
            for _ in range(n):
                text = self.replies.pop(0)
                ids = self.tok.encode(text, add_special_tokens=False) + [self.im_end]
                gens.append(Generation(ids, [-0.5] * len(ids), StopReason.EOS, text))
            out.append(gens)
        return out


@pytest.fixture(scope="module")
def setup(qwen25_processor):
    env_cfg = EnvConfig(max_turns=3)
    tasks = load_env_tasks(env_cfg, DataConfig(path=str(GEOMETRY3K), split="test", limit=2))
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    return env_cfg, tasks, builder


def _runner(setup, replies, max_turns=3, budget=4096):
    env_cfg, tasks, builder = setup
    engine = ScriptedEngine(builder.tokenizer, replies)
    limits = EpisodeLimits(max_turns=max_turns, max_context_tokens=budget)
    return EpisodeRunner(builder, engine, make_env_factory(env_cfg), limits, SamplingParams(max_new_tokens=32)), engine


def test_retry_with_feedback_and_discounted_reward(setup, qwen25_processor):
    env_cfg, tasks, builder = setup
    task = tasks[0]
    wrong, right = _answers(task)
    wrong, right = f"I think \\boxed{{{wrong}}}", f"So it is \\boxed{{{right}}}"
    runner, engine = _runner(setup, [wrong, right, "no box here", wrong])
    ended: list[Trajectory] = []
    trajs = runner.run([task], group_size=2, on_finish=ended.append)
    assert ended == trajs[::-1]  # each handed over as it ends (b at turn 0, a after 3 turns); returned in task order
    RewardStage(turn_discount=0.9).score(trajs, [task])  # the episode reward: max_t r_t * 0.9**t
    # turn 0: one engine call for the whole group (n=2); later turns one call per episode
    assert engine.calls[0][1] == 2 and all(c[1] == 1 for c in engine.calls[1:])
    a, b = trajs
    assert [t.reward for t in a.turns] == pytest.approx([0.1, 0.0, 0.1])  # boxed-but-wrong gets the 0.1 format
    # parse status ok, no_answer, ok: (formatted, parse_fail) per turn
    assert [(t.metrics["formatted"], t.metrics["parse_fail"]) for t in a.turns] == [(1.0, 0.0), (0.0, 1.0), (1.0, 0.0)]
    assert a.end_reason == "max_turns" and a.reward == pytest.approx(0.1)  # max(0.1, 0, 0.1*0.81)
    assert [t.reward for t in b.turns] == pytest.approx([1.0])  # right at turn 0: episode ends
    assert b.end_reason == "env_done" and b.reward == pytest.approx(1.0)
    # feedback arrives as user messages between the assistant turns
    roles = [m.role.value for m in a.messages]
    assert roles[-5:] == ["assistant", "user", "assistant", "user", "assistant"]
    # continuous ids equal the processor's full render of the same conversation
    full = builder.render_full(a.messages)
    assert a.tokens.ids == full.ids[: len(a.tokens.ids)]
    assert len(full.ids) - len(a.tokens.ids) <= 1  # only the template's trailing "\n" after the last <|im_end|>
    assert torch.equal(a.tokens.vision.pixel_values, full.vision.pixel_values)


def test_discounted_reward_when_right_later(setup):
    env_cfg, tasks, builder = setup
    wrong, right = _answers(tasks[0])
    value = tasks[0].meta["answer_value"]
    runner, _ = _runner(setup, [f"\\boxed{{{wrong}}}", f"\\boxed{{{value}}}"])
    (traj,) = runner.run([tasks[0]], group_size=1)
    RewardStage(turn_discount=0.9).score([traj], tasks[:1])
    assert [t.correct for t in traj.turns] == [False, True]
    assert traj.reward == pytest.approx(max(0.1, 1.0 * 0.9))


def test_context_budget_ends_at_turn_boundary(setup):
    env_cfg, tasks, builder = setup
    prompt_len = len(builder.start(load_first(setup)).ids)
    runner, _ = _runner(setup, ["\\boxed{A}"] * 3, budget=prompt_len + 20)
    (traj,) = runner.run([tasks[0]], group_size=1)
    assert traj.end_reason == "context" and len(traj.turns) == 1
    assert len(traj.tokens.ids) <= prompt_len + 20
    # no feedback message (and no half image span) was appended
    assert traj.messages[-1].role.value == "assistant"
    assert count_images(traj.tokens.ids, builder.image_token_id) == len(traj.tokens.images) == 1


def test_a_prompt_that_fills_the_budget_skips_its_row_without_sampling(setup, qwen25_processor, caplog):
    """A 1000x1000 diagram: round(1000 / 28) = 36 blocks a side, 36 * 36 = 1296 image tokens (Qwen-VL's resize
    rule), inside a prompt of N ids as the processor itself renders it. With max_context_tokens = N the row's three
    episodes end at once (no engine call, no sample), one `SkippedRow` names it with N; at N + 1 it is sampled.
    The runner's log names a row once, however often it comes back."""
    import dataclasses

    from conftest import make_image

    from vlmrl.rollout.skipped_rows import SkippedRow, skipped_rows
    from vlmrl.types import EndReason, ImagePart

    env_cfg, tasks, builder = setup
    big = make_image(1000, 1000)
    task = dataclasses.replace(tasks[0], id="big")
    task.messages = [
        dataclasses.replace(m, content=[ImagePart(big) if isinstance(p, ImagePart) else p for p in m.content])
        for m in task.messages
    ]
    messages = make_env_factory(env_cfg)().reset(task)
    theirs = qwen25_processor.apply_chat_template(
        [m.to_hf() for m in messages],
        tokenize=True,
        return_dict=True,
        add_generation_prompt=True,
        processor_kwargs={"images": [big]},
    )
    ids = list(theirs["input_ids"][0])
    assert ids.count(builder.image_token_id) == 36 * 36
    runner, engine = _runner(setup, ["\\boxed{A}"] * 3, max_turns=1, budget=len(ids))
    trajs = runner.run([task, tasks[1]], group_size=3)
    assert [t.end_reason for t in trajs[:3]] == [EndReason.PROMPT_TOO_LONG] * 3 and not any(t.turns for t in trajs[:3])
    assert all(len(t.turns) == 1 for t in trajs[3:])
    assert [c[1] for c in engine.calls] == [3]  # only the other row's group was sampled
    assert skipped_rows(trajs) == [SkippedRow("big", len(ids), 1)]
    assert to_samples(trajs[:3], ExportStyle.individual, builder.image_token_id) == []
    runner.skipped_log.report(skipped_rows(trajs))
    runner.skipped_log.report(skipped_rows(runner.run([task], group_size=2)))  # the row again: not logged again
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("row big")]
    assert lines == [
        f"row big skipped: its prompt is {len(ids)} tokens (1 image(s)), rollout.max_context_tokens={len(ids)} leaves "
        "no room for a reply; it is not trained on (logged once). Smaller images (model.max_pixels, Qwen-VL "
        "families) or a larger rollout.max_context_tokens make it fit"
    ]
    runner, engine = _runner(setup, ["\\boxed{A}"], max_turns=1, budget=len(ids) + 1)
    (traj,) = runner.run([task], group_size=1)
    assert traj.end_reason is not EndReason.PROMPT_TOO_LONG and len(traj.turns) == 1 and skipped_rows([traj]) == []


def _answers(task):
    """(a wrong choice letter, the right one) for a Geometry3K task."""
    right = task.meta["answer_letter"]
    return ("A" if right != "A" else "B"), right


def load_first(setup):
    env_cfg, tasks, _ = setup
    return make_env_factory(env_cfg)().reset(tasks[0])


def test_exports_concat_and_individual(setup):
    env_cfg, tasks, builder = setup
    wrong = _answers(tasks[0])[0]
    runner, _ = _runner(setup, [f"\\boxed{{{wrong}}}", "no answer", f"\\boxed{{{wrong}}}"])
    (traj,) = runner.run([tasks[0]], group_size=1)
    traj.advantage = 0.5
    (cat,) = to_samples([traj], ExportStyle.concat, builder.image_token_id)
    assert cat.input_ids.tolist() == traj.tokens.ids
    assert int(cat.loss_mask.sum()) == sum(len(t.generation.token_ids) for t in traj.turns)
    assert torch.equal(cat.old_logprobs[cat.loss_mask == 0], torch.zeros(int((cat.loss_mask == 0).sum())))
    indiv = to_samples([traj], ExportStyle.individual, builder.image_token_id)
    assert len(indiv) == 3
    for sample, (start, end), turn in zip(indiv, traj.tokens.turn_spans, traj.turns):
        assert sample.input_ids.tolist() == traj.tokens.ids[:end]
        assert sample.loss_mask.nonzero().flatten().tolist() == list(range(start, end))
        assert sample.advantage == 0.5
        assert sample.vision is not None and sample.vision.image_grid_thw.shape[0] == 1
        n_placeholders = int((sample.input_ids == builder.image_token_id).sum())
        assert n_placeholders == int(sample.vision.image_grid_thw.prod(-1).sum()) // 4
    assert ExportConfig().style is ExportStyle.concat


def test_an_environment_that_raises_costs_its_episode_not_the_run(setup, caplog):
    """A step that raises (a reward function dividing by zero) ends that episode with `env_error` and a NaN turn
    reward, so it leaves its GRPO group and is counted; its group's other episode and the run go on."""
    import math

    from vlmrl.envs import env_config
    from vlmrl.reward import split_unusable

    env_cfg, tasks, builder = setup
    cls = type(make_env_factory(env_cfg)())

    class Raising(cls):  # type: ignore[misc, valid-type]
        def step(self, assistant_text, turn, last_turn):
            if "boom" in assistant_text:
                raise ZeroDivisionError("division by zero")
            return super().step(assistant_text, turn, last_turn)

    typed = env_config(env_cfg)
    engine = ScriptedEngine(builder.tokenizer, ["boom", f"\\boxed{{{tasks[0].meta['answer_value']}}}"])
    limits = EpisodeLimits(max_turns=3, max_context_tokens=4096)
    runner = EpisodeRunner(builder, engine, lambda: Raising(typed), limits, SamplingParams(max_new_tokens=32))
    a, b = runner.run([tasks[0]], group_size=2)
    RewardStage(turn_discount=0.9).score([a, b], tasks[:1])
    assert a.end_reason == "env_error" and len(a.turns) == 1 and math.isnan(a.turns[0].reward)
    assert a.breakdown.unusable == "the environment's step raised"  # type: ignore[union-attr]
    assert b.end_reason == "env_done" and b.reward == pytest.approx(1.0)
    assert split_unusable([a, b])[0] == [b]
    assert "Raising.step raised (ZeroDivisionError: division by zero); the episode is excluded" in caplog.text
