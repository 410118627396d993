"""DAPO overlong handling and dynamic sampling, per-turn advantages: hand-derived numbers on tiny trajectories, and
the data position of dynamic sampling across a resume (end to end, in process)."""

from __future__ import annotations

import json

import pytest
from conftest import GEOMETRY3K

from vlmrl.config import ConfigError, ExportStyle, load
from vlmrl.export import to_samples
from vlmrl.reward.stage import Overlong, RewardStage
from vlmrl.rewards import length_penalty
from vlmrl.train.advantages import AdvantageEstimator, Advantages, assign_advantages
from vlmrl.train.dynamic_sampling import sample_until_full, split_groups
from vlmrl.train.overlong import overlong_metrics
from vlmrl.train.turn_advantages import reward_to_go, trajectory_turn_advantages, turn_advantages
from vlmrl.types import Generation, StopReason, Task, TokenSeq, Trajectory, Turn

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")


def _traj(turns: list[tuple[int, StopReason, float]], group: int = 0, reward: float = 0.0) -> Trajectory:
    """A trajectory with a 2-token prompt and, per turn, `n` sampled tokens then a 1-token observation (mask 0)."""
    seq, out = TokenSeq(), []
    seq.append([1, 2], 0)
    for n, stop, r in turns:
        start = len(seq.ids)
        seq.append(list(range(10, 10 + n)), 1, [-0.5] * n)
        seq.turn_spans.append((start, start + n))
        seq.append([3], 0)
        out.append(
            Turn(
                Generation(list(range(10, 10 + n)), [-0.5] * n, stop, ""),
                r,
                {"correct": float(r > 0), "formatted": 1.0},
            )
        )
    return Trajectory("t", group, [], seq, out, reward=reward)


# ------------------------------------------------------------------------------------------------------ overlong


def test_soft_overlong_penalty_dapo_eq13():
    """DAPO (Yu et al. 2025) eq. (13), L_max = 20, L_cache = 4: 0 up to 16 tokens, then (16 - |y|) / 4, -1 beyond."""
    assert [length_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20, 21)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert length_penalty(18, 20, 4, factor=0.5) == -0.25 and length_penalty(20, 20, 0) == 0.0  # factor; off
    # episode reward = max_t r_t * 0.95**t + its turns' penalties: turns of 17 and 20 tokens -> 0.9 * 0.95 - 0.25 - 1.0;
    # one of 10 -> 1.0
    trajs = [_traj([(17, StopReason.EOS, 0.0), (20, StopReason.LENGTH, 0.9)]), _traj([(10, StopReason.EOS, 1.0)])]
    RewardStage(turn_discount=0.95, overlong=Overlong(20, 4, 1.0)).score(trajs, [])
    pens = [[t.penalty for t in traj.breakdown.turns] for traj in trajs]  # type: ignore[union-attr]
    assert pens == [[-0.25, -1.0], [0.0]] and [t.reward for t in trajs] == pytest.approx([0.855 - 1.25, 1.0])
    assert overlong_metrics(trajs, True, filtered=False) == {"overlong_penalty_mean": pytest.approx(-1.25 / 2)}


def test_overlong_filter_masks_only_truncated_turns():
    """DAPO overlong filtering: loss mask 0 on the turn cut at the budget (stop reason length), per turn."""
    traj = _traj([(3, StopReason.LENGTH, 0.0), (2, StopReason.EOS, 1.0)])
    # ids: [1 2 | 10 11 12 | 3 | 10 11 | 3], turn spans (2, 5) and (6, 8)
    (concat,) = to_samples([traj], ExportStyle.concat, image_token_id=999, mask_truncated=True)
    assert concat.loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 0]
    (plain,) = to_samples([traj], ExportStyle.concat, image_token_id=999)
    assert plain.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 1, 1, 0]
    first, second = to_samples([traj], ExportStyle.individual, image_token_id=999, mask_truncated=True)
    assert first.loss_mask.sum() == 0 and second.loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    # 3 of the 5 sampled tokens were masked
    assert overlong_metrics([traj], False, filtered=True) == {"overlong_masked_frac": pytest.approx(3 / 5)}


