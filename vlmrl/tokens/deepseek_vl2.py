"""Continuous tokens for DeepSeek-VL2 (`deepseek_vl2`, HF model_type `deepseek_vl_v2`): no jinja template — its
processor (`DeepseekVLV2Processor` in deepseek-ai/DeepSeek-VL2, Python) formats and tokenizes conversations.

The format (the processor's `format_messages_v2` with the "deepseek" conversation template), rendered here in Python:

    <bos> [system text] <|User|>: {user text}\\n\\n<|Assistant|>:{reply}<eos><|User|>: {user text}\\n\\n<|Assistant|>:…

- the BOS opens the sequence; a system message (first only) is its text right after BOS, no separator;
- a user turn is `<|User|>: ` + its text (stripped) + `\\n\\n<|Assistant|>:` — it always ends with the assistant
  opener, so every prompt is already a generation prompt (`add_generation_prompt` changes nothing);
- an assistant reply is its text (stripped, tokenized on its own) + `<｜end▁of▁sentence｜>`; nothing else follows;
- each message part is tokenized on its own (text between images, each turn), as the processor does;
- `<image>` marks an image in the text (an image part renders as `<image>\\n`); DeepSeek-VL2 has no tool role: tool
  results are user turns, and consecutive non-assistant messages are merged into one user turn (joined by `\\n`).

Boundary rules (class data): generation stops at `<｜end▁of▁sentence｜>` (kept, mask 1); nothing is inserted after it.
After a stop string / the length limit the EOS is inserted (mask 0, recorded). Prefix-preserving (`EXTENDS`) while
an episode holds at most `max_cropped_images` (2) images (see below).

Images (the processor's token-count rule, `tokenize_with_images`): tiles of `image_size` = 384 px; a global view (the
image padded to 384×384) plus local tiles of the candidate resolution that best fits the image (padded to it and cut
into nh×nw tiles) when cropping, else one local tile. With h = w = ceil((384 // patch_size 14) / downsample_ratio 2)
= 14 query rows/columns per tile, one image is
    h·(w + 1)  [global view, a newline token per row]  + 1  [view separator]  + (nh·h)·(nw·w + 1)  [local views]
`<image>` tokens (421 for a single local tile). The processor crops only when the whole conversation holds ≤ 2
images: a third image makes it re-tile every earlier image (not prefix-preserving). `cropping=None` (default) follows
that rule as images arrive (earlier images keep the tiling the model saw; a warning is logged when the rule would
re-tile them); `cropping=True/False` fixes it for the run, and `render_full` uses the same fixed value.
Vision layout: pixel_values [tiles, 3, 384, 384] (per image: global view, then local tiles row-major); grid rows
(1, nh, nw).

Format-only here: no DeepSeek tokenizer offline (`vlmrl.tokens.synthetic`, special ids real) and the processor is
`DeepseekVL2FormatProcessor` below (same attributes/methods as the real one). With a real checkpoint pass the real
`DeepseekVLV2Processor` (`load_processor(path)`): the builder uses its tokenizer, `encode` and `tokenize_with_images`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, cast

import numpy as np
import torch
from PIL import Image, ImageOps

from vlmrl.tokens.base import Piece, PrefixMode, Rendered, TokenBuilder
from vlmrl.types import ImagePart, Message, Role, TokenSeq, VisionInputs

log = logging.getLogger(__name__)

# DeepSeek-VL2's processor_config candidate resolutions (width, height), multiples of 384 up to 9 tiles
CANDIDATE_RESOLUTIONS: tuple[tuple[int, int], ...] = (
    (384, 384),
    (384, 768),
    (768, 384),
    (384, 1152),
    (1152, 384),
    (384, 1536),
    (1536, 384),
    (768, 768),
    (384, 1920),
    (1920, 384),
    (384, 2304),
    (2304, 384),
    (768, 1152),
    (1152, 768),
    (384, 2688),
    (2688, 384),
    (384, 3072),
    (3072, 384),
    (768, 1536),
    (1536, 768),
    (384, 3456),
    (3456, 384),
    (1152, 1152),
)


def load_processor(path: str, **kwargs: Any):
    """The real `DeepseekVLV2Processor` of a checkpoint (needs the `deepseek_vl2` package from deepseek-ai/DeepSeek-VL2;
    transformers has no DeepSeek-VL2 processor).
    Raises ImportError naming the package when `deepseek_vl2` is not installed."""
    try:
        from deepseek_vl2.models import DeepseekVLV2Processor
    except ImportError as exc:  # pragma: no cover - depends on an optional package
        raise ImportError(
            "DeepSeek-VL2's processor is Python code in github.com/deepseek-ai/DeepSeek-VL2: install it "
            "(pip install git+https://github.com/deepseek-ai/DeepSeek-VL2) to load a checkpoint"
        ) from exc
    return DeepseekVLV2Processor.from_pretrained(path, **kwargs)


def select_best_resolution(size: tuple[int, int], candidates) -> tuple[int, int]:
    """The candidate (width, height) that keeps the most of the image's resolution, then wastes the least."""
    ow, oh = size
    best, best_eff, best_waste = None, 0, float("inf")
    for w, h in candidates:
        scale = min(w / ow, h / oh)
        eff = min(int(ow * scale) * int(oh * scale), ow * oh)
        waste = w * h - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (w, h), eff, waste
    return cast("tuple[int, int]", best)  # None only for no candidates


