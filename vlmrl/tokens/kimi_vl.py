"""Continuous tokens for Kimi-VL (`kimi_vl`: Kimi-VL-A3B-Instruct / -Thinking, MoonViT + Moonlight).

Format: `<|im_system|>system<|im_middle|>…<|im_end|><|im_user|>user<|im_middle|>…<|im_end|><|im_assistant|>assistant
<|im_middle|>…<|im_end|>`; an image is `<|media_start|>image<|media_content|><|media_pad|><|media_end|>`, the single
`<|media_pad|>` expanded by the processor to (h/14 · w/14) / (2·2) placeholders for its patch grid (h, w). Without a
system message the template writes a default one ("You are a helpful assistant"). Its tool role has no opener token:
a tool message renders as `tool<|im_middle|>…<|im_end|>` (kept as the template writes it).

Boundary rules (class data, `TemplateBuilder`): an assistant turn ends with `<|im_end|>`, generation stops on it (kept,
mask 1) and nothing follows it in the template (`after_assistant_text = ""`): no insertion after an EOS stop; after a
stop string / the length limit `<|im_end|>` is inserted (mask 0, recorded). The Thinking model's `◁think▷…◁/think▷`
blocks are ordinary text that the template keeps in history: prefix-preserving (`EXTENDS`).

Format-only here: the real tokenizer (tiktoken, remote code) is not available offline; `KimiVLFormatProcessor` and
`KimiVLImageProcessorSketch` implement the documented format and image rule for the offline checks. With a real
checkpoint use `load_processor(path)` (its remote-code processor, `trust_remote_code=True`): the builder reads
`image_grid_hws` and `merge_kernel_size` from it the same way.
Images: pixel_values [sum of patches, 3, 14, 14]; grid rows (1, h, w) (Kimi's `image_grid_hws` with t = 1). The
builder takes the processor's steps itself (`ImageStepsBuilder`): each image object is processed once per trajectory.
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
import torch
from PIL import Image

from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.image_steps import ImageStepsBuilder
from vlmrl.types import VisionInputs


def load_processor(path: str, **kwargs: Any):
    """The processor of a real Kimi-VL checkpoint (remote code: loaded with `trust_remote_code=True`)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, trust_remote_code=True, **kwargs)


