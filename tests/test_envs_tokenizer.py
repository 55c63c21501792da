"""The shared word-level tokenizer: round trips, unknown words, special tokens, save/load."""

from transformers import AutoTokenizer

from envs.tokenizer import BOS, EOS, PAD, SEP, SPECIAL_TOKENS, UNK, build_tokenizer, vocab_words


def test_special_tokens_have_fixed_distinct_ids():
    tok = build_tokenizer()
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.pad_token == PAD and tok.eos_token == EOS and tok.bos_token == BOS
    assert tok.unk_token == UNK and tok.sep_token == SEP
    assert tok.pad_token_id != tok.eos_token_id  # reward models read the last non-pad token


def test_round_trip_of_known_text():
    tok = build_tokenizer()
    text = "what is the capital of france ? <sep> is it red ? <eos>"
    ids = tok(text).input_ids
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    # case and punctuation glued to words are normalized
    assert tok("What is the capital of France?").input_ids == tok("what is the capital of france ?").input_ids


def test_unknown_words_and_junk_map_to_unk_without_crashing():
    tok = build_tokenizer()
    for junk in ["zzqx", "", "🙂 ünïcödé", "a" * 10_000, "\x00\n\t", "<pad><eos>"]:
        ids = tok(junk).input_ids
        assert all(0 <= i < len(tok) for i in ids)
    assert tok("zzqx").input_ids == [tok.unk_token_id]


def test_vocabulary_is_deterministic_and_covers_both_tasks():
    words = vocab_words()
    assert words == sorted(set(words)) and not set(words) & set(SPECIAL_TOKENS)
    assert {"paris", "france", "red", "circle", "?", "."} <= set(words)
    assert build_tokenizer().get_vocab() == build_tokenizer().get_vocab()


def test_save_pretrained_round_trip(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "is it a big red circle ? <sep> yes ."
    assert loaded(text).input_ids == tok(text).input_ids
    assert loaded.pad_token_id == tok.pad_token_id and loaded.sep_token_id == tok.sep_token_id
    batch = loaded(["paris", "the capital is paris"], padding=True)
    assert batch["input_ids"][0][1:] == [tok.pad_token_id] * 3 and batch["attention_mask"][0] == [1, 0, 0, 0]
