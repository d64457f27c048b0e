"""The parts of the tiny random-weight pipelines that several families share: tokenizers built offline from a
hand-written vocabulary, and CLIP text encoders, VAEs and UNets a few layers deep. Each family's module
(stk.models.families) puts its pipeline together from them; stk.models.tiny writes it."""

from __future__ import annotations

import itertools
import json
import string
from pathlib import Path
from typing import Any

from diffusers import UNet2DConditionModel

# Deep import where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from tokenizers import AddedToken, Tokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder
from tokenizers.models import BPE, Unigram
from tokenizers.pre_tokenizers import ByteLevel, Metaspace
from tokenizers.processors import TemplateProcessing
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

__all__ = [
    "CLIP_LENGTH",
    "WORDS",
    "byte_merges",
    "checked",
    "clip",
    "clip_tokenizer",
    "merge_order",
    "mistral_tokenizer",
    "qwen_tokenizer",
    "t5",
    "t5_tokenizer",
    "unet",
    "vae",
]

# Words that become single tokens, so captions tokenize into something like real subwords.
WORDS = ("a", "an", "the", "photo", "of", "cat", "dog", "on", "in", "with", "and", "red", "blue", "painting", "man")
CLIP_LENGTH = 77
# Qwen3's chat template as it renders plain messages: each one between <|im_start|>ROLE and <|im_end|>, then the
# assistant's turn; with enable_thinking=False an empty thinking block follows (what Qwen3's own template does).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Mistral-Small-3.1's chat template as it renders a system turn and user turns of text (and image) blocks: the system
# message between [SYSTEM_PROMPT] and [/SYSTEM_PROMPT] after the BOS token, each user turn between [INST] and [/INST].
# (The real one's dated default system message, for chats without one, is left out.)
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content'] %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if message['content'] is string %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' }}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}{{- '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}"
)
# Mistral-Small-3.1's special tokens that its chat template and PixtralProcessor name, in the real vocabulary's order
MISTRAL3_SPECIAL = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
)


def checked(tokenizer: PreTrainedTokenizerBase, expected: int) -> PreTrainedTokenizerBase:
    """from_pretrained can return an empty tokenizer instead of raising (FACTS.md): fail here, not in a later test."""
    if len(tokenizer) != expected:
        raise RuntimeError(f"tiny {type(tokenizer).__name__} loaded {len(tokenizer)} tokens, expected {expected}")
    return tokenizer


def clip_tokenizer(folder: Path, pad_token: str = "<|endoftext|>") -> PreTrainedTokenizerBase:
    """CLIP's byte-level BPE from a hand-written vocab.json + merges.txt: every byte alone and word-final ('</w>'),
    and merges that join each of WORDS left to right."""
    alphabet = sorted(ByteLevel.alphabet())
    merges: dict[tuple[str, str], None] = {}
    for word in WORDS:
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            merges[(parts[0], parts[1])] = None
            parts = [parts[0] + parts[1], *parts[2:]]
    tokens = [*alphabet, *(c + "</w>" for c in alphabet), *(a + b for a, b in merges)]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    tokenizer = CLIPTokenizer.from_pretrained(folder, pad_token=pad_token, model_max_length=CLIP_LENGTH)
    return checked(tokenizer, len(vocab))


def merge_order(words: tuple[str, ...]) -> tuple[str, ...]:
    """`words` ordered so that qwen_tokenizer makes each one a single token, alone and after a space: a word's merges
    come before those of any word whose first merge could fire inside it, or that it starts with ('an' in 'and')."""

    def first(word: str) -> tuple[str, str]:
        return ("Ġ", word) if len(word) == 1 else (word[0], word[1])

    def splits(word: str, other: str) -> bool:  # other's merges would split word if they came first
        pair = first(other)
        inside = len(word) > 1 and word[0] == pair[1] if pair[0] == "Ġ" else pair in itertools.pairwise(word[1:])
        return word != other and (inside or word.startswith(other))

    pending, ordered = list(dict.fromkeys(words)), []
    while pending:
        word = next((w for w in pending if not any(splits(v, w) for v in pending)), pending[0])
        ordered.append(word)
        pending.remove(word)
    return tuple(ordered)