class DeepseekVL2FormatProcessor:
    """DeepSeek-VL2's processor for the offline checks: the attributes and the `encode` / `tokenize_with_images`
    methods of deepseek_vl2's `DeepseekVLV2Processor` that the builder uses, implemented from its documented rule."""

    def __init__(
        self,
        tokenizer: Any,
        candidate_resolutions=CANDIDATE_RESOLUTIONS,
        patch_size: int = 14,
        downsample_ratio: int = 2,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        image_token: str = "<image>",
    ):
        self.tokenizer = tokenizer
        self.candidate_resolutions = tuple(tuple(c) for c in candidate_resolutions)
        self.image_size = self.candidate_resolutions[0][0]
        self.patch_size = patch_size
        self.downsample_ratio = downsample_ratio
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def _tensor(self, image: Image.Image) -> torch.Tensor:
        arr: np.ndarray = np.asarray(image, dtype=np.float32) / 255.0
        arr = (arr - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))

    def tokenize_with_images(
        self, conversation: str, images: list, bos: bool = True, eos: bool = True, cropping: bool = True
    ):
        """(ids, tiles, images_seq_mask, images_spatial_crop [[nw, nh]], num_image_tokens) for `conversation` whose
        `<image>` tags are `images` in order; text between images tokenized piece by piece.
        Raises ValueError when the number of image tags is not the number of images."""
        splits = conversation.split(self.image_token)
        if len(splits) - 1 != len(images):
            raise ValueError(f"{len(splits) - 1} {self.image_token} tags in the text but {len(images)} images")
        size = self.image_size
        fill = tuple(int(x * 255) for x in self.image_mean)
        q = math.ceil((size // self.patch_size) / self.downsample_ratio)
        ids, tiles, mask, crops, counts = [], [], [], [], []
        for text, image in zip(splits, images):
            part = self.encode(text, bos=False, eos=False)
            ids += part
            mask += [False] * len(part)
            image = image.convert("RGB")
            best_w, best_h = (
                select_best_resolution(image.size, self.candidate_resolutions) if cropping else (size, size)
            )
            tiles.append(self._tensor(ImageOps.pad(image, (size, size), color=fill)))
            local = ImageOps.pad(image, (best_w, best_h), color=fill)
            for top in range(0, best_h, size):
                for left in range(0, best_w, size):
                    tiles.append(self._tensor(local.crop((left, top, left + size, top + size))))
            nw, nh = best_w // size, best_h // size
            crops.append([nw, nh])
            n = q * (q + 1) + 1 + (nh * q) * (nw * q + 1)
            ids += [self.image_token_id] * n
            mask += [True] * n
            counts.append(n)
        part = self.encode(splits[-1], bos=False, eos=False)
        ids += part
        mask += [False] * len(part)
        if bos:
            ids, mask = [self.bos_id] + ids, [False] + mask
        if eos:
            ids, mask = ids + [self.eos_id], mask + [False]
        return ids, tiles, mask, crops, counts


class DeepseekVL2Builder(TokenBuilder):
    """Token builder for DeepSeek-VL2 around its processor (real `DeepseekVLV2Processor` or the offline stand-in).

    cropping: None = the processor's rule (tile images while the episode holds ≤ 2), True/False = fixed for the run.
    tools: accepted and ignored (DeepSeek-VL2 has no tool format).
    """

    family = "deepseek_vl2"
    prefix_mode = PrefixMode.EXTENDS
    # --- format / boundary data ---
    user_role, assistant_role = "<|User|>", "<|Assistant|>"
    user_sep = "\n\n"  # after a user message's text (the conversation template's sep)
    close_turn_token = "<｜end▁of▁sentence｜>"  # appended after every reply; generation stops on it
    after_assistant_ids: tuple[int, ...] = ()  # nothing follows it: the next user turn starts right away
    image_token = "<image>"
    image_text = "<image>\n"  # how an image part is written into a message's text
    max_cropped_images = 2

    def __init__(
        self, processor: Any, family: str | None = None, cropping: bool | None = None, tools: list[dict] | None = None
    ):
        """Raises ValueError for a family it does not build, a tokenizer without `<image>` / the EOS as single
        tokens, or an EOS that is not the processor's `eos_id`."""
        super().__init__(processor, family)
        self.cropping = cropping
        if self.close_turn_id != processor.eos_id:
            raise ValueError(f"deepseek_vl2: {self.close_turn_token!r} is not the tokenizer's EOS")
        self._warned = False

    def image_features(self, vision: VisionInputs | None) -> int:
        """`<image>` tokens for `vision` (grid rows (1, nh, nw)): h·(w+1) + 1 + (nh·h)·(nw·w+1) per image."""
        if vision is None:
            return 0
        p = self.processor
        q = math.ceil((p.image_size // p.patch_size) / p.downsample_ratio)
        return int(sum(q * (q + 1) + 1 + (nh * q) * (nw * q + 1) for _, nh, nw in vision.image_grid_thw.tolist()))

    # --- format --------------------------------------------------------------------------------------------------
    def _text(self, m: Message) -> str:
        if m.videos:
            raise ValueError(f"{self.family} takes no video input")
        return "".join(self.image_text if isinstance(p, ImagePart) else p.text for p in m.content)  # type: ignore[union-attr]

    def _turns(self, messages: list[Message]) -> list[tuple[str, str, list]]:
        """(role, text, images) per turn: system (first only), user (consecutive non-assistant messages merged,
        tool results included), assistant."""
        turns: list[tuple[str, str, list]] = []
        for k, m in enumerate(messages):
            if m.role == Role.SYSTEM:
                if k:
                    raise ValueError("deepseek_vl2: a system message must come first")
                turns.append(("system", m.text_content, []))
            elif m.role == Role.ASSISTANT:
                if m.images:
                    raise ValueError("deepseek_vl2: an assistant message cannot hold images")
                turns.append(("assistant", m.text_content, []))
            elif turns and turns[-1][0] == "user":
                role, text, images = turns[-1]
                turns[-1] = (role, text + "\n" + self._text(m), images + m.images)
            else:
                turns.append(("user", self._text(m), list(m.images)))
        return turns

    def _crop(self, n_images: int) -> bool:
        return self.cropping if self.cropping is not None else n_images <= self.max_cropped_images

    def _user(self, text: str, images: list, cropping: bool) -> tuple[list[int], VisionInputs | None]:
        prompt = f"{self.user_role}: {text.strip()}{self.user_sep}{self.assistant_role}:"
        ids, tiles, _, crops, _ = self.processor.tokenize_with_images(
            prompt, images, bos=False, eos=False, cropping=cropping
        )
        vision = None
        if images:
            grid = torch.tensor([[1, nh, nw] for nw, nh in crops], dtype=torch.long)
            vision = VisionInputs(torch.stack(list(tiles)), grid)
        return list(ids), vision

    def _reply(self, text: str) -> list[int]:
        return self.processor.encode(text.strip(), bos=False, eos=True)

    # --- TokenBuilder --------------------------------------------------------------------------------------------
    def start(self, messages: list[Message], carried: dict | None = None) -> TokenSeq:
        """BOS + the first messages (system text, user turn ending `<|Assistant|>:`); images processed once
        (`carried` is not used: this family processes each message's images with the message).

        Raises ValueError when the messages do not end with a user (or tool) message, a system message is not first,
        an assistant message holds images, or `<image>` tags do not match the images. The control-token guard never
        raises.
        """
        turns = self._turns(messages)
        if not turns or turns[-1][0] != "user":
            raise ValueError("start() needs messages ending with a user (or tool) message")
        seq = TokenSeq()
        seq.append([self.processor.bos_id], mask=0)
        n = 0
        for role, text, images in turns:
            if role == "system":
                seq.append(self.processor.encode(text.strip(), bos=False, eos=False), mask=0)
            elif role == "assistant":
                seq.append(self._reply(text), mask=0)
            else:
                n += len(images)
                ids, vision = self._user(text, images, self._crop(n))
                self.extend(seq, Piece(ids=ids, images=list(images), vision=vision))
        return seq

    def render_messages(self, seq: TokenSeq, messages: list[Message]) -> Piece:
        """The new non-assistant messages as one user turn (ending `<|Assistant|>:`); only their images processed.

        Raises ValueError for no messages, an assistant or system message, a `seq` whose last turn is not closed
        (`add_generation` first), or `<image>` tags that do not match the images. The control-token guard never
        raises.
        """
        if any(m.role == Role.SYSTEM for m in messages):
            raise ValueError(
                "render_messages() takes user/tool messages (no assistant or system message); append "
                "generations with add_generation"
            )
        self._check_new_messages(seq, messages)
        [(_, text, images)] = self._turns(messages)
        total = len(seq.images) + len(images)
        if images and self.cropping is None and total > self.max_cropped_images and not self._warned:
            self._warned = True
            log.warning(
                "deepseek_vl2: %d images in an episode: DeepSeek-VL2's processor would now re-tile every "
                "earlier image without cropping; the continuous tokens keep the tiling the model saw (not "
                "the full render). Fix `cropping` for the run to avoid this.",
                total,
            )
        ids, vision = self._user(text, images, self._crop(total))
        return Piece(ids=ids, images=list(images), vision=vision)

    def render_full(self, messages: list[Message], add_generation_prompt: bool = False) -> Rendered:
        """The whole conversation as DeepSeek-VL2's processor formats it (`format_messages_v2`): BOS, then each turn;
        cropping = the fixed `cropping`, else the processor's rule on the conversation's image count. A conversation
        ending with a user turn already ends with the generation prompt `<|Assistant|>:`.

        Raises ValueError for a system message that is not first, an assistant message with images, or `<image>`
        tags that do not match the images.
        """
        del add_generation_prompt  # every user turn ends with the assistant opener
        turns = self._turns(messages)
        cropping = self._crop(sum(len(t[2]) for t in turns))
        ids = [self.processor.bos_id]
        parts = []
        for role, text, images in turns:
            if role == "system":
                ids += self.processor.encode(text.strip(), bos=False, eos=False)
            elif role == "assistant":
                ids += self._reply(text)
            else:
                user_ids, vision = self._user(text, images, cropping)
                ids += user_ids
                if vision is not None:
                    parts.append(vision)
        return Rendered(ids=ids, vision=VisionInputs.cat(parts))
