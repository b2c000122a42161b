"""Sentence splitting with nltk's Punkt, with or without pretrained Punkt data.

The nltk downloader is often unreachable on clusters (and is here), so when no pretrained Punkt
model for the language is installed we train one, unsupervised, on a sample of the input itself:
Punkt is an unsupervised algorithm, and a few megabytes of in-domain text is what it was designed
to learn abbreviations and collocations from.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from megatron_ext.config_loading import UserError

logger = logging.getLogger(__name__)

TRAINING_SAMPLE_CHARS = 4_000_000
"""How much input text Punkt is trained on when no pretrained model is installed."""


class SentenceSplitter:
    """Picklable Punkt splitter (sent to preprocessing workers).

    With ``keep_newlines`` the text is cut at sentence starts, so whitespace and newlines after a
    sentence stay attached to it and joining the pieces gives back the original text exactly (what
    Megatron-LM's ``--keep-newlines`` is for); without it, sentences come back stripped.
    """

    def __init__(self, punkt, *, keep_newlines: bool, source: str) -> None:
        self.punkt = punkt
        self.keep_newlines = keep_newlines
        self.source = source
        """``pretrained:<lang>`` or ``trained-on-input:<chars>``, reported in the summary."""

    def split(self, text: str) -> list[str]:
        if not self.keep_newlines:
            return self.punkt.tokenize(text)
        starts = [start for start, _ in self.punkt.span_tokenize(text)]
        if not starts:
            return [text] if text else []
        starts[0] = 0  # leading whitespace belongs to the first sentence
        ends = starts[1:] + [len(text)]
        return [text[s:e] for s, e in zip(starts, ends)]


def load_pretrained_punkt(lang: str):
    """The installed pretrained Punkt model for ``lang``, or None when nltk has no data for it."""
    from nltk.tokenize import PunktTokenizer

    try:
        return PunktTokenizer(lang)
    except LookupError:
        return None


def train_punkt(texts: Iterable[str], *, max_chars: int = TRAINING_SAMPLE_CHARS):
    """Train a Punkt model on up to ``max_chars`` characters of ``texts``; returns (model, chars)."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer, PunktTrainer

    trainer = PunktTrainer()
    trainer.INCLUDE_ALL_COLLOCS = True
    used = 0
    for text in texts:
        if used >= max_chars:
            break
        piece = text[: max_chars - used]
        trainer.train(piece, finalize=False)
        used += len(piece)
    if used == 0:
        raise UserError("cannot train a Punkt sentence splitter: the input has no text")
    trainer.finalize_training()
    return PunktSentenceTokenizer(trainer.get_params()), used


def build_splitter(*, lang: str, keep_newlines: bool, training_texts: Iterable[str]) -> SentenceSplitter:
    """Pretrained Punkt for ``lang`` when installed, else Punkt trained on ``training_texts``."""
    punkt = load_pretrained_punkt(lang)
    if punkt is not None:
        return SentenceSplitter(punkt, keep_newlines=keep_newlines, source=f"pretrained:{lang}")
    punkt, used = train_punkt(training_texts)
    logger.warning(
        "no pretrained nltk Punkt data for %r (nltk.download is unreachable here); trained Punkt "
        "on the first %d characters of the input instead", lang, used,
    )
    return SentenceSplitter(punkt, keep_newlines=keep_newlines, source=f"trained-on-input:{used}")
