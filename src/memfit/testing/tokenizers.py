"""Tokenizers built locally from a word list, so tests and the demo model never touch a hub.

Two flavours cover every pipeline memfit supports:
- `clip_tokenizer(words)`: a real `CLIPTokenizer` (byte-level BPE with `</w>` word ends), the class
  Stable Diffusion pipelines expect, with merges that rebuild each listed word from its letters.
- `word_tokenizer(words)`: a word-level `PreTrainedTokenizerFast` with pad/bos/eos/unk, standing in
  for Gemma (Lumina2) and GLM (CogView4) tokenizers whose real vocabularies are hub downloads.
"""

from __future__ import annotations

from collections.abc import Iterable

# Enough everyday words that test prompts tokenize into distinct ids rather than a run of unknowns.
DEFAULT_WORDS = (
    "a an the of on in at with and to by under over near lighthouse dusk dawn cat dog house tree "
    "mountain river sky sea city street car red green blue yellow white black purple orange gray "
    "small large tiny big bright dark photo painting drawing portrait landscape night day sun moon "
    "star cloud rain snow forest field flower garden road bridge boat ship castle tower window door "
    "blurry ugly low quality circle square triangle background shape"
).split()


def _unique_lower(words: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for word in words:
        word = word.strip().lower()
        if word:
            seen.setdefault(word, None)
    return list(seen)


def clip_tokenizer(words: Iterable[str] = DEFAULT_WORDS, model_max_length: int = 77):
    """A CLIPTokenizer whose vocabulary is the letters and the given words.

    Merges are added word by word, left to right, so most words become a single token; where two
    words' merges compete, a word splits into a few in-vocabulary pieces, which is still valid BPE.
    """
    from transformers import CLIPTokenizer

    words = _unique_lower(words)
    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        vocab.setdefault(token, len(vocab))

    add("<|startoftext|>")
    add("<|endoftext|>")
    for char in sorted(set("".join(words)) | set("abcdefghijklmnopqrstuvwxyz0123456789")):
        add(char)
        add(char + "</w>")
    merges: list[tuple[str, str]] = []
    for word in words:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        current = pieces[0]
        for piece in pieces[1:]:
            if (current, piece) not in merges:
                merges.append((current, piece))
            current += piece
            add(current)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges)
    tokenizer.model_max_length = model_max_length
    return tokenizer


def word_tokenizer(words: Iterable[str] = DEFAULT_WORDS, model_max_length: int = 512):
    """A word-level fast tokenizer: one id per known word, `<unk>` otherwise, `<bos>` prepended."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {token: index for index, token in enumerate(specials + _unique_lower(words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )
