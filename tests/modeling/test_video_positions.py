"""Qwen2-VL / Qwen2.5-VL M-RoPE positions after a video (`vlmrl.modeling.video_positions`) against hand-derived
numbers: the text after a video starts at the video's largest position + 1 (the Qwen reference and vLLM), where
transformers 5.x alone would start it after the spatial extent only."""

from __future__ import annotations

import torch

from vlmrl.modeling.video_positions import use_reference_video_positions


def _ids(text: int, vision: int, after: int, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    types = torch.tensor([[0] * text + [kind] * vision + [0] * after])
    return torch.arange(types.shape[1])[None] + 10, types  # any ids: get_rope_index reads the types and grids


def test_text_after_a_long_video_starts_after_its_last_temporal_position(qwen25_model):
    """Tiny Qwen2.5-VL (tokens_per_second 4, merge 2). A video grid (2, 4, 4) with 1 s per temporal step: 2 x 2 x 2 =
    8 placeholders after 3 text tokens, temporal rows 3, 3, 3, 3, 7, 7, 7, 7 (3 + 4 x 1 s x 4), height 3, 3, 4, 4, ...
    The next text token is at 7 + 1 = 8, then 9; transformers 5.x alone puts it at 3 + max(2, 2) = 5."""
    use_reference_video_positions()
    model = qwen25_model.model
    assert model.config.vision_config.tokens_per_second == 4
    ids, types = _ids(3, 8, 2, kind=2)
    grid, seconds = torch.tensor([[2, 4, 4]]), torch.tensor([1.0])
    positions, deltas = model.get_rope_index(ids, types, video_grid_thw=grid, second_per_grid_ts=seconds)
    assert positions[:, 0].tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 7, 7, 7, 7, 8, 9],
        [0, 1, 2, 3, 3, 4, 4, 3, 3, 4, 4, 8, 9],
        [0, 1, 2, 3, 4, 3, 4, 3, 4, 3, 4, 8, 9],
    ]
    assert deltas.tolist() == [[10 - 13]]  # largest position + 1 - length
    original = type(model).get_rope_index.__wrapped__
    before, _ = original(model, ids, types, video_grid_thw=grid, second_per_grid_ts=seconds)
    assert before[0, 0, -2:].tolist() == [5, 6]  # what the wrapper corrects


def test_images_and_short_videos_keep_transformers_positions(qwen25_model):
    """An image (grid 1, 4, 4) and a video whose temporal positions stay inside its spatial extent (grid 2, 4, 4 at
    0.25 s a step: temporal 0, 1): positions exactly as transformers computes them."""
    use_reference_video_positions()
    model = qwen25_model.model
    original = type(model).get_rope_index.__wrapped__
    ids, types = _ids(3, 4, 2, kind=1)
    image = {"image_grid_thw": torch.tensor([[1, 4, 4]])}
    assert torch.equal(model.get_rope_index(ids, types, **image)[0], original(model, ids, types, **image)[0])
    ids, types = _ids(3, 8, 2, kind=2)
    short = {"video_grid_thw": torch.tensor([[2, 4, 4]]), "second_per_grid_ts": torch.tensor([0.25])}
    assert torch.equal(model.get_rope_index(ids, types, **short)[0], original(model, ids, types, **short)[0])