def byte_merges(words: tuple[str, ...]) -> list[tuple[str, str]]:
    """A byte-level BPE's merges that join each of `words` left to right and then put the space ('Ġ') in front."""
    merges: dict[tuple[str, str], None] = {}
    for word in words:
        parts = list(word)
        while len(parts) > 1:
            merges[(parts[0], parts[1])] = None
            parts = [parts[0] + parts[1], *parts[2:]]
        merges[("Ġ", word)] = None
    return list(merges)


def qwen_tokenizer(folder: Path, words: tuple[str, ...] = WORDS) -> PreTrainedTokenizerBase:
    """Qwen2's byte-level BPE (Qwen3's tokenizer class) from a hand-written vocabulary: every byte, `byte_merges` of
    `words`, the chat tokens, and QWEN3_CHAT_TEMPLATE."""
    merges = byte_merges(words)
    tokens = [*sorted(ByteLevel.alphabet()), *(a + b for a, b in merges), "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    chat = ["<|im_start|>", "<|im_end|>"]
    pairs: Any = merges  # the tokenizers library takes pairs; transformers annotates strings
    built = Qwen2Tokenizer(vocab=vocab, merges=pairs, model_max_length=131072)  # Qwen3's limit
    built.add_tokens([AddedToken(token, special=True) for token in chat], special_tokens=True)
    built.chat_template = QWEN3_CHAT_TEMPLATE
    built.save_pretrained(folder)
    return checked(Qwen2Tokenizer.from_pretrained(folder), len(vocab) + len(chat))


def mistral_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """Mistral-Small-3.1's kind of tokenizer (a byte-level BPE in a tokenizer.json, no BOS added: its chat template
    writes it) from a hand-written vocabulary: the special tokens, every byte, `byte_merges` of WORDS, and
    MISTRAL3_CHAT_TEMPLATE."""
    merges = byte_merges(WORDS)
    tokens = [*MISTRAL3_SPECIAL, *sorted(ByteLevel.alphabet()), *(a + b for a, b in merges)]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    backend = Tokenizer(BPE(vocab, merges, unk_token="<unk>"))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False)
    backend.decoder = ByteLevelDecoder()
    backend.add_special_tokens([AddedToken(token, special=True) for token in MISTRAL3_SPECIAL])
    built = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=131072,
    )
    built.chat_template = MISTRAL3_CHAT_TEMPLATE
    built.save_pretrained(folder)
    return checked(PreTrainedTokenizerFast.from_pretrained(folder), len(vocab))


def t5_tokenizer(folder: Path, max_length: int) -> PreTrainedTokenizerBase:
    """T5's Unigram (sentencepiece) model built with the tokenizers library: every printable ASCII character alone
    and at a word start ('▁'), plus WORDS; equal scores, so the fewest pieces win and words stay whole."""
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = dict.fromkeys(["▁", *chars, *("▁" + c for c in chars), *("▁" + w for w in WORDS)])
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *((piece, -1.0) for piece in pieces)]
    backend = Tokenizer(Unigram(vocab, unk_id=2))
    backend.pre_tokenizer = Metaspace()
    backend.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    tokenizer = T5Tokenizer.from_pretrained(folder, extra_ids=0, model_max_length=max_length)
    return checked(tokenizer, len(vocab))


def clip(tokenizer: PreTrainedTokenizerBase, hidden: int, projection: bool = False) -> PreTrainedModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def t5(tokenizer: PreTrainedTokenizerBase, width: int) -> PreTrainedModel:
    """A two-layer T5 encoder of `width` (the denoiser's text width), gated-GELU like T5 v1.1."""
    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=width,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )


def vae(latent_channels: int, scaling_factor: float, shift_factor: float | None = None) -> AutoencoderKL:
    """Four blocks like the real ones (8x down: 64 px -> 8x8 latents). Flux's VAE has a shift and no quant convs."""
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=1,
        latent_channels=latent_channels,
        sample_size=64,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=shift_factor is None,
        use_post_quant_conv=shift_factor is None,
    )


def unet(cross_attention_dim: int, **extra: Any) -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=(2, 4),
        **extra,
    )
