"""The tiny Hugging Face checkpoints used by the real-model tests load back as a user's checkpoint would."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_checkpoint_loads_with_auto_classes_and_has_no_pad_token(hf_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(hf_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(hf_checkpoint)
    assert tokenizer.pad_token is None
    assert tokenizer.eos_token_id is not None and model.config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer("what is the capital of france ?")["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert 1 < len(ids) < 30  # byte-level BPE: several tokens per sentence, no unknowns
    if model.config.model_type == "llama":
        assert ids[0] == tokenizer.bos_token_id  # Llama prepends <s>
    else:
        assert ids[0] != tokenizer.bos_token_id
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text.strip() == "what is the capital of france ?"
    assert model(input_ids=torch.tensor([ids])).logits.shape[-1] >= len(tokenizer)
