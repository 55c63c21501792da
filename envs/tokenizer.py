"""The shared word-level tokenizer of every seqrl language task, as a real `transformers` tokenizer.

A closed vocabulary (special tokens + every word the preference task and the GuessTheImage dialogue can
produce) in a `tokenizers` WordLevel model wrapped by `PreTrainedTokenizerFast`, so that models and
tokenizers round-trip with `save_pretrained` / `from_pretrained` and a model trained by one script loads in
another. Text is lower-cased and split on whitespace and punctuation ("france?" -> "france", "?"); a word
outside the vocabulary becomes `<unk>`, so junk text never crashes anything.

Special tokens: `<pad>` (id 0, distinct from `<eos>` so reward models can find the last real token),
`<bos>`, `<eos>`, `<unk>`, and `<sep>`, the turn separator between dialogue utterances.
"""

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK, SEP = "<pad>", "<bos>", "<eos>", "<unk>", "<sep>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, SEP)  # ids 0..4, in this order
PUNCTUATION = ("?", ".", ",", "!", "'")  # split off words by the pre-tokenizer, so they need ids too
DIGITS = tuple(str(d) for d in range(10))  # single digits, so numbers never fall to <unk> entirely


def vocab_words() -> list[str]:
    """Every non-special token, sorted: the union of the words of all language tasks."""
    from envs.guess_image import WORDS as DIALOGUE_WORDS
    from envs.preference import WORDS as PREFERENCE_WORDS

    return _normalize_words([*PREFERENCE_WORDS, *DIALOGUE_WORDS])


def _normalize_words(words) -> list[str]:
    """Lower-case, add punctuation and digits, drop special tokens and duplicates, sort (a stable id order)."""
    words = {w.lower() for w in words} | set(PUNCTUATION) | set(DIGITS)
    return sorted(words - set(SPECIAL_TOKENS))


def build_tokenizer(words: list[str] | None = None) -> PreTrainedTokenizerFast:
    """The seqrl tokenizer. `words` overrides the task words (punctuation and digits are always added)."""
    words = vocab_words() if words is None else _normalize_words(words)
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *words])}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    backend.normalizer = normalizers.Lowercase()
    # Split on whitespace, then split punctuation off the words; special tokens are matched before this.
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        sep_token=SEP,
        padding_side="right",
        model_max_length=512,
    )
    return tokenizer