class KimiVLImageProcessorSketch:
    """Kimi-VL's image rule (MoonViT, native resolution), for the offline checks.

    An image whose (w//14)·(h//14) patches exceed `in_token_limit` is scaled down by sqrt(limit / patches) (bicubic);
    then padded at the bottom/right with black to multiples of patch_size·merge_kernel_size (28) (`pad_input`, else
    center-cropped down to them), normalized with mean/std, and cut into 14×14 patches in row-major order.
    Returns {"pixel_values": [patches, 3, 14, 14], "image_grid_hws": [images, 2]}; an image gives
    (h/14)·(w/14)/4 placeholder tokens. Values: patch 14, merge 2×2, in_token_limit 4096, pad_input on, mean/std 0.5
    (believed to be Kimi-VL-A3B-Instruct's preprocessor_config; unverified offline).
    """

    def __init__(
        self,
        patch_size: int = 14,
        merge_kernel_size: tuple[int, int] = (2, 2),
        in_token_limit: int = 4096,
        pad_input: bool = True,
        image_mean: tuple[float, ...] = (0.5, 0.5, 0.5),
        image_std: tuple[float, ...] = (0.5, 0.5, 0.5),
    ):
        self.patch_size = patch_size
        self.merge_kernel_size = list(merge_kernel_size)
        self.in_token_limit = in_token_limit
        self.pad_input = pad_input
        self.image_mean = image_mean
        self.image_std = image_std

    def _resize_pad(self, image: Image.Image) -> Image.Image:
        p = self.patch_size
        image = image.convert("RGB")
        w, h = image.size
        if (w // p) * (h // p) > self.in_token_limit:
            scale = math.sqrt(self.in_token_limit / ((w // p) * (h // p)))
            image = image.resize((int(w * scale), int(h * scale)), Image.Resampling.BICUBIC)
        w, h = image.size
        mh, mw = self.merge_kernel_size[0] * p, self.merge_kernel_size[1] * p
        if self.pad_input:
            canvas = Image.new("RGB", (w + (mw - w % mw) % mw, h + (mh - h % mh) % mh), (0, 0, 0))
            canvas.paste(image, (0, 0))
            return canvas
        nw, nh = w - w % mw, h - h % mh
        left, top = (w - nw) // 2, (h - nh) // 2
        return image.crop((left, top, left + nw, top + nh))

    def __call__(self, images: list, return_tensors: str | None = "pt", **_: Any) -> dict:
        p = self.patch_size
        patches, grids = [], []
        for image in images:
            arr: np.ndarray = np.asarray(self._resize_pad(image), dtype=np.float32) / 255.0  # [H, W, 3]
            arr = (arr - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
            hh, ww = arr.shape[0] // p, arr.shape[1] // p
            cut = arr.reshape(hh, p, ww, p, 3).transpose(0, 2, 4, 1, 3).reshape(hh * ww, 3, p, p)
            patches.append(torch.from_numpy(np.ascontiguousarray(cut)))
            grids.append([hh, ww])
        return {"pixel_values": torch.cat(patches), "image_grid_hws": torch.tensor(grids, dtype=torch.long)}


class KimiVLFormatProcessor:
    """A Kimi-VL processor for the offline checks: chat template rendering, `<|media_pad|>` expansion by each image's
    grid, tokenization — the interface of the real remote-code `KimiVLProcessor` the builder uses."""

    image_token = "<|media_pad|>"

    def __init__(self, image_processor: KimiVLImageProcessorSketch, tokenizer: Any, chat_template: str):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def apply_chat_template(
        self,
        conversation: list[dict],
        tools: list[dict] | None = None,
        tokenize: bool = False,
        return_dict: bool = False,
        return_tensors: str | None = None,
        add_generation_prompt: bool = False,
        processor_kwargs: dict | None = None,
        **kwargs: Any,
    ):
        text = self.tokenizer.apply_chat_template(
            conversation,
            chat_template=self.chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        if not tokenize:
            return text
        images = (processor_kwargs or {}).get("images")
        return self(text=[text], images=images, return_tensors=return_tensors)

    def __call__(
        self,
        text: list[str] | str,
        images: list | None = None,
        return_tensors: str | None = "pt",
        add_special_tokens: bool | None = None,
        **_: Any,
    ) -> dict:
        texts = [text] if isinstance(text, str) else list(text)
        flat = [im for item in (images or []) for im in (item if isinstance(item, (list, tuple)) else [item])]
        out: dict = {}
        if flat:
            out.update(self.image_processor(flat, return_tensors="pt"))
            merge = math.prod(self.image_processor.merge_kernel_size)
            counts = iter((out["image_grid_hws"].prod(-1) // merge).tolist())
            texts = [
                "".join(
                    piece if i == 0 else self.image_token * int(next(counts)) + piece
                    for i, piece in enumerate(t.split(self.image_token))
                )
                for t in texts
            ]
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        ids = [self.tokenizer(t, **kwargs)["input_ids"] for t in texts]
        out["input_ids"] = torch.tensor(ids) if len({len(x) for x in ids}) == 1 else ids
        return out


class KimiVLBuilder(ImageStepsBuilder):
    family = "kimi_vl"
    prefix_mode = PrefixMode.EXTENDS
    close_turn_token = "<|im_end|>"
    after_assistant_text = ""
    after_assistant_inserted = True
    image_token = "<|media_pad|>"
    stop_tokens = ("[EOS]",)  # generation also stops on `[EOS]` (`<|im_end|>` ends a turn)

    def _batch_images(self, images: list) -> list | None:
        """A flat image list (Kimi-VL's remote-code processor takes no nested batch)."""
        return list(images) or None

    def _vision(self, out: Any, n_images: int) -> VisionInputs | None:
        if not n_images:
            return None
        hws = out["image_grid_hws"]
        return VisionInputs(out["pixel_values"], torch.cat([torch.ones_like(hws[:, :1]), hws], dim=-1))

    def _process_images(self, images: list) -> VisionInputs:
        """New, distinct `images` through the image processor (`image_grid_hws`), in the builder's layout."""
        return cast(
            VisionInputs, self._vision(self.processor.image_processor(images, return_tensors="pt"), len(images))
        )

    def _expansions(self, vision: VisionInputs) -> list[str]:
        """`<|media_pad|>` repeated (h · w) / prod(merge_kernel_size) times per image (the processor's rule)."""
        merge = math.prod(self.processor.image_processor.merge_kernel_size)
        return [self.processor.image_token * (h * w // merge) for _, h, w in vision.image_grid_thw.tolist()]

    def image_features(self, vision: VisionInputs | None) -> int:
        """(h · w) / prod(merge_kernel_size) per image, summed."""
        if vision is None:
            return 0
        merge = math.prod(self.processor.image_processor.merge_kernel_size)
        return int((vision.image_grid_thw.prod(-1) // merge).sum())