# ------------------------------------------------------------------------------------------- per-turn advantages


def test_turn_advantages_by_hand():
    """GRPO with process supervision (Shao et al. 2024, DeepSeekMath sec. 4.1.3), steps = turns, discounted.

    Group 0: episode A turn rewards [0.1, 1.0], episode B [0.0]; gamma = 0.5. Pooled R = {0.1, 1.0, 0.0},
    mean 1.1/3 = 11/30. Without std scaling r~ = r - 11/30: A: [-8/30, 19/30], B: [-11/30].
    Reward-to-go: A_0 = -8/30 + 0.5 * 19/30 = 1.5/30 = 0.05, A_1 = 19/30; B_0 = -11/30.
    With std scaling: sample std of R = sqrt(((8/30)^2 + (19/30)^2 + (11/30)^2) / 2) = sqrt(546/1800) = 0.550757,
    so every r~ is divided by it (+1e-6), and so is every reward-to-go.
    Group 1: one episode [0.3, 0.3]: equal rewards, advantages 0.
    """
    assert reward_to_go([1.0, 2.0, 4.0], 0.5) == [1.0 + 0.5 * 2 + 0.25 * 4, 2.0 + 0.5 * 4, 4.0]
    got = turn_advantages([[0.1, 1.0], [0.0], [0.3, 0.3]], [0, 0, 1], gamma=0.5, scale_by_std=False)
    assert got[0] == pytest.approx([0.05, 19 / 30]) and got[1] == pytest.approx([-11 / 30]) and got[2] == [0.0, 0.0]
    std = (546 / 1800) ** 0.5
    assert std == pytest.approx(0.550757, abs=1e-6)
    scaled = turn_advantages([[0.1, 1.0], [0.0]], [0, 0], gamma=0.5, scale_by_std=True)
    assert scaled[0] == pytest.approx([0.05 / (std + 1e-6), 19 / 30 / (std + 1e-6)])
    assert scaled[1] == pytest.approx([-11 / 30 / (std + 1e-6)])


def test_turn_advantages_reach_individual_samples():
    a = _traj([(2, StopReason.EOS, 0.1), (2, StopReason.EOS, 1.0)])
    b = _traj([(2, StopReason.EOS, 0.0)])
    out = trajectory_turn_advantages([a, b], gamma=0.5, scale_by_std=False)
    assert (a.advantage, a.turn_advantages, b.turn_advantages) == (0.0, [], [])  # pure: nothing written
    estimator = AdvantageEstimator("turn", lambda cfg, trajs: out, per_turn=True)
    assign_advantages(estimator, None, [a, b])  # type: ignore[arg-type]
    samples = to_samples([a, b], ExportStyle.individual, image_token_id=999)
    assert [s.advantage for s in samples] == pytest.approx([0.05, 19 / 30, -11 / 30])
    assert a.advantage == pytest.approx(0.05)  # the trajectory's advantage is its first turn's
    # the overlong penalty goes into its own turn's reward: A's 3-token turn 1 gets (2 - 3) / 1 * 0.2 = -0.2 (L_max 3,
    # L_cache 1, factor 0.2), the 2-token turns none -> R = {0.1, 0.8, 0.0}, mean 0.3, r~ A = [-0.2, 0.5], B = [-0.3];
    # A_0 = -0.2 + 0.5 * 0.5 = 0.05, A_1 = 0.5
    a, b = _traj([(2, StopReason.EOS, 0.1), (3, StopReason.EOS, 1.0)]), _traj([(2, StopReason.EOS, 0.0)])
    RewardStage(turn_discount=0.5, overlong=Overlong(3, 1, 0.2)).score([a, b], [])
    out = trajectory_turn_advantages([a, b], gamma=0.5, scale_by_std=False)
    assert out.turns[0] == pytest.approx([0.05, 0.5]) and out.turns[1] == pytest.approx([-0.3])


