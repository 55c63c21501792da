"""Tiny real-architecture Hugging Face checkpoints for the tests, built offline and saved with `save_pretrained`.

Each checkpoint is what a user's `--model-name-or-path` would point at, shrunk: a byte-level BPE tokenizer trained
with `tokenizers` on the task text (so task words are a few tokens each, as with a real checkpoint), the special
tokens the real family ships with and **no pad token**, and a randomly initialized model of that architecture:

    gpt2      GPT2LMHeadModel,   "<|endoftext|>" as bos = eos = unk          (as `gpt2`)
    llama     LlamaForCausalLM,  "<s>" / "</s>" / "<unk>", BOS added to every encoding, RMSNorm   (as TinyLlama)
    gpt_neox  GPTNeoXForCausalLM, "<|endoftext|>" as bos = eos = unk         (as `EleutherAI/pythia-70m`)
"""

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ARCHITECTURES = ("gpt2", "llama", "gpt_neox")
BPE_VOCAB_SIZE = 400  # merges beyond the 256 bytes: enough that most task words are 1-3 tokens
N_EMBD, N_LAYER, N_HEAD, MAX_POSITIONS = 32, 2, 2, 512  # tiny, but a real model of each family


def task_texts() -> list[str]:
    """Text of both language tasks: preference prompts and completions, dialogue utterances and replies."""
    from envs import guess_image, preference

    rng = np.random.default_rng(0)
    prompts = preference.train_prompts() + preference.heldout_prompts()
    completions = preference.sample_completions(prompts, rng, n=4)
    texts = prompts + [c.text for c in completions]
    return texts + guess_image.all_utterances() + list(guess_image.REPLIES)


def build_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the special tokens of `arch`'s real checkpoints and no pad token."""
    if arch == "llama":
        bos, eos, unk = "<s>", "</s>", "<unk>"
    else:
        bos = eos = unk = "<|endoftext|>"
    specials = list(dict.fromkeys([unk, bos, eos]))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE + len(specials),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(task_texts(), trainer=trainer)
    if arch == "llama":  # Llama tokenizers prepend <s> to every encoding
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=unk)


def build_model(arch: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0):
    """A randomly initialized tiny causal LM of `arch` for this tokenizer (config ids = the tokenizer's)."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(seed)
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if arch == "gpt2":
        config = GPT2Config(n_embd=N_EMBD, n_layer=N_LAYER, n_head=N_HEAD, n_positions=MAX_POSITIONS, **ids)
        return GPT2LMHeadModel(config)
    if arch == "llama":
        config = LlamaConfig(
            hidden_size=N_EMBD,
            intermediate_size=2 * N_EMBD,
            num_hidden_layers=N_LAYER,
            num_attention_heads=N_HEAD,
            num_key_value_heads=N_HEAD,
            max_position_embeddings=MAX_POSITIONS,
            **ids,
        )
        return LlamaForCausalLM(config)
    if arch == "gpt_neox":
        config = GPTNeoXConfig(
            hidden_size=N_EMBD,
            intermediate_size=2 * N_EMBD,
            num_hidden_layers=N_LAYER,
            num_attention_heads=N_HEAD,
            max_position_embeddings=MAX_POSITIONS,
            **ids,
        )
        return GPTNeoXForCausalLM(config)
    raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")


def save_tiny_checkpoint(arch: str, out_dir: Path) -> Path:
    """Build and `save_pretrained` a tiny `arch` model with its tokenizer into `out_dir`; returns `out_dir`."""
    tokenizer = build_tokenizer(arch)
    model = build_model(arch, tokenizer)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
