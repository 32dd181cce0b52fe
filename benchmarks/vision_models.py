"""A tiny vision-language model built locally: an Idefics3 (a small vision tower, a pixel-shuffle
connector, a Llama text model) with the project's tokenizer and the image tokens added.

Idefics3 imports without torchvision, which the test command removes. The processor does not
split images, so every image becomes one run of ``image_seq_len`` placeholder tokens whatever
its size.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.models import _DONE, _fresh, _is_built, build_tokenizer

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
END_TOKEN = "<end_of_utterance>"
IMAGE_TOKENS = (IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN, END_TOKEN)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- else -%}"
    + IMAGE_TOKEN
    + "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '" + END_TOKEN + "' }}"
    "{%- endfor -%}"
)
"""Chat messages as the text and image placeholders of each part, in order (served models need
one for ``/v1/chat/completions``)."""


@dataclass(frozen=True)
class VisionSize:
    """The vision tower's size: ``image_size``/``patch_size`` patches a side, shuffled by
    ``scale_factor`` into ``(image_size / patch_size / scale_factor) ** 2`` embeddings."""

    image_size: int = 112
    patch_size: int = 14
    hidden: int = 64
    layers: int = 1
    heads: int = 4
    scale_factor: int = 2

    @property
    def embeds(self) -> int:
        side = self.image_size // self.patch_size // self.scale_factor
        return side * side


TEST_VISION = VisionSize()
# a tower whose forward is most of a cold request's prefill on this machine's CPUs
BENCHMARK_VISION = VisionSize(image_size=448, patch_size=14, hidden=384, layers=6, heads=6)


def build_idefics3(
    root: Path,
    *,
    vision: VisionSize = TEST_VISION,
    text_layers: int = 2,
    text_hidden: int = 128,
    seed: int = 0,
    name: str | None = None,
) -> Path:
    """A random-weight Idefics3ForConditionalGeneration with its processor, loadable by
    `LLM(model=)`. ``seed`` draws the weights: two seeds are two builds of one config."""
    name = name or (
        f"idefics3-v{vision.image_size}-p{vision.patch_size}-h{vision.hidden}-l{vision.layers}"
        f"-t{text_layers}x{text_hidden}-s{seed}-c1"
    )
    path = Path(root) / name
    if _is_built(path):
        return path
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    tokenizer_dir = build_tokenizer(root)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    _fresh(path)
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_hidden,
        intermediate_size=2 * text_hidden,
        num_hidden_layers=text_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=text_hidden // 4,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = Idefics3Config(
        vision_config={
            "hidden_size": vision.hidden,
            "intermediate_size": 2 * vision.hidden,
            "num_hidden_layers": vision.layers,
            "num_attention_heads": vision.heads,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
        },
        text_config=text.to_dict(),
        scale_factor=vision.scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    side = {"longest_edge": vision.image_size}
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size=side, max_image_size=side, do_resize=True
    )
    processor = Idefics3Processor(
        image_processor, tokenizer, image_seq_len=vision.embeds, chat_template=CHAT_TEMPLATE
    )
    model.save_pretrained(str(path), safe_serialization=True)
    processor.save_pretrained(str(path))  # the tokenizer with it
    (path / _DONE).touch()
    return path


def colour_blocks(seed: int, size: int = 96) -> Any:
    """A PIL image of random colour blocks, the same for the same seed."""
    from PIL import Image

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size))
    block = max(1, size // 8)
    for x in range(0, size, block):
        for y in range(0, size, block):
            colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
            image.paste(colour, (x, y, x + block, y + block))
    return image


def image_bytes(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image_prompt(question: str, after: str = "Describe it.") -> str:
    """A prompt that places one image after ``question``'s text, and ``after`` after it."""
    return f"{question}{IMAGE_TOKEN}{after}{END_TOKEN}"


def processor_settings(path: Path) -> dict[str, Any]:
    return dict(json.loads((Path(path) / "preprocessor_config.json").read_text()))