def test_an_estimator_that_writes_instead_of_returning_is_one_line_naming_it():
    """Estimators are pure: one that returns None (the old in-place form) or the wrong count is a TypeError naming
    it, and nothing is written."""
    a, b = _traj([(2, StopReason.EOS, 0.1)]), _traj([(2, StopReason.EOS, 0.0)])

    def in_place(cfg, trajs):
        for t in trajs:
            t.reward += 0.0

    for fn, needle in [(in_place, "returned NoneType"), (lambda c, t: Advantages([1.0]), "1 advantages for 2")]:
        with pytest.raises(TypeError, match=needle) as err:
            assign_advantages(AdvantageEstimator("mine", fn), None, [a, b])  # type: ignore[arg-type]
        assert str(err.value).startswith("advantage estimator 'mine' (") and (a.advantage, b.advantage) == (0.0, 0.0)


def test_turn_advantages_need_individual_export():
    with pytest.raises(ConfigError, match="export.style=individual"):
        load("geometry3k_tiny", ["algorithm.advantage=turn"])
    assert load("geometry3k_tiny", ["algorithm.advantage=turn", "export=individual"]).algorithm.advantage == "turn"


# ----------------------------------------------------------------------------------------------- dynamic sampling


def _round_of(rewards_by_round: list[list[list[float]]], log: list[int]):
    """A fake rollout round: round r gives one group per reward list (episodes with those rewards)."""

    def run_round(start: int):
        log.append(start)
        r = len(log) - 1
        groups = rewards_by_round[r]
        trajs = [_traj([(1, StopReason.EOS, x)], group=g, reward=x) for g, rs in enumerate(groups) for x in rs]
        return [Task(f"p{start + g}", [], "") for g in range(len(groups))], trajs

    return run_round


def test_dynamic_sampling_by_hand():
    """DAPO (Yu et al. 2025) sec. 3.2: batch_size 3 groups; round 1 (prompts 10-12): groups [0, 0] and [1, 1] are
    all-equal (dropped), [0, 1] kept; round 2 (13-15): [1, 0] and [0.5, 0] kept, [0.2, 0.2] dropped -> 3 kept:
    stop after 2 rounds, 6 prompts consumed, 3 dropped. Group ids are renumbered per round (+3 in round 2)."""
    assert [
        len(x) for x in split_groups([_traj([], 0, 1.0), _traj([], 0, 1.0), _traj([], 1, 0.0), _traj([], 1, 1.0)])
    ] == [1, 1]
    log: list[int] = []
    rounds = [[[0, 0], [1, 1], [0, 1]], [[1, 0], [0.2, 0.2], [0.5, 0]], [[0, 1]] * 3]
    out = sample_until_full(_round_of(rounds, log), start=10, batch_size=3, max_rounds=4, gather=lambda n: [n])
    assert log == [10, 13] and out.rounds == 2 and out.prompts == 6
    assert (out.groups_kept, out.groups_dropped) == (3, 3) and len(out.generated) == 12
    assert [t.group for t in out.kept] == [2, 2, 3, 3, 5, 5] and [t.reward for t in out.kept[:2]] == [0, 1]
    assert [t.id for t in out.tasks] == ["p10", "p11", "p12", "p13", "p14", "p15"] and not out.fill_only
    assert out.metrics() == {"dynamic_rounds": 2.0, "dynamic_groups_kept": 3.0, "dynamic_groups_dropped": 3.0}
    # too many kept in the last round: cut to batch_size in (round, rank, group) order; 2 kept + 3 new -> 1 cut
    log = []
    out = sample_until_full(_round_of([[[0, 1], [1, 1], [0, 1]], [[1, 0]] * 3], log), 0, 4, 4, lambda n: [n])
    assert out.rounds == 2 and out.groups_kept == 4 and out.groups_dropped == 1 + 1
    assert [t.group for t in out.kept][::2] == [0, 2, 4, 5]
    # nothing informative within max_rounds: train on the last round (advantages 0), as without dynamic sampling
    log = []
    out = sample_until_full(_round_of([[[0, 0]], [[1, 1]]], log), 0, 1, 2, lambda n: [n])
    assert log == [0, 1] and out.groups_kept == 0 and out.groups_dropped == 2 and [t.reward for t in out.kept] == [1, 1]


def test_dynamic_sampling_allots_over_ranks():
    """Two ranks, batch_size 3: rank 0 keeps 2 groups and rank 1 keeps 2 in round 1 -> total 4 >= 3, one round.
    The (round, rank, group) order keeps rank 0's 2 and rank 1's first 1. A rank that kept nothing while others
    did trains its last round as filler (fill_only)."""
    counts = {0: 2, 1: 2}
    rank1 = sample_until_full(_round_of([[[0, 1], [1, 0], [1, 1]]], []), 0, 3, 4, lambda n: [counts[0], n], rank=1)
    assert rank1.rounds == 1 and [t.group for t in rank1.kept] == [0, 0] and rank1.groups_kept == 3
    alone = sample_until_full(_round_of([[[1, 1]]], []), 0, 3, 4, lambda n: [3, n], rank=1)
    assert alone.fill_only and alone.rounds == 1 and len(alone.kept) == 2


@pytest.mark.slow
def test_dynamic_sampling_resume_continues_from_the_recorded_data_position(tmp_path):
    """The random tiny model never earns a Geometry3K reward, so every group is equal and every step runs all
    max_sampling_rounds=2 rounds: the data position after 2 steps is 8 prompts, not steps * batch_size = 4. A 2-step
    run resumed to 3 steps gives the same step-3 prompts and rollouts as an uninterrupted 3-step run; state.json
    records the prompts consumed."""
    from vlmrl.run import train
    from vlmrl.runs import checkpoint

    args = [
        f"data.path={GEOMETRY3K}",
        "data.limit=6",
        "trainer.batch_size=2",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=4",
        "env.max_turns=1",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_sampling_rounds=2",
        "trainer.align_every=0",
        "logging.progress=false",
    ]

    def cfg(out, steps):
        return load("geometry3k_tiny", [*args, f"logging.output_dir={out}", f"trainer.steps={steps}"])

    train(cfg(tmp_path / "full", 3))
    train(cfg(tmp_path / "resumed", 2))
    state = checkpoint.read_state(tmp_path / "resumed" / "checkpoints" / "step_2")
    rows = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert state["data"]["prompts_done"] == 2 * sum(r["dynamic_rounds"] for r in rows) == 8  # 2 prompts per round
    train(cfg(tmp_path / "resumed", 3))
    full = [json.loads(x) for x in (tmp_path / "full" / "trajectories.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (tmp_path / "resumed" / "trajectories.jsonl").read_text().splitlines()]
    assert resumed == full and {r["step"] for r in full} == {1, 2, 3}
    full_rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    print(
        "dynamic sampling rows:",
        [(r["step"], r["dynamic_rounds"], r["dynamic_groups_kept"], r["dynamic_groups_dropped"]) for r in full_rows],
    )
    assert [r["dynamic_groups_dropped"] for r in full_rows] == [4, 4, 4]  # 2 rounds of 2 equal groups per step
    # step 3's prompts are those at data position 8 of the shuffled data (8 mod 6 = 2, 3), then 10 (4, 5)
    step3 = [r["task_id"] for r in full if r["step"] == 3][::2]  # 2 episodes per group
    step1 = [r["task_id"] for r in full if r["step"] == 1][::2]  # positions 0, 1, 2, 3
    assert step3[:2] == step1[2:4]
    final = checkpoint.read_state(tmp_path / "full" / "checkpoints" / "step_3")
    assert final["data"]["prompts_done"] == 2 * sum(r["dynamic_rounds"] for r in full_rows)
